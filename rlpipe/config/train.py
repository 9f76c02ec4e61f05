"""The `train` section: steps, batch sizes, the optimizer and its schedule, checkpoints, asynchronous mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key


@dataclass
class TrainConfig:
    steps: int = key(12, "GRPO steps")
    prompts_per_step: int = key(8, "prompts drawn per step (each yields group_size samples)")
    mini_batch_size: int | None = key(None, "samples per optimizer step (null: the whole step's samples)")
    micro_batch_size: int = key(8, "samples per forward/backward (gradient accumulation)")
    lr: float = key(1e-6, "peak learning rate")
    lr_schedule: Literal["constant", "linear", "cosine"] = key(
        "constant", "after warm-up: constant, linear decay to 0 (TRL's default), or cosine to min_lr_ratio of lr"
    )
    warmup_steps: int = key(0, "optimizer steps of linear warm-up")
    min_lr_ratio: float = key(0.1, "cosine floor as a fraction of lr")
    num_iterations: int = key(
        1, "passes over a step's samples, each taking every mini-batch's optimizer step (TRL's num_iterations, "
        "PPO's epochs); the ratio is taken against the policy that generated them"
    )
    weight_decay: float = key(0.0, "AdamW weight decay")
    betas: list[float] = key([0.9, 0.999], "AdamW betas")
    adam_eps: float = key(1e-8, "AdamW epsilon")
    grad_clip: float = key(1.0, "max gradient norm (0: off)")
    checkpoint_every: int = key(
        5, "save a training-state checkpoint every this many steps, and at the end (0: only at the end)"
    )
    keep_checkpoints: int = key(2, "checkpoints kept in <run_dir>/checkpoints (older ones are deleted)")
    max_auto_resumes: int = key(
        3, "with `rlpipe train --auto-resume`: restarts from the latest checkpoint after a worker dies, at most"
    )
    max_staleness: int = key(
        0, "asynchronous mode: the engines generate up to this many steps ahead, with a policy up to this many "
        "versions older than the learner's (0: synchronous; 1: the next step generates while this one trains)"
    )

    def check(self) -> None:
        require(self.prompts_per_step >= 1, "train.prompts_per_step: must be >= 1")
        require(self.checkpoint_every >= 0, "train.checkpoint_every: must be >= 0")
        require(self.keep_checkpoints >= 1, "train.keep_checkpoints: must be >= 1")
        require(self.max_auto_resumes >= 0, "train.max_auto_resumes: must be >= 0")
        require(self.max_staleness >= 0, "train.max_staleness: must be >= 0")
        require(self.steps >= 0, "train.steps: must be >= 0")
        require(self.num_iterations >= 1, "train.num_iterations: must be >= 1")
        require(self.micro_batch_size >= 1, "train.micro_batch_size: must be >= 1")
        require(self.lr > 0, "train.lr: must be > 0")
        require(len(self.betas) == 2, "train.betas: needs two values")
        require(self.adam_eps > 0, "train.adam_eps: must be > 0")
        require(
            self.mini_batch_size is None or self.mini_batch_size >= 1, "train.mini_batch_size: must be >= 1 or null"
        )
