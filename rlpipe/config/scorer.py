"""The `scorer` section: the actors that run the models scoring entries of reward.functions (reward models, judges)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key


@dataclass
class ScorerConfig:
    num_workers: int = key(
        1, "scorer actors, each holding every model that scores an entry of reward.functions (started only where one "
        "does); reward worker i calls scorer i modulo their number"
    )
    batch_size: int = key(8, "samples per forward pass of a reward model")
    dtype: Literal["float32", "bfloat16"] = key(
        "float32", "the models' weights and activations (reward models, judges)"
    )
    max_model_len: int = key(4096, "a judge's context: its request and reply, in the judge's tokens")
    kv_cache_gib: int = key(1, "a judge engine's KV cache (whole GiB) on CPU")
    max_restarts: int = key(
        3, "a scorer actor that dies (killed, out of memory) is started again this many times; the call it was "
        "answering waits for the new process within its time limit"
    )

    def check(self) -> None:
        require(self.num_workers >= 1, "scorer.num_workers: must be >= 1")
        require(self.batch_size >= 1, "scorer.batch_size: must be >= 1")
        require(self.max_restarts >= 0, "scorer.max_restarts: must be >= 0")
        require(self.max_model_len >= 16, "scorer.max_model_len: must be >= 16")
        require(self.kv_cache_gib >= 1, "scorer.kv_cache_gib: must be >= 1")
