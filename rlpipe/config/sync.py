"""The `sync` section: how weights reach the engines after each update, and how each version is checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key

# The adapter ranks vLLM's `max_lora_rank` takes (vllm/config/lora.py `MaxLoRARanks`, vLLM 0.32): an engine is
# started with the smallest one that holds learner.lora.rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int | None:
    """The engine's `max_lora_rank` for adapters of rank `rank`; None above the largest vLLM takes."""
    return next((allowed for allowed in VLLM_LORA_RANKS if allowed >= rank), None)


@dataclass
class SyncConfig:
    transport: Literal["auto", "ray", "shm", "gloo"] = key(
        "auto",
        "weight transport: auto (per learner-rank/engine pair: shm on one host, ray across hosts), ray (object "
        "store), shm (shared memory; every pair on one host), gloo (torch.distributed)",
    )
    bucket_mb: float = key(64.0, "weights travel in buckets of about this many MiB, packed two buckets ahead")
    probe_tolerance: float | None = key(
        None,
        "allowed |engine - learner| logprob on the probe after a sync, else it is rolled back: the max over tokens "
        "for a float32 rollout, the mean for bf16 (its kernels differ from the float32 learner on every token; "
        "there no one token may be off by more than 10x it either); null: 1e-4 (float32) or 0.15 (bf16)",
    )
    probe: Literal["auto", "replay", "decode"] = key(
        "auto",
        "how each engine's log-probs are checked after a sync: replay (its log-probs of the probe sequence), decode "
        "(engine and learner each continue the sequence greedily), auto: replay, or decode on vLLM for TorchTPU, "
        "which returns no log-probs of a given sequence",
    )
    on_generation: Literal["finish", "abort"] = key(
        "finish", "a sync arriving mid-generation waits for in-flight requests (finish) or aborts them (abort)"
    )
    keep_previous: bool = key(
        True, "engines keep the previous version's weights (one extra copy) so a failed check rolls back"
    )
    timeout_s: float = key(
        300.0,
        "deadline of each step of a sync (begin, every send and receipt, the engine's write and probe, the liveness "
        "check of an engine): one passing it fails the attempt, and an engine that does not answer is replaced",
    )
    retries: int = key(2, "a failed sync is tried again this many times, then the run stops as a lost worker")
    retry_backoff_s: float = key(
        1.0, "wait before a failed sync's first retry; each later retry waits twice as long, up to retry_backoff_max_s"
    )
    retry_backoff_max_s: float = key(30.0, "the longest wait between two attempts of a sync")
    lora: Literal["auto", "adapters", "merged"] = key(
        "auto",
        "with learner.lora, what a sync sends: adapters (the adapters alone; the engines load the base once and "
        "apply them through vLLM's LoRA support), merged (every adapted weight as W + alpha/rank B A), auto: "
        "adapters where the engines can take them, else merged (the run says why)",
    )
    engine_write: Literal["in_place", "reload"] = key(
        "in_place",
        "how a CPU engine applies a version: in_place (copy into the weights it keeps beside its packed GEMM copies, "
        "then repack; one more copy of the linear weights in memory) or reload (vLLM rebuilds every layer); "
        "quantized, MoE and TPU engines always reload",
    )

    def probe_tolerance_for(self, rollout_dtype: str) -> float:
        if self.probe_tolerance is not None:
            return self.probe_tolerance
        # bf16: clean syncs of the test models and SmolLM2-135M stay well below a mean of 0.15; one corrupt weight,
        # two swapped chunks of a q_proj or the previous version's weights move it further (docs/weight-sync.md)
        return 1e-4 if rollout_dtype == "float32" else 0.15

    def check(self) -> None:
        require(self.bucket_mb > 0, "sync.bucket_mb: must be > 0")
        require(self.probe_tolerance is None or self.probe_tolerance > 0, "sync.probe_tolerance: must be > 0 or null")
        require(self.timeout_s > 0, "sync.timeout_s: must be > 0")
        require(self.retries >= 0, "sync.retries: must be >= 0")
        require(self.retry_backoff_s >= 0, "sync.retry_backoff_s: must be >= 0")
        require(self.retry_backoff_max_s >= self.retry_backoff_s,
                "sync.retry_backoff_max_s: must be >= sync.retry_backoff_s")
