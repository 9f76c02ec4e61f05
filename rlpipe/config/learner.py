"""The `learner` section: the learner ranks, their device, precision, sharding and the compiled step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key


@dataclass
class LearnerConfig:
    ranks: int = key(1, "learner processes (Ray actors) in one torch.distributed group; >1 shards SimpleFSDP-style")
    device: Literal["cpu", "cuda", "tpu", "xla"] = key("cpu", "learner device kind (see rlpipe/device.py)")
    param_dtype: Literal["float32", "bfloat16"] | None = key(
        None, "dtype parameters are gathered and computed in (null: model.dtype, the master-weight dtype)"
    )
    reduce_dtype: Literal["float32", "bfloat16"] = key("float32", "dtype gradients are reduce-scattered in")
    graph: bool = key(False, "capture forward+loss+backward+clip+AdamW as one compiled graph (false: eager)")
    activation_checkpointing: bool = key(
        False,
        "recompute each decoder layer in backward: saves activations and, when sharded, keeps only one layer's "
        "gathered weights alive because the recompute gathers them again",
    )
    packing: bool = key(
        True,
        "forward passes run on each micro-batch's sequences packed into one row, so no padding token is computed "
        "(the graph step pads that row to a bucket of learner.packed_buckets: its shapes are static)",
    )
    share_prompts: bool = key(
        True,
        "in packed forwards a group's common prompt runs once and every completion reads it, instead of once per "
        "sample (dense models, model.kernels.attention=torch)",
    )
    skip_zero_advantage: bool = key(
        True,
        "the eager step does not run samples whose advantage is 0 (their group's rewards are all equal): without a "
        "KL term or a router loss they add exactly 0 to the loss and its gradient, and they still count in its "
        "denominators, so the update is the same; entropy and the log-prob gap then cover the samples run",
    )
    length_buckets: list[int] = key(
        [64, 128, 256, 512, 1024], "sequence lengths are padded up to these, so the graph compiles once per bucket"
    )
    packed_buckets: list[int] | None = key(
        None,
        "the graph step's packed rows (a micro-batch end to end) are padded up to these, so it compiles once per "
        "bucket; finer buckets compute less padding and may compile more (null: micro_batch_size x each of "
        "length_buckets)",
    )
    collective_timeout_s: float = key(300.0, "a collective waiting longer than this fails the step (dead rank)")
    call_timeout_s: float = key(
        3600.0, "a training step, checkpoint save or export not finished within this stops the run as a lost worker"
    )

    def check(self) -> None:
        require(self.ranks >= 1, "learner.ranks: must be >= 1")
        require(self.collective_timeout_s > 0, "learner.collective_timeout_s: must be > 0")
        require(self.call_timeout_s > 0, "learner.call_timeout_s: must be > 0")
        packed = self.packed_buckets
        require(
            packed is None or (packed and all(b >= 1 for b in packed)),
            "learner.packed_buckets: buckets must be >= 1, or null",
        )
