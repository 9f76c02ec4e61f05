"""The `learner` section: the learner ranks, their device, precision, sharding and the compiled step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key


ALL_LINEAR = "all-linear"


def is_targeted(module_name: str, targets: list[str]) -> bool:
    """Whether learner.lora.target_modules names the Linear `module_name`, as PEFT matches `target_modules`:
    [all-linear] is every Linear but the output layer (`lm_head`); otherwise a name equal to a target or ending
    with `.<target>`."""
    if targets == [ALL_LINEAR]:
        return module_name != "lm_head"
    return any(module_name == target or module_name.endswith(f".{target}") for target in targets)


@dataclass
class LoraConfig:
    """`learner.lora`: low-rank adapters on the policy's linear layers (PEFT's LoraConfig: r, lora_alpha,
    lora_dropout, target_modules), the base weights frozen."""

    rank: int = key(8, "adapter rank r (PEFT's default 8; rank 1 suffices for RL when every linear layer has one)")
    alpha: float = key(8.0, "lora_alpha: the update is scaled by alpha / rank (PEFT's default 8)")
    dropout: float = key(0.0, "lora_dropout on the adapters' input in the training forward (PEFT's default 0)")
    target_modules: list[str] = key(
        [ALL_LINEAR],
        "the Linear layers that get adapters: [all-linear] (every attention and MLP projection, not the output "
        "layer), or names of modules as PEFT matches them (a module whose name is or ends with .<name>)",
    )

    def check(self) -> None:
        require(self.rank >= 1, "learner.lora.rank: must be >= 1")
        require(self.alpha > 0, "learner.lora.alpha: must be > 0")
        require(0 <= self.dropout < 1, "learner.lora.dropout: must be in [0, 1)")
        targets = self.target_modules
        require(
            bool(targets) and all(targets) and (ALL_LINEAR not in targets or targets == [ALL_LINEAR]),
            f"learner.lora.target_modules: [{ALL_LINEAR}] or a non-empty list of module names",
        )


@dataclass
class LearnerConfig:
    ranks: int = key(1, "learner processes (Ray actors) in one torch.distributed group; >1 shards SimpleFSDP-style")
    device: Literal["cpu", "cuda", "tpu", "xla"] = key("cpu", "learner device kind (see rlpipe/hardware/device.py)")
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
    lora: LoraConfig | None = key(
        None,
        "LoRA adapters {rank, alpha, dropout, target_modules} trained on a frozen base (null: every parameter "
        "trains); see docs/learner.md",
    )
    collective_timeout_s: float = key(300.0, "a collective waiting longer than this fails the step (dead rank)")
    call_timeout_s: float = key(
        3600.0, "a training step, checkpoint save or export not finished within this stops the run as a lost worker"
    )

    def check(self) -> None:
        require(self.ranks >= 1, "learner.ranks: must be >= 1")
        require(self.collective_timeout_s > 0, "learner.collective_timeout_s: must be > 0")
        require(self.call_timeout_s > 0, "learner.call_timeout_s: must be > 0")
        if self.lora is not None:
            self.lora.check()
        packed = self.packed_buckets
        require(
            packed is None or (packed and all(b >= 1 for b in packed)),
            "learner.packed_buckets: buckets must be >= 1, or null",
        )
