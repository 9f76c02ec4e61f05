"""/dev/shm, per host (`shm_peaks`): a pod's /dev/shm is the memory-backed emptyDir the KubeRay manifests mount there
(rlpipe/plan/pods.py reads its sizeLimit). It holds:
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
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.plan.parts import GIB, MemoryItem, Peak
from rlpipe.plan.pods import RAY_REQUIRE_SHM_BYTES, HostLimits, host_limits
from rlpipe.hardware.tpu_layout import SliceShare


def _counted_store(limits: HostLimits) -> bool:
    """Whether Ray's object store takes room in /dev/shm (or stops Ray for want of it): not where Ray puts a small
    one that does not fit in /tmp."""
    return limits.object_store_in_shm or limits.object_store > RAY_REQUIRE_SHM_BYTES


def _shm_peak(
    key: str, name: str, title: str, own: list[MemoryItem], share: SliceShare, role: str, manifests: Path | None
) -> Peak:
    found = host_limits(share, manifests, role)
    if isinstance(found, str):
        return Peak(key, name, title, tuple(own), None, missing=found)
    # The group with the least room left for rlpipe's own segments.
    limits = min(found, key=lambda h: (h.shm - (h.object_store if _counted_store(h) else 0), h.manifest))
    parts = list(own)
    if _counted_store(limits):
        parts.append(MemoryItem("object_store", f"Ray's object store ({limits.object_store_source})", limits.object_store))
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
            own.append(MemoryItem("shm_staging", f"staged version, the host copy its workers read{each}", staged))
            if cfg.sync.keep_previous:
                own.append(MemoryItem("shm_rollback", f"rollback copy (sync.keep_previous){each}", staged))
        if rollout.shared and cfg.sync.transport in ("auto", "shm"):
            own.append(MemoryItem("shm_transport", "the learner's shm buckets: two versions' parities", 2 * version_bytes))
        title = f"{'host' if rollout.shared else 'engine host'} /dev/shm at a sync, per host"
        name = "host /dev/shm" if rollout.shared else "engine host /dev/shm"
        peaks.append(_shm_peak("rollout_shm", name, title, own, rollout, "rollout", manifests))
    return tuple(peaks)
