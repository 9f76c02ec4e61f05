"""`rlpipe plan`: per-chip memory of the learner and the rollout engines against the TPU slices' HBM, and the
peaks outside the steady step (the learner's load per chip, a learner host's RAM, an engine host's RAM at a sync)
against the chip's HBM and the pod memory limits of the deploy manifests; on GPUs, what one GPU holds (gpu.py) against
placement.gpu_memory_gib.

Pure arithmetic on the config and the model's Hugging Face `config.json` (from `model.path` when that folder
exists here, or a Hub id's snapshot in the Hugging Face cache, else `configs/models/<basename of model.path>.json`);
no model is built and nothing is allocated.
Figures are bytes per chip, or per host for host RAM; the printed table shows GiB (2**30 bytes).
The formulas are with the figures they give: the learner's (rlpipe/plan/learner.py), the engines' (engine.py), each
host's /dev/shm (shm.py); the deploy manifests' limits are read by pods.py.

Fit: a side fits when its total <= a usable share of the chip's HBM: USABLE_FRACTION (90%) for the learner (the
rest for the compiler's temporaries, collectives' buffers and the runtime), rollout.gpu_memory_utilization for the
rollout (the share vLLM claims for weights plus KV cache); a peak when it is <= what it is compared with. The
plan is OK (exit 0) when both sides and every peak fit and no problem was found (slice sizes against learner.ranks
and num_engines x tensor_parallel, chip counts TPUs start on, topology, kv-head split, context length); a side
without a TPU slice (placement.<role>.tpu null) is shown without a verdict. A peak that does not fit is named, with by how much, on
the last line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlpipe.config import Config
from rlpipe.hardware.gpu_layout import gpu_layout, gpu_problems
from rlpipe.plan.engine import rollout_peak, rollout_side
from rlpipe.plan.gpu import gpu_peak, gpu_problems_of_plan
from rlpipe.plan.learner import learner_peaks, learner_side
from rlpipe.plan.model_size import ModelSize, load_architecture
from rlpipe.plan.parts import DTYPE_BYTES, GIB, Peak, SidePlan, _keyed
from rlpipe.plan.report import LimitCheck, limit_checks
from rlpipe.plan.scorer import scorer_peak
from rlpipe.plan.shm import shm_peaks
from rlpipe.plan.synced import synced_params
from rlpipe.hardware.tpu_layout import slice_problems, slice_shares


@dataclass(frozen=True)
class MemoryPlan:
    model: ModelSize
    source: Path
    learner: SidePlan
    rollout: SidePlan
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    peaks: tuple[Peak, ...] = ()

    @property
    def ok(self) -> bool:
        return (
            self.learner.fits is not False
            and self.rollout.fits is not False
            and all(peak.fits is not False for peak in self.peaks)
            and not self.problems
        )

    def peak(self, key: str) -> Peak:
        return _keyed(self.peaks, key)

    def checks(self) -> list[LimitCheck]:
        """Every limit, one (name, passed, reason) each (rlpipe/plan/report.py)."""
        return limit_checks(self)


def plan_checks(cfg: Config, manifests: Path | None = None) -> list[LimitCheck]:
    """The plan's limits for a resolved config, one `LimitCheck(name, passed, reason)` each: chip counts and slice
    layout, HBM per chip, the learner's load, each host's pod memory and /dev/shm against deploy/kuberay (or
    `manifests`). `passed` is None where nothing here says the limit (no slice, no manifest)."""
    return plan(cfg, manifests=manifests).checks()


def plan(cfg: Config, arch: ModelSize | None = None, manifests: Path | None = None) -> MemoryPlan:
    """The memory plan of a resolved config (its model read by `load_architecture` unless given; pod memory
    limits read from the KubeRay manifests in `manifests`, deploy/kuberay unless given)."""
    source = Path("<given>")
    if arch is None:
        arch, source = load_architecture(cfg.model.path)
    problems: list[str] = []
    notes: list[str] = []
    P = arch.params
    shares = slice_shares(cfg.placement)
    learner_share, rollout_share = shares.get("learner"), shares.get("rollout")

    learner = learner_side(cfg, arch, learner_share)
    rollout, rollout_problems = rollout_side(cfg, arch, rollout_share)
    problems.extend(rollout_problems)
    rb = DTYPE_BYTES[cfg.rollout.dtype]
    context = cfg.rollout.max_model_len

    # --- consistency
    gpus = gpu_layout(cfg)
    for role, share in (("learner", learner_share), ("rollout", rollout_share)):
        if share is None and not getattr(gpus, role):
            notes.append(f"{role}: no placement.{role}.tpu, so no HBM to compare against")
    problems.extend(slice_problems(cfg))
    problems.extend(gpu_problems(cfg))
    problems.extend(gpu_problems_of_plan(cfg, rollout))
    limit = arch.max_position_embeddings
    if limit and context > limit:
        problems.append(f"rollout.max_model_len {context} exceeds the model's max_position_embeddings {limit}")

    # --- peaks outside the steady step
    usable = learner.usable_bytes
    usable_label = ""
    if usable is not None:
        usable_label = f"{usable / GIB:.2f} usable ({learner.usable_fraction:.0%} of {learner.slice.hbm_gib})"
    load_peak, host_peak = learner_peaks(cfg, arch, learner_share, usable, usable_label, manifests)
    adapters_only = synced_params(cfg, arch) != P
    shm = shm_peaks(cfg, synced_params(cfg, arch) * rb, adapters_only, shares, manifests)
    scorer = scorer_peak(cfg)
    peaks = (load_peak, host_peak, rollout_peak(cfg, arch, rollout_share, manifests), *shm)
    peaks += (scorer,) if scorer else ()
    gpu = gpu_peak(cfg, learner, rollout)
    peaks += (gpu,) if gpu else ()
    for peak in peaks:
        if peak.fits is None and peak.missing and peak.key != "learner_load":
            notes.append(f"{peak.name}: {peak.missing}")
    return MemoryPlan(arch, source, learner, rollout, tuple(problems), tuple(notes), peaks)
