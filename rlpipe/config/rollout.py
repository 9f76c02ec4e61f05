"""The `rollout` section: the vLLM engines and how they sample; and what vLLM on TorchTPU cannot do, a rule of this
section that the config checks (engines on a TPU slice) and the engine applies when it starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key
from rlpipe.config.sync import SyncConfig

# Above this, sampling is close to uniform over the vocabulary: no recipe means it, a typo (100 for 1.0) might.
MAX_TEMPERATURE = 10.0


@dataclass
class RolloutConfig:
    group_size: int = key(8, "completions sampled per prompt")
    max_tokens: int = key(128, "maximum completion length in tokens")
    temperature: float = key(1.0, "sampling temperature, 0 (greedy) to 10")
    top_p: float = key(1.0, "nucleus sampling threshold")
    dtype: Literal["float32", "bfloat16"] = key("float32", "rollout engine dtype")
    num_engines: int = key(1, "number of vLLM rollout engines (one Ray actor each)")
    kv_cache_gib: int = key(1, "KV-cache space per CPU engine in GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = key(0.3, "vLLM memory fraction (on CPU, of the NUMA node)")
    max_model_len: int = key(512, "vLLM context length (prompt + completion)")
    kv_block_size: int | None = key(
        None,
        "tokens per KV-cache block; none: 32 on CPU (a group's samples then share every full block of their prompt, "
        "instead of vLLM's 128, which no prompt under 129 tokens fills), vLLM's choice elsewhere",
    )
    enforce_eager: bool | None = key(
        None,
        "run the engine's model eagerly (vLLM's enforce_eager) instead of compiled; null: eager on CPU (an engine "
        "starts in seconds), compiled elsewhere (on TPU vLLM on TorchTPU compiles and precompiles its graphs)",
    )
    in_process: bool = key(True, "run the engine inside the actor process (fast start) instead of a child process")
    tensor_parallel: int = key(1, "tensor-parallel degree of each engine (vLLM tensor_parallel_size)")
    model_impl: Literal["vllm", "rlpipe"] = key(
        "vllm",
        "the model code the engine runs: vLLM's own, or rlpipe's (the learner's modules; vLLM's paged attention)",
    )
    generate_timeout_s: float = key(
        3600.0, "an engine that has not returned a step's completions within this is replaced like a dead one"
    )
    max_restarts: int = key(
        3, "an engine that dies is started again (current weights pushed, its prompts regenerated), this many times"
    )
    tools: list[str] = key(
        [],
        "tool functions for multi-turn episodes, as import paths 'package.module:function' (TRL's tools=; "
        "docs/tools.md)",
    )
    environment_factory: str | None = key(
        None,
        "a class 'package.module:Class' whose instances hold one episode's state: reset(**row) per sample, its public "
        "methods are the episode's tools (TRL's environment_factory=)",
    )
    max_turns: int = key(8, "model turns per multi-turn episode (an episode still calling tools after it is cut)")
    tool_timeout_s: float = key(30.0, "a tool call not done within this answers the model with an error message")

    def check(self) -> None:
        require(self.group_size >= 2, f"rollout.group_size: must be >= 2 for group advantages, got {self.group_size}")
        require(self.max_tokens >= 1, "rollout.max_tokens: must be >= 1")
        require(
            0 <= self.temperature <= MAX_TEMPERATURE,
            f"rollout.temperature: must be between 0 (greedy) and {MAX_TEMPERATURE:g}, got {self.temperature}",
        )
        require(0 < self.top_p <= 1, "rollout.top_p: must be in (0, 1]")
        require(self.num_engines >= 1, "rollout.num_engines: must be >= 1")
        require(
            self.kv_block_size is None or (self.kv_block_size > 0 and self.kv_block_size % 32 == 0),
            "rollout.kv_block_size: must be a positive multiple of 32 (what vLLM's CPU attention takes)",
        )
        require(self.max_restarts >= 0, "rollout.max_restarts: must be >= 0")
        require(self.generate_timeout_s > 0, "rollout.generate_timeout_s: must be > 0")
        require(self.tensor_parallel >= 1, "rollout.tensor_parallel: must be >= 1")
        require(self.max_turns >= 1, "rollout.max_turns: must be >= 1")
        require(self.tool_timeout_s > 0, "rollout.tool_timeout_s: must be > 0")
        named = [("rollout.tools", path) for path in self.tools]
        named += [("rollout.environment_factory", self.environment_factory)] if self.environment_factory else []
        for where, path in named:
            module, _, name = path.partition(":")
            require(bool(module and name), f"{where}: {path!r} is not an import path 'package.module:name'")

    @property
    def multi_turn(self) -> bool:
        """Whether samples are episodes with tools (rlpipe/tools.py) rather than one completion each."""
        return bool(self.tools) or self.environment_factory is not None


def torchtpu_refusal(cfg: RolloutConfig, sync: SyncConfig) -> str | None:
    """What vLLM on TorchTPU cannot do, or would change without a word (read from vllm-torchtpu 0.29's source): it
    computes in bfloat16 whatever dtype it is given, reports each sampled token's log-prob before temperature (the
    importance weights need the log-probs the tokens were sampled with), and returns no prompt log-probs."""
    if sync.probe == "replay":
        return (
            "sync.probe: replay needs log-probs of a given sequence, which vLLM on TorchTPU does not return; use auto"
        )
    if cfg.dtype != "bfloat16":
        return (
            f"rollout.dtype: vLLM on TorchTPU computes in bfloat16 only; set rollout.dtype=bfloat16 (not {cfg.dtype})"
        )
    if cfg.temperature != 1.0:
        return (
            "rollout.temperature: vLLM on TorchTPU reports log-probs before temperature, which match the sampling "
            f"only at 1.0; set rollout.temperature=1.0 (not {cfg.temperature:g})"
        )
    return None
