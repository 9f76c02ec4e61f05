"""The pod memory a host of a TPU slice gets, read from the KubeRay manifests under deploy/kuberay: the limit of the
worker group that runs that slice (`rlpipe plan` compares a host's peaks with it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlpipe.config import recipes_dir
from rlpipe.tpu_layout import SliceShare

# The KubeRay manifests whose TPU worker groups give each host's pod memory limit (a checkout's deploy/kuberay).
MANIFESTS_DIR = recipes_dir().parent / "deploy" / "kuberay"
# GKE's node label for each TPU generation (cloud.google.com/gke-tpu-accelerator).
GKE_ACCELERATORS = {
    "v4": "tpu-v4-podslice",
    "v5litepod": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
}


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


def _group_slice(group: dict) -> tuple[str | None, str | None, int, int, float | None]:
    """(accelerator, topology, hosts, chips per host, memory limit) of a KubeRay worker group."""
    spec = group.get("template", {}).get("spec", {}) or {}
    selector = spec.get("nodeSelector") or {}
    chips, memory = 0, None
    for container in spec.get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        if "google.com/tpu" in limits:
            chips = int(str(limits["google.com/tpu"]))
            memory = memory_quantity(limits["memory"]) if "memory" in limits else None
    return (
        selector.get("cloud.google.com/gke-tpu-accelerator"),
        selector.get("cloud.google.com/gke-tpu-topology"),
        int(group.get("numOfHosts", 1)),
        chips,
        memory,
    )


def pod_memory_limit(share: SliceShare, manifests: Path | None = None, role: str = "") -> PodLimit | str:
    """The pod memory limit of a TPU worker group, in the KubeRay manifests under `manifests`, that runs this
    role's slice (same accelerator, topology, hosts and chips per host); the smallest when several do, of the
    groups named after `role` when some are. A string says why there is none: no manifests here, a slice shared
    with the other role (every manifest gives each role hosts of its own), or no group for that slice."""
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
    found: list[PodLimit] = []
    wanted = (GKE_ACCELERATORS.get(tslice.generation), tslice.topology, tslice.hosts, tslice.chips_per_host)
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") not in ("RayCluster", "RayJob"):
                continue
            spec = doc.get("spec") or {}
            cluster = spec if doc["kind"] == "RayCluster" else spec.get("rayClusterSpec") or {}
            for group in cluster.get("workerGroupSpecs") or []:
                accelerator, topology, hosts, chips, memory = _group_slice(group)
                if (accelerator, topology, hosts, chips) == wanted and memory is not None:
                    found.append(PodLimit(memory, path.name, str(group.get("groupName"))))
    if not found:
        return f"no TPU worker group in deploy/kuberay runs a {tslice.pod_type} ({tslice.topology}) slice"
    named = [limit for limit in found if limit.group == role]
    return min(named or found, key=lambda limit: (limit.bytes, limit.manifest))
