"""What a host of a TPU slice gets, read from the KubeRay manifests under deploy/kuberay: the worker group that runs
that slice gives its pod memory limit, its /dev/shm (the memory-backed emptyDir mounted there) and the size of
Ray's object store, which lives in that same /dev/shm (`rlpipe plan` compares a host's peaks with them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlpipe.config import recipes_dir
from rlpipe.plan.parts import GIB
from rlpipe.hardware.tpu_layout import SliceShare

# The KubeRay manifests whose TPU worker groups give each host's pod memory limit (a checkout's deploy/kuberay).
MANIFESTS_DIR = recipes_dir().parent / "deploy" / "kuberay"
# GKE's node label for each TPU generation (cloud.google.com/gke-tpu-accelerator).
GKE_ACCELERATORS = {
    "v4": "tpu-v4-podslice",
    "v5litepod": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
}


# Ray 2.60's object store when `ray start` is given no --object-store-memory (ray/_private/utils.py
# resolve_object_store_memory, ray/_private/ray_constants.py): 30% of the memory available at start, at most 200 GB
# and at most 95% of /dev/shm -- but that cap never below 10 GB.
RAY_OBJECT_STORE_FRACTION = 0.3
RAY_OBJECT_STORE_MAX = 200 * 10**9
RAY_SHM_CAP_FRACTION = 0.95
# Above this an object store that does not fit in /dev/shm stops `ray start` (ray/_private/services.py); at or below
# it Ray puts the store in /tmp instead (REQUIRE_SHM_SIZE_THRESHOLD).
RAY_REQUIRE_SHM_BYTES = 10**10
# /dev/shm of a container that mounts nothing there: containerd's and Docker's default.
CONTAINER_SHM_BYTES = 64 * 2**20


_QUANTITY_SUFFIXES = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}


def memory_quantity(text) -> float:
    """Bytes in a Kubernetes memory quantity ("360Gi", "300G", "1e9", 2048)."""
    value = str(text).strip()
    for suffix in sorted(_QUANTITY_SUFFIXES, key=len, reverse=True):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * _QUANTITY_SUFFIXES[suffix]
    return float(value)


@dataclass(frozen=True)
class PodLimit:
    bytes: float
    manifest: str  # file name under deploy/kuberay
    group: str  # the worker group's groupName


@dataclass(frozen=True)
class HostLimits:
    """One TPU worker group's host: its pod memory limit, its /dev/shm and Ray's object store there."""

    memory: float  # resources.limits.memory of the TPU container
    manifest: str  # file name under deploy/kuberay
    group: str  # the worker group's groupName
    shm: float  # bytes /dev/shm holds
    shm_source: str  # what sets it: the volume's sizeLimit, ...
    object_store: float  # bytes of Ray's object store on each host
    object_store_source: str  # object-store-memory, or Ray's default

    @property
    def object_store_in_shm(self) -> bool:
        """Whether Ray puts its object store in /dev/shm: where it fits (ray/_private/services.py). Else it goes to
        /tmp, or, above RAY_REQUIRE_SHM_BYTES, Ray does not start (`ray_refusal`)."""
        return self.object_store <= self.shm

    @property
    def ray_refusal(self) -> str | None:
        """Why `ray start` refuses this group's hosts, or None."""
        if self.object_store_in_shm or self.object_store <= RAY_REQUIRE_SHM_BYTES:
            return None
        return (
            f"Ray does not start on group {self.group} ({self.manifest}): its object store "
            f"({self.object_store / 2**30:.1f} GiB, {self.object_store_source}) is larger than /dev/shm "
            f"({self.shm / 2**30:.1f} GiB, {self.shm_source})"
        )


def ray_default_object_store(memory: float, shm: float) -> float:
    """The object store Ray 2.60 gives a host whose pod may use `memory` bytes (Ray reads the cgroup's limit) and
    whose /dev/shm holds `shm` bytes, when `ray start` is given no --object-store-memory."""
    cap = min(RAY_OBJECT_STORE_MAX, max(RAY_REQUIRE_SHM_BYTES, int(shm * RAY_SHM_CAP_FRACTION)))
    return float(min(int(memory * RAY_OBJECT_STORE_FRACTION), cap))


