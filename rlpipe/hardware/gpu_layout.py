"""Which GPUs the learner ranks and the rollout engines take from Ray: `placement.learner.gpus` and
`placement.rollout.gpus` (GPUs per actor; a fraction below 1 is a share of one GPU), or the default below.

The default, with `learner.device: cuda`: each engine of one GPU (rollout.tensor_parallel 1) shares a GPU with a
learner rank, half each, while there are no more engines than ranks; otherwise every engine takes
rollout.tensor_parallel GPUs of its own and every rank one. Without a cuda learner the engines take no GPU (vLLM for
CPU) unless placement.rollout.gpus gives them some.

A learner rank and an engine that share a GPU are placed in one bundle of the learner's placement group, which
reserves that whole GPU: Ray then shows both the same one device, and two ranks never land on one GPU (NCCL
refuses that). Engines with a share of a GPU and no learner beside them are packed by Ray, several to a GPU. An
engine's vLLM claims `rollout.gpu_memory_utilization` of what its share gives it (`engine_memory_fraction`).
Actors that take no GPU are shown none (CUDA_VISIBLE_DEVICES empty, actors/placement.py): Ray leaves that variable
unset at zero GPUs, and a process would otherwise see, and use, every GPU of its node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlpipe.config import Config

# What a learner rank and an engine each take of the GPU they share, by default.
DEFAULT_SHARE = 0.5


@dataclass(frozen=True)
class GpuLayout:
    """GPUs per learner rank and per engine, and whether each engine shares its GPU with a learner rank."""

    learner: float  # GPUs per learner rank; 0: the learner runs on no GPU
    rollout: float  # GPUs per engine; 0: vLLM for CPU
    colocated: bool  # engine i shares learner rank i's GPU (one bundle of the learner's placement group)
    ranks: int
    engines: int

    @property
    def gpus(self) -> float:
        """The GPUs the roles reserve: a whole GPU for each rank an engine shares, the rest as given."""
        if self.colocated:
            return float(self.ranks)
        return self.ranks * self.learner + self.engines * self.rollout

    @property
    def on_gpus(self) -> bool:
        return self.learner > 0 or self.rollout > 0

    def describe(self) -> str:
        if self.colocated:
            return (f"{self.ranks} GPU(s): {self.engines} engine(s) sharing a learner rank's GPU "
                    f"({self.learner:g} + {self.rollout:g})")
        roles = [f"{count} {name}(s) x {each:g}" for count, name, each in
                 ((self.ranks, "learner rank", self.learner), (self.engines, "engine", self.rollout)) if each]
        return f"{self.gpus:g} GPU(s): {', '.join(roles)}"


def gpu_layout(cfg: Config) -> GpuLayout:
    """The GPUs each learner rank and engine take, from placement.<role>.gpus or the default (module docstring)."""
    learner_set, rollout_set = cfg.placement.learner.gpus, cfg.placement.rollout.gpus
    ranks, engines, tp = cfg.learner.ranks, cfg.rollout.num_engines, cfg.rollout.tensor_parallel
    cuda = cfg.learner.device == "cuda"
    if rollout_set is not None:
        rollout = float(rollout_set)
    elif not cuda:
        rollout = 0.0
    elif tp == 1 and engines <= ranks and (learner_set is None or 0 < learner_set < 1):
        rollout = 1.0 - learner_set if learner_set else DEFAULT_SHARE
    else:
        rollout = float(tp)
    if learner_set is not None:
        learner = float(learner_set)
    elif cuda:
        learner = 1.0 - rollout if 0 < rollout < 1 and engines <= ranks else 1.0
    else:
        learner = 0.0
    colocated = 0 < learner < 1 and 0 < rollout < 1
    return GpuLayout(learner, rollout, colocated, ranks if cuda else 0, engines)


def gpu_problems(cfg: Config) -> list[str]:
    """What makes the roles' GPUs impossible, one line each naming the key to change."""
    layout = gpu_layout(cfg)
    learner, rollout, tp = layout.learner, layout.rollout, cfg.rollout.tensor_parallel
    problems = []
    if cfg.learner.device != "cuda" and cfg.placement.learner.gpus:
        problems.append(f"placement.learner.gpus: the learner takes GPUs with learner.device cuda, not "
                        f"{cfg.learner.device!r}; set it to null")
    if cfg.learner.device == "cuda" and not 0 < learner <= 1:
        problems.append(f"placement.learner.gpus: a cuda learner rank runs on one GPU or a share of one "
                        f"(0 < gpus <= 1), got {learner:g}")
    if rollout and cfg.placement.rollout.tpu is not None:
        problems.append("placement.rollout.gpus: the engines are on a TPU slice (placement.rollout.tpu); set it to 0")
    if rollout > 1 or (rollout == 1 and tp > 1):
        if rollout != tp:
            problems.append(f"placement.rollout.gpus: an engine of rollout.tensor_parallel {tp} takes {tp} whole GPUs "
                            f"(one per worker), got {rollout:g}")
    elif 0 < rollout < 1 and tp > 1:
        problems.append(f"placement.rollout.gpus: a share of one GPU ({rollout:g}) holds one worker; an engine of "
                        f"rollout.tensor_parallel {tp} takes {tp} whole GPUs")
    if 0 < learner < 1 and cfg.learner.device == "cuda":
        if not 0 < rollout < 1:
            problems.append(f"placement.learner.gpus: a share of a GPU ({learner:g}) is for sharing it with an engine, "
                            f"and the engines take {rollout:g} GPU(s) each; set it to 1, or placement.rollout.gpus "
                            f"below 1")
        elif layout.engines > layout.ranks:
            problems.append(f"placement.rollout.gpus: {layout.engines} engines cannot each share one of "
                            f"{layout.ranks} learner ranks' GPUs; set rollout.num_engines <= learner.ranks, or "
                            f"placement.rollout.gpus: {tp} (GPUs of their own)")
        elif learner + rollout > 1 + 1e-9:
            problems.append(f"placement.rollout.gpus: a learner rank's {learner:g} and an engine's {rollout:g} of one "
                            f"GPU add up to more than the GPU")
    for role in ("reward", "scorer"):
        if getattr(cfg.placement, role).gpus:
            problems.append(f"placement.{role}.gpus: the {role} role runs on CPUs; set it to null")
    return problems


def engine_memory_fraction(cfg: Config) -> float:
    """vLLM's gpu_memory_utilization for one engine: rollout.gpu_memory_utilization of the GPU memory its share
    gives it (the whole GPU's for an engine of whole GPUs, and on CPU and TPU)."""
    rollout = gpu_layout(cfg).rollout
    share = rollout if 0 < rollout < 1 else 1.0
    return cfg.rollout.gpu_memory_utilization * share


def gpus_of_cluster_needed(cfg: Config) -> int:
    """The whole GPUs the roles need at the least (fractions of one GPU packed together)."""
    return math.ceil(gpu_layout(cfg).gpus - 1e-9)
