"""Which chips of which TPU slice each role runs on: a slice of its own (`placement.<role>.tpu`), or, on one TPU VM,
a block of the same host's chips (`placement.<role>.chips`: the learner takes the first chips, the engines the
rest). `slice_problems` is what `rlpipe plan` reports and what `rlpipe train` refuses before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from rlpipe.config import Config, ConfigError, PlacementConfig
from rlpipe.hardware.device import TpuSlice, tpu_slice
from rlpipe.hardware.tpu_env import CHIP_BLOCK_BOUNDS

# The chip counts of one host torch_tpu's PCI scan knows a topology for (its hardware maps), by generation: what vLLM
# on TorchTPU starts an engine on, since the engine takes its topology from there, and what a TorchTPU learner can
# take of a host it shares with the engines (its topology is that block's). No 2-chip block of a v5e or v6e host.
ENGINE_CHIP_COUNTS = {"v4": (1, 2, 4), "v5p": (1, 2, 4), "v5litepod": (1, 4, 8), "v6e": (1, 4, 8)}


@dataclass(frozen=True)
class SliceShare:
    """The chips a role takes on every host of `tslice`: `chips_per_host` chips from `first_chip` on."""

    tslice: TpuSlice
    first_chip: int
    chips_per_host: int

    @property
    def chips(self) -> int:
        return self.tslice.hosts * self.chips_per_host

    @property
    def shared(self) -> bool:
        return self.chips_per_host < self.tslice.chips_per_host

    def describe(self) -> str:
        if self.shared:
            last = self.first_chip + self.chips_per_host - 1
            return f"chips {self.first_chip}-{last} of {self.tslice.pod_type} ({self.tslice.topology})"
        return f"{self.tslice.pod_type} ({self.tslice.topology})"


def slice_shares(placement: PlacementConfig) -> dict[str, SliceShare]:
    """Each TPU role's share ("learner", "rollout"), for the roles with `placement.<role>.tpu`."""
    slices = {}
    for role in ("learner", "rollout"):
        spec = getattr(placement, role)
        if spec.tpu is not None:
            try:
                slices[role] = tpu_slice(spec.tpu, spec.topology)
            except ValueError as err:
                raise ConfigError(f"placement.{role}.tpu: {err}") from None
    learner, rollout = placement.learner, placement.rollout
    if learner.chips is None and rollout.chips is None:
        return {role: SliceShare(tslice, 0, tslice.chips_per_host) for role, tslice in slices.items()}
    if len(slices) < 2 or learner.chips is None or rollout.chips is None:
        raise ConfigError(
            "placement.learner.chips and placement.rollout.chips: set both, with placement.<role>.tpu naming the "
            "same one-host slice, to share its chips between the learner and the engines; null for a slice each"
        )
    if slices["learner"] != slices["rollout"]:
        raise ConfigError(
            f"placement.rollout.tpu: roles sharing a slice's chips name the same slice; the learner's is "
            f"{slices['learner'].pod_type} ({slices['learner'].topology}), the rollout's "
            f"{slices['rollout'].pod_type} ({slices['rollout'].topology})"
        )
    tslice = slices["learner"]
    if tslice.hosts != 1:
        raise ConfigError(
            f"placement.learner.chips: only a one-host slice is shared between roles; {tslice.pod_type} has "
            f"{tslice.hosts} hosts (give each role a slice of its own)"
        )
    if learner.chips + rollout.chips > tslice.chips:
        raise ConfigError(
            f"placement.rollout.chips: the learner's {learner.chips} and the rollout's {rollout.chips} chips are "
            f"more than the {tslice.chips} of {tslice.pod_type}"
        )
    return {
        "learner": SliceShare(tslice, 0, learner.chips),
        "rollout": SliceShare(tslice, learner.chips, rollout.chips),
    }


def _share_counts(device: str, generation: str) -> tuple[int, ...]:
    """The chips a learner can take of a host it shares: TorchTPU's topology blocks, or libtpu's process bounds
    (rlpipe/hardware/tpu_env.py) for an xla learner."""
    return ENGINE_CHIP_COUNTS[generation] if device == "tpu" else tuple(sorted(CHIP_BLOCK_BOUNDS))


def slice_problems(cfg: Config) -> list[str]:
    """What cannot run on the configured slices, one line each: actors that do not fill their role's chips,
    engines across hosts or misaligned, a learner device that does not run on a TPU, a learner's share of a host's
    chips that its TPU runtime has no topology for."""
    shares = slice_shares(cfg.placement)
    problems = []
    learner, rollout = shares.get("learner"), shares.get("rollout")
    if learner is not None:
        device = cfg.learner.device
        if device not in ("tpu", "xla"):
            problems.append(f"learner.device is {device!r} but placement.learner.tpu is {learner.tslice.pod_type}")
        elif cfg.learner.ranks != learner.chips:
            problems.append(
                f"learner.ranks = {cfg.learner.ranks} but placement.learner takes {learner.chips} chips of "
                f"{learner.describe()} (one rank per chip)"
            )
        elif learner.shared and learner.chips not in _share_counts(device, learner.tslice.generation):
            *most, last = _share_counts(device, learner.tslice.generation)
            counts = f"{', '.join(str(count) for count in most)} or {last}"
            whose = "torch_tpu knows a topology for" if device == "tpu" else "libtpu takes as one process's bounds"
            problems.append(
                f"placement.learner.chips: a {device} learner starts on {counts} chips of a "
                f"{learner.tslice.generation} host (the blocks {whose}), not {learner.chips}"
            )
        elif device == "xla" and learner.tslice.hosts > 1:
            problems.append(
                f"learner.device: an xla learner is one process driving its chips as an SPMD mesh, which "
                f"{learner.tslice.pod_type}'s {learner.tslice.hosts} hosts cannot share; use a one-host slice or tpu"
            )
    if rollout is not None:
        tp, engines = cfg.rollout.tensor_parallel, cfg.rollout.num_engines
        if engines * tp != rollout.chips:
            problems.append(
                f"rollout.num_engines x rollout.tensor_parallel = {engines * tp} but placement.rollout takes "
                f"{rollout.chips} chips of {rollout.describe()} (one engine per tensor_parallel chips)"
            )
        elif tp not in ENGINE_CHIP_COUNTS[rollout.tslice.generation]:
            counts = ", ".join(str(count) for count in ENGINE_CHIP_COUNTS[rollout.tslice.generation])
            problems.append(
                f"rollout.tensor_parallel: vLLM on TorchTPU starts an engine on {counts} chips of a "
                f"{rollout.tslice.generation} host (the blocks torch_tpu knows a topology for), not {tp}"
            )
        elif rollout.chips_per_host % tp or rollout.first_chip % tp:
            problems.append(
                f"rollout.tensor_parallel: {tp} chips per engine must tile the rollout's {rollout.chips_per_host} "
                f"chips of each {rollout.tslice.pod_type} host from chip {rollout.first_chip} (engines do not span "
                "hosts)"
            )
    return problems
