"""The `rollout` section: the vLLM engines and how they sample; and what vLLM on TorchTPU cannot do, a rule of this
section that the config checks (engines on a TPU slice) and the engine applies when it starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key
from rlpipe.config.sync import SyncConfig

# vLLM's SamplingParams refuses a temperature above 2 (vllm/sampling_params.py, in vLLM for CPU and for TorchTPU):
# refused here, in one line, before any engine starts.
MAX_TEMPERATURE = 2.0

# vLLM SamplingParams fields rollout.generation_kwargs may set (TRL's generation_kwargs): those rlpipe does not set
# itself from its own keys, and that leave the completion's token ids and log-probs what the learner trains on.
GENERATION_KWARGS = ("presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids", "bad_words")
# Of those, the ones that change the distribution tokens are sampled from, and the value that leaves it alone.
_RESHAPING_KWARGS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0, "bad_words": []}

# The defaults of the tool limits of multi-turn episodes (the episode loop's too, rlpipe/tools/episodes.py): twice
# the calls that run at once in an engine, and ten calls at the default rollout.tool_timeout_s.
MAX_TOOL_CALLS_PER_TURN = 16
MAX_TOOL_TIME_PER_EPISODE_S = 300.0


@dataclass
class RolloutConfig:
    group_size: int = key(8, "completions sampled per prompt")
    max_tokens: int = key(128, "maximum completion length in tokens")
    temperature: float = key(1.0, "sampling temperature, 0 (greedy) to 2")
    top_p: float = key(1.0, "nucleus sampling threshold")
    top_k: int = key(-1, "sample among the k most likely tokens only; -1: all tokens")
    min_p: float = key(0.0, "leave out tokens less likely than min_p times the most likely one; 0: none")
    repetition_penalty: float = key(
        1.0, "divide the logits of tokens already in the prompt or completion by this (vLLM's); 1: none"
    )
    stop: list[str] = key([], "strings that end a completion; the completion's text and token ids keep the string")
    generation_kwargs: dict = key(
        {},
        f"more vLLM SamplingParams for rollouts and evaluation (TRL's generation_kwargs), among: "
        f"{', '.join(GENERATION_KWARGS)}",
    )
    dtype: Literal["float32", "bfloat16"] = key("float32", "rollout engine dtype")
    num_engines: int = key(1, "number of vLLM rollout engines (one Ray actor each)")
    kv_cache_gib: int = key(1, "KV-cache space per CPU engine in GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = key(
        0.3, "vLLM memory fraction: on CPU of the NUMA node, on a TPU chip or GPU of its memory, on a share of a GPU "
        "(placement.rollout.gpus below 1) of that share's"
    )
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
    close_timeout_s: float = key(
        60.0, "at the run's end, how long each engine may take to stop and free its shared memory before it is killed"
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
    verifiers_tools: str | None = key(
        None,
        "a verifiers task set (named as data.verifiers_taskset names one) whose shared tool servers' tools "
        "(Taskset.toolsets) join the episode's tools (docs/tools.md)",
    )
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral", "pythonic"] = key(
        "auto",
        "the format the model writes tool calls in (vLLM's tool parser of that name; hermes: <tool_call>{json}"
        "</tool_call>, read as TRL reads it); auto: the format the chat template teaches (docs/tools.md)",
    )
    max_turns: int = key(8, "model turns per multi-turn episode (an episode still calling tools after it is cut)")
    tool_timeout_s: float = key(30.0, "a tool call not done within this answers the model with an error message")
    max_tool_calls_per_turn: int = key(
        MAX_TOOL_CALLS_PER_TURN,
        "tool calls run per model turn; the turn's later calls are answered with an error message, not run",
    )
    max_tool_time_per_episode_s: float = key(
        MAX_TOOL_TIME_PER_EPISODE_S,
        "seconds an episode's tool calls may take, added up; once spent, its later calls are answered with an error "
        "message, not run (a call started before runs to rollout.tool_timeout_s)",
    )
    unsafe_no_sandbox: bool = key(
        False,
        "run the tools that execute model-written code (rlpipe.tools:python) WITHOUT the kernel sandbox: they can read "
        "and write this machine's files, reach the network and outlive the call; only for code you would run yourself",
    )

    def check(self) -> None:
        require(self.group_size >= 2, f"rollout.group_size: must be >= 2 for group advantages, got {self.group_size}")
        require(self.max_tokens >= 1, "rollout.max_tokens: must be >= 1")
        require(
            0 <= self.temperature <= MAX_TEMPERATURE,
            f"rollout.temperature: must be between 0 (greedy) and {MAX_TEMPERATURE:g}, got {self.temperature}",
        )
        require(0 < self.top_p <= 1, "rollout.top_p: must be in (0, 1]")
        require(
            self.top_k == -1 or self.top_k >= 1,
            f"rollout.top_k: must be -1 (all tokens) or at least 1, got {self.top_k}",
        )
        require(0 <= self.min_p <= 1, f"rollout.min_p: must be in [0, 1], got {self.min_p}")
        require(
            self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty),
            f"rollout.repetition_penalty: must be > 0 (1: none), got {self.repetition_penalty}",
        )
        require(all(self.stop), "rollout.stop: a stop string must not be empty")
        self._check_generation_kwargs()
        reshaped = ", ".join(f"rollout.{name}" for name in self.reshaping_keys())
        require(
            not reshaped or self.temperature in (0.0, 1.0),
            f"{reshaped.split(', ')[0]}: with {reshaped} set, vLLM reports log-probs either after it or before "
            f"temperature, and the learner's (temperature only) match neither; set rollout.temperature=1.0 "
            f"(not {self.temperature:g}) or leave {reshaped} at the default",
        )
        require(self.num_engines >= 1, "rollout.num_engines: must be >= 1")
        require(
            self.kv_block_size is None or (self.kv_block_size > 0 and self.kv_block_size % 32 == 0),
            "rollout.kv_block_size: must be a positive multiple of 32 (what vLLM's CPU attention takes)",
        )
        require(self.max_restarts >= 0, "rollout.max_restarts: must be >= 0")
        require(self.generate_timeout_s > 0, "rollout.generate_timeout_s: must be > 0")
        require(self.close_timeout_s >= 0, "rollout.close_timeout_s: must be >= 0")
        require(self.tensor_parallel >= 1, "rollout.tensor_parallel: must be >= 1")
        require(self.max_turns >= 1, "rollout.max_turns: must be >= 1")
        require(self.tool_timeout_s > 0, "rollout.tool_timeout_s: must be > 0")
        require(
            self.max_tool_calls_per_turn >= 1,
            f"rollout.max_tool_calls_per_turn: must be >= 1, got {self.max_tool_calls_per_turn}",
        )
        require(
            self.max_tool_time_per_episode_s > 0 and math.isfinite(self.max_tool_time_per_episode_s),
            f"rollout.max_tool_time_per_episode_s: must be a number of seconds > 0, got "
            f"{self.max_tool_time_per_episode_s:g}",
        )
        named = [("rollout.tools", path) for path in self.tools]
        named += [("rollout.environment_factory", self.environment_factory)] if self.environment_factory else []
        require(self.verifiers_tools != "", "rollout.verifiers_tools: empty; name a verifiers task set, or null")
        for where, path in named:
            module, _, name = path.partition(":")
            require(bool(module and name), f"{where}: {path!r} is not an import path 'package.module:name'")

    @property
    def multi_turn(self) -> bool:
        """Whether samples are episodes with tools (rlpipe/tools.py) rather than one completion each."""
        return bool(self.tools) or self.environment_factory is not None or self.verifiers_tools is not None

    def _check_generation_kwargs(self) -> None:
        kwargs = self.generation_kwargs
        unknown = sorted(set(kwargs) - set(GENERATION_KWARGS))
        require(
            not unknown,
            f"rollout.generation_kwargs: {', '.join(unknown)} is not among {', '.join(GENERATION_KWARGS)} (the "
            f"sampling keys of the rollout section set the others)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = kwargs.get(name, 0.0)
            require(
                _is_number(value) and -2 <= value <= 2,
                f"rollout.generation_kwargs: {name} must be a number in [-2, 2], got {value!r}",
            )
        min_tokens = kwargs.get("min_tokens", 0)
        require(
            _is_integer(min_tokens) and 0 <= min_tokens <= self.max_tokens,
            f"rollout.generation_kwargs: min_tokens must be an integer from 0 to rollout.max_tokens "
            f"({self.max_tokens}), got {min_tokens!r}",
        )
        ids = kwargs.get("stop_token_ids", [])
        require(
            isinstance(ids, list) and all(_is_integer(i) and i >= 0 for i in ids),
            f"rollout.generation_kwargs: stop_token_ids must be a list of token ids, got {ids!r}",
        )
        words = kwargs.get("bad_words", [])
        require(
            isinstance(words, list) and all(isinstance(w, str) and w for w in words),
            f"rollout.generation_kwargs: bad_words must be a list of non-empty strings, got {words!r}",
        )

    def reshaping_keys(self) -> list[str]:
        """The keys set to change the distribution tokens are sampled from, beyond temperature: vLLM applies them
        after the model's logits, where the learner's log-probs do not follow."""
        changed = [
            name
            for name, neutral in (("top_p", 1.0), ("top_k", -1), ("min_p", 0.0), ("repetition_penalty", 1.0))
            if getattr(self, name) != neutral
        ]
        return changed + [
            f"generation_kwargs.{name}"
            for name, neutral in _RESHAPING_KWARGS.items()
            if self.generation_kwargs.get(name, neutral) != neutral
        ]

    def logprobs_mode(self) -> str:
        """vLLM's `logprobs_mode` whose log-probs are the learner's: after temperature (processed, which also
        follows every filter and penalty) when nothing reshapes sampling; else the model's own (raw, before
        temperature, filters and penalties), which the config check allows only at temperature 1.0 (or 0, greedy,
        where the learner takes temperature 1)."""
        return "raw_logprobs" if self.reshaping_keys() else "processed_logprobs"


# The vLLM build a rollout engine runs (the device table of docs/architecture.md): vLLM for CPU, vLLM for CUDA, vLLM
# on TorchTPU. Decided once, at start-up, from where the engines are placed (`Config.engine_platform`); what vLLM
# on TorchTPU cannot do is refused by it, and the engine checks the platform it finds against it.
EnginePlatform = Literal["vllm-cpu", "vllm", "vllm-torchtpu"]
# The engine platform of each platform name `rlpipe.rollout.vllm_worker.vllm_platform` reports.
ENGINE_PLATFORMS: dict[str, EnginePlatform] = {"cpu": "vllm-cpu", "cuda": "vllm", "torchtpu": "vllm-torchtpu"}


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


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
