"""The `placement` section: where each role's actors run (resources, strategy, TPU slice, Python environment)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key


@dataclass
class RolePlacement:
    resources: dict = key({}, "Ray resources each actor of this role needs besides its CPU, e.g. {learner_host: 1}")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = key(
        "PACK", "placement-group strategy for this role's actors"
    )
    tpu: str | None = key(None, "TPU slice this role runs on, as its pod type (e.g. v6e-8); null: no TPU")
    topology: str | None = key(None, "topology of that slice (e.g. 2x4); null: the pod type's usual topology")
    chips: int | None = key(
        None,
        "on one TPU VM: the chips of the slice this role takes, learner and rollout naming the same one-host slice "
        "(the learner the first chips, the engines the next); null: the role has the slice to itself",
    )
    gpus: float | None = key(
        None,
        "GPUs each actor of this role takes from Ray (learner ranks, rollout engines): a number below 1 is a share of "
        "one GPU; null: with learner.device cuda an engine and a learner rank share a GPU, half each (while "
        "rollout.num_engines <= learner.ranks and tensor_parallel is 1), else GPUs of their own; 0 without one",
    )
    python: str | None = key(
        None,
        "Python interpreter, or virtual environment folder, this role's actors run under (Ray's runtime_env "
        "py_executable; same Python minor and Ray versions as the driver); null: the driver's",
    )

    def check(self, where: str) -> None:
        """`where`: this role's section, e.g. placement.learner."""
        require(
            all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in self.resources.values()),
            f"{where}.resources: every amount must be a number >= 0, got {self.resources}",
        )
        require(
            self.gpus is None or (isinstance(self.gpus, (int, float)) and not isinstance(self.gpus, bool)
                                  and self.gpus >= 0),
            f"{where}.gpus: a number of GPUs >= 0 (a fraction shares one GPU), got {self.gpus!r}",
        )
        require(
            self.topology is None or self.tpu is not None, f"{where}.topology: set {where}.tpu (the pod type) as well"
        )
        require(
            self.chips is None or (self.tpu is not None and self.chips >= 1),
            f"{where}.chips: a number of chips >= 1 of the slice {where}.tpu names",
        )


@dataclass
class PlacementConfig:
    """Where each role's actors run: one placement group per role, one bundle per actor (per TPU host on a slice)."""

    learner: RolePlacement = field(default_factory=RolePlacement)
    rollout: RolePlacement = field(default_factory=RolePlacement)
    reward: RolePlacement = field(default_factory=lambda: RolePlacement(strategy="SPREAD"))
    scorer: RolePlacement = field(default_factory=RolePlacement)
    gpu_memory_gib: float | None = key(
        None,
        "memory of each of the cluster's GPUs in GiB, what `rlpipe plan` compares a GPU's learner rank and engine "
        "with (e.g. 141 for an H200); null: the plan counts them without a verdict",
    )

    def check(self) -> None:
        require(self.reward.tpu is None, "placement.reward.tpu: reward workers run on CPUs; set it to null")
        require(self.scorer.tpu is None, "placement.scorer.tpu: the scorer's reward models run on CPUs; set it to null")
        for role in ("learner", "rollout", "reward", "scorer"):
            getattr(self, role).check(f"placement.{role}")
        require(self.gpu_memory_gib is None or self.gpu_memory_gib > 0,
                f"placement.gpu_memory_gib: a size in GiB > 0, got {self.gpu_memory_gib}")