def _group_host(group: dict, manifest: str) -> tuple[tuple, HostLimits | None]:
    """((accelerator, topology, hosts, chips per host), its hosts' limits: None without a memory limit) of a KubeRay
    worker group."""
    spec = group.get("template", {}).get("spec", {}) or {}
    selector = spec.get("nodeSelector") or {}
    chips, memory, mounts = 0, None, []
    for container in spec.get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        if "google.com/tpu" in limits:
            chips = int(str(limits["google.com/tpu"]))
            memory = memory_quantity(limits["memory"]) if "memory" in limits else None
            mounts = [m.get("name") for m in container.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"]
    shape = (
        selector.get("cloud.google.com/gke-tpu-accelerator"),
        selector.get("cloud.google.com/gke-tpu-topology"),
        int(group.get("numOfHosts", 1)),
        chips,
    )
    if memory is None:
        return shape, None
    shm, shm_source = float(CONTAINER_SHM_BYTES), "no volume at /dev/shm: the container's 64 MiB"
    for volume in spec.get("volumes") or []:
        empty = volume.get("emptyDir")
        if volume.get("name") in mounts and isinstance(empty, dict) and empty.get("medium") == "Memory":
            # A memory-backed emptyDir holds at most its sizeLimit and at most the pod's memory, which it counts in.
            limit = empty.get("sizeLimit")
            shm = min(memory_quantity(limit), memory) if limit is not None else memory
            shm_source = f"sizeLimit {limit}" if limit is not None else "no sizeLimit: the pod's memory"
    given = (group.get("rayStartParams") or {}).get("object-store-memory")
    if given is not None:
        store, store_source = float(str(given)), "rayStartParams object-store-memory"
    else:
        store = ray_default_object_store(memory, shm)
        store_source = "Ray's default: 30% of the pod's memory, at most 95% of /dev/shm"
    return shape, HostLimits(memory, manifest, str(group.get("groupName")), shm, shm_source, store, store_source)


def host_limits(share: SliceShare, manifests: Path | None = None, role: str = "") -> list[HostLimits] | str:
    """The hosts of every TPU worker group, in the KubeRay manifests under `manifests`, that runs this role's slice
    (same accelerator, topology, hosts and chips per host); of the groups named after `role` when some are. A
    string says why there is none: no manifests here, a slice shared with the other role (every manifest gives
    each role hosts of its own), or no group for that slice."""
    import yaml

    folder = MANIFESTS_DIR if manifests is None else manifests
    tslice = share.tslice
    if share.shared:
        return (
            f"the learner and the engines share each {tslice.pod_type} host; no manifest in deploy/kuberay runs both "
            "roles on one host"
        )
    files = sorted(folder.glob("*.yaml")) if folder.is_dir() else []
    if not files:
        return f"no deploy manifests in {folder} to read a pod memory limit from"
    found: list[HostLimits] = []
    wanted = (GKE_ACCELERATORS.get(tslice.generation), tslice.topology, tslice.hosts, tslice.chips_per_host)
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") not in ("RayCluster", "RayJob"):
                continue
            spec = doc.get("spec") or {}
            cluster = spec if doc["kind"] == "RayCluster" else spec.get("rayClusterSpec") or {}
            for group in cluster.get("workerGroupSpecs") or []:
                shape, limits = _group_host(group, path.name)
                if shape == wanted and limits is not None:
                    found.append(limits)
    if not found:
        return f"no TPU worker group in deploy/kuberay runs a {tslice.pod_type} ({tslice.topology}) slice"
    named = [limits for limits in found if limits.group == role]
    return named or found


def pod_memory_limit(share: SliceShare, manifests: Path | None = None, role: str = "") -> PodLimit | str:
    """The pod memory limit of the TPU worker groups that run this role's slice (`host_limits`), the smallest when
    several do; a string says why there is none."""
    found = host_limits(share, manifests, role)
    if isinstance(found, str):
        return found
    smallest = min(found, key=lambda limits: (limits.memory, limits.manifest))
    return PodLimit(smallest.memory, smallest.manifest, smallest.group)


def host_memory_limit(share: SliceShare | None, role: str, manifests: Path | None) -> tuple[float | None, str, str]:
    """(limit bytes, what it is, why there is none) for one host of `role`."""
    if share is None:
        return None, "", f"no placement.{role}.tpu, so no deploy manifest to compare against"
    limit = pod_memory_limit(share, manifests, role)
    if isinstance(limit, str):
        return None, "", limit
    return limit.bytes, f"{limit.bytes / GIB:.0f} GiB pod limit ({limit.manifest}, group {limit.group})", ""
