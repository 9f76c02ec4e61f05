"""The limits a TPU start meets outside the chips' HBM, and the plan's verdicts one line each.

/dev/shm, per host (`shm_peaks`): a pod's /dev/shm is the memory-backed emptyDir the KubeRay manifests mount there
(rlpipe/pod_limits.py reads its sizeLimit). It holds:
- on an engine host, per engine whose workers read a host copy (tensor-parallel workers, or an engine out of
  process): the staged version, which staging assembles in the engine's shared memory, and, with
  sync.keep_previous, the version before it, kept there for a rollback (rlpipe/weightsync/hostcopy.py, receiver.py).
  An in-process one-chip engine, and one taking adapters alone, stage in the engine's own memory instead;
- on a host both roles share, with the `auto` or `shm` transport, the learner's bucket segments: both version
  parities of every bucket, whole (rlpipe/weightsync/transport.py);
- Ray's object store, at its capacity (it keeps what it has touched): the manifest's `object-store-memory`, else
  Ray's default for the pod (`ray_default_object_store`). Where that does not fit Ray puts it in /tmp, or, above
  10 GB, refuses to start, which the plan shows as a /dev/shm that does not fit.
The manifests' group with the least room for rlpipe's segments is the one compared against.

`limit_checks` turns a memory plan into (check, passed, reason) lines: what `rlpipe rehearse` prints for the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from rlpipe.pod_limits import RAY_REQUIRE_SHM_BYTES, HostLimits, host_limits
from rlpipe.tpu_layout import SliceShare

GIB = 2**30


def _keyed(items, key: str):
    """The item of `items` (parts, peaks) whose `key` is `key`."""
    for item in items:
        if item.key == key:
            return item
    raise KeyError(key)


@dataclass(frozen=True)
class Part:
    key: str  # stable name for tests: "parameters", "kv_cache", ...
    label: str  # what the table prints
    bytes: float

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class Peak:
    """A moment's memory, outside the steady step, against what it must fit in: the learner's load per chip
    (`learner_load`), a learner host's RAM (`learner_host`, the largest of its phases), an engine host's RAM at a
    sync (`rollout_host`), and each host's /dev/shm (`learner_shm`, `rollout_shm`)."""

    key: str
    name: str  # what the NOT OK line and the notes call it
    title: str  # what the table prints above the parts
    parts: tuple[Part, ...]
    limit_bytes: float | None  # what it must fit in; None: nothing to compare against (`missing` says why)
    limit_label: str = ""
    missing: str = ""
    largest_part: bool = False  # the parts are phases that do not overlap: the peak is the largest, not the sum

    @property
    def total_bytes(self) -> float:
        sizes = [part.bytes for part in self.parts]
        return max(sizes, default=0) if self.largest_part else sum(sizes)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def fits(self) -> bool | None:
        return None if self.limit_bytes is None else self.total_bytes <= self.limit_bytes

    @property
    def over_gib(self) -> float:
        return (self.total_bytes - (self.limit_bytes or 0)) / GIB

    def part(self, key: str) -> Part:
        return _keyed(self.parts, key)


# ------------------------------------------------------------------ /dev/shm


def _counted_store(limits: HostLimits) -> bool:
    """Whether Ray's object store takes room in /dev/shm (or stops Ray for want of it): not where Ray puts a small
    one that does not fit in /tmp."""
    return limits.object_store_in_shm or limits.object_store > RAY_REQUIRE_SHM_BYTES


def _shm_peak(
    key: str, name: str, title: str, own: list[Part], share: SliceShare, role: str, manifests: Path | None
) -> Peak:
    found = host_limits(share, manifests, role)
    if isinstance(found, str):
        return Peak(key, name, title, tuple(own), None, missing=found)
    # The group with the least room left for rlpipe's own segments.
    limits = min(found, key=lambda h: (h.shm - (h.object_store if _counted_store(h) else 0), h.manifest))
    parts = list(own)
    if _counted_store(limits):
        parts.append(Part("object_store", f"Ray's object store ({limits.object_store_source})", limits.object_store))
    label = f"{limits.shm / GIB:.0f} GiB /dev/shm ({limits.shm_source}, {limits.manifest}, group {limits.group})"
    return Peak(key, name, title, tuple(parts), limits.shm, label)


def shm_peaks(
    cfg, version_bytes: float, adapters_only: bool, shares: dict[str, SliceShare], manifests: Path | None
) -> tuple[Peak, ...]:
    """/dev/shm of a learner host and of an engine host (one peak for a host both roles share). `version_bytes`: a
    synced version in the rollout dtype; `adapters_only`: syncs send the LoRA adapters alone."""
    learner, rollout = shares.get("learner"), shares.get("rollout")
    peaks = []
    if learner is not None and not learner.shared:
        title = "learner host /dev/shm, per host"
        peaks.append(_shm_peak("learner_shm", "learner host /dev/shm", title, [], learner, "learner", manifests))
    if rollout is not None:
        T = cfg.rollout.tensor_parallel
        engines = max(1, rollout.chips_per_host // T)
        each = f" x {engines} engine{'s' if engines > 1 else ''}"
        own = []
        if not (cfg.rollout.in_process and T == 1) and not adapters_only:
            staged = engines * version_bytes
            own.append(Part("shm_staging", f"staged version, the host copy its workers read{each}", staged))
            if cfg.sync.keep_previous:
                own.append(Part("shm_rollback", f"rollback copy (sync.keep_previous){each}", staged))
        if rollout.shared and cfg.sync.transport in ("auto", "shm"):
            own.append(Part("shm_transport", "the learner's shm buckets: two versions' parities", 2 * version_bytes))
        title = f"{'host' if rollout.shared else 'engine host'} /dev/shm at a sync, per host"
        name = "host /dev/shm" if rollout.shared else "engine host /dev/shm"
        peaks.append(_shm_peak("rollout_shm", name, title, own, rollout, "rollout", manifests))
    return tuple(peaks)


# ------------------------------------------------------------------ one line per limit


class LimitCheck(NamedTuple):
    """One limit of the plan: `passed` None where there is nothing here to check it against (`reason` says why)."""

    name: str
    passed: bool | None
    reason: str


def limit_checks(result) -> list[LimitCheck]:
    """Every limit a memory plan (`rlpipe.memory_plan.MemoryPlan`) checks, in the order a start meets them: the
    slices' chip counts and layout, the chips' HBM, the learner's load, each host's pod memory and /dev/shm."""
    checks = [LimitCheck("slices and chip counts", False, problem) for problem in result.problems]
    if not result.problems:
        checks.append(LimitCheck("slices and chip counts", True, "every role fills its chips in blocks TPUs start"))
    for side in (result.learner, result.rollout):
        name = f"{side.role} HBM per chip"
        if side.fits is None:
            checks.append(LimitCheck(name, None, f"no placement.{side.role}.tpu"))
        else:
            usable = side.usable_bytes / GIB
            verdict = "fits" if side.fits else f"over by {side.total_gib - usable:.2f} GiB"
            checks.append(LimitCheck(name, side.fits, f"{side.total_gib:.2f} of {usable:.2f} GiB usable: {verdict}"))
    for peak in result.peaks:
        if peak.fits is None:
            checks.append(LimitCheck(peak.name, None, peak.missing or "nothing to compare against"))
        else:
            verdict = "fits" if peak.fits else f"over by {peak.over_gib:.2f} GiB"
            checks.append(LimitCheck(peak.name, peak.fits, f"{peak.total_gib:.2f} of {peak.limit_label}: {verdict}"))
    return checks
