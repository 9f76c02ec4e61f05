"""The limits a TPU start meets besides HBM: each host's /dev/shm with Ray's object store in it, read from the
KubeRay manifests; the chip counts a role can take of a host; the LoRA refusal keyed on the engines' platform."""

import re
import shutil
from pathlib import Path

import pytest

from rlpipe.config import ConfigError, load_config
from rlpipe.plan import GIB, LimitCheck, format_plan, plan, plan_checks
from rlpipe.plan.pods import MANIFESTS_DIR, host_limits, ray_default_object_store
from rlpipe.startup.preflight import check_tpu_slices
from rlpipe.hardware.tpu_env import torchtpu_process_env
from rlpipe.hardware.tpu_layout import ENGINE_CHIP_COUNTS, slice_problems, slice_shares

REPO = Path(__file__).resolve().parents[2]
TPU_RECIPES = sorted(p.name for p in (REPO / "configs").glob("*.yaml") if "tpu:" in p.read_text())
# The limits no shipped manifest says, and why: the one-VM recipe's host runs both roles.
UNCHECKED = {
    "qwen3-0.6b-gsm8k-v6e-8-one-vm.yaml": {"learner host RAM", "engine host RAM at a sync", "host /dev/shm"},
}


def _rayjob_recipes() -> dict[str, str]:
    """recipe file name -> the RayJob manifest that runs it."""
    jobs = {}
    for path in sorted(MANIFESTS_DIR.glob("rayjob-*.yaml")):
        recipe = re.search(r"configs/([A-Za-z0-9_.\-]+\.yaml)", path.read_text())[1]
        jobs[recipe] = path.name
    return jobs


@pytest.mark.parametrize("recipe", TPU_RECIPES)
def test_every_shipped_tpu_recipe_passes_every_limit_of_its_manifests(recipe):
    """Every check passes or has nothing to compare against (only where known); and each host's /dev/shm need holds
    in every worker group that runs its slice, the recipe's own RayJob's included, not only in the tightest."""
    cfg = load_config(REPO / "configs" / recipe)
    checks = plan_checks(cfg)
    assert all(isinstance(check, LimitCheck) and len(check) == 3 for check in checks)
    names = {check.name for check in checks}
    assert {"slices and chip counts", "learner HBM per chip", "rollout HBM per chip", "learner load per chip"} <= names
    assert not [check for check in checks if check.passed is False], recipe
    assert {check.name for check in checks if check.passed is None} == UNCHECKED.get(recipe, set())
    assert any("/dev/shm" in name for name in names)

    result = plan(cfg)
    shares = slice_shares(cfg.placement)
    job = _rayjob_recipes().get(recipe)
    for key, role in (("learner_shm", "learner"), ("rollout_shm", "rollout")):
        if key not in {peak.key for peak in result.peaks} or shares[role].shared:
            continue
        peak = result.peak(key)
        own = sum(part.bytes for part in peak.parts if part.key != "object_store")
        groups = host_limits(shares[role], role=role)
        if isinstance(groups, str):
            assert peak.fits is None
            continue
        assert job is None or job in {group.manifest for group in groups}, (recipe, role)
        for group in groups:
            assert group.ray_refusal is None, group
            store = group.object_store if group.object_store_in_shm else 0
            assert own + store <= group.shm, (recipe, role, group.manifest, (own + store) / GIB, group.shm / GIB)
            assert group.shm <= group.memory  # a memory-backed /dev/shm counts in the pod's memory


@pytest.mark.parametrize("recipe", ["llama3-70b-v5p.yaml", "qwen3-30b-a3b-v6e.yaml"])
def test_the_large_recipes_fit_dev_shm_with_margin(recipe):
    """At least 10% of each engine host's /dev/shm to spare beside the staged versions, the rollback copies and
    Ray's object store."""
    peak = plan(load_config(REPO / "configs" / recipe)).peak("rollout_shm")
    assert {"shm_staging", "shm_rollback", "object_store"} <= {part.key for part in peak.parts}
    assert peak.total_bytes <= 0.9 * peak.limit_bytes, (peak.total_gib, peak.limit_label)


def _manifests_with(tmp_path: Path, replace: dict[str, str]) -> Path:
    """A copy of deploy/kuberay with each key of `replace` replaced by its value in every manifest."""
    folder = tmp_path / "kuberay"
    shutil.copytree(MANIFESTS_DIR, folder)
    for path in folder.glob("*.yaml"):
        text = path.read_text()
        for old, new in replace.items():
            text = text.replace(old, new)
        path.write_text(text)
    return folder


def test_a_dev_shm_too_small_for_the_staged_versions_is_refused_in_one_line(tmp_path):
    """The 70B recipe against the v5p manifests as they were (rollout /dev/shm 96Gi, Ray's default object store):
    one engine's staged version and rollback copy (2 x 131.42 GiB) and Ray's default store, 95% of 96 GiB."""
    cfg = load_config(REPO / "configs" / "llama3-70b-v5p.yaml")
    manifests = _manifests_with(tmp_path, {"sizeLimit: 320Gi": "sizeLimit: 96Gi"})
    for path in manifests.glob("*v5p.yaml"):
        path.write_text(re.sub(r"\n *object-store-memory: \"\d+\"", "", path.read_text()))
    result = plan(cfg, manifests=manifests)
    peak = result.peak("rollout_shm")
    store = int(96 * GIB * 0.95)
    assert peak.part("object_store").bytes == store
    over = (2 * result.model.params * 2 + store - 96 * GIB) / GIB
    assert peak.fits is False and peak.over_gib == pytest.approx(over)
    lines = format_plan(result).splitlines()
    assert [line for line in lines if "DOES NOT FIT" in line or "NOT OK" in line][-1] == lines[-1]
    assert lines[-1] == f"plan: NOT OK (engine host /dev/shm over by {over:.2f} GiB)"
    failed = [check for check in result.checks() if check.passed is False]
    assert [check.name for check in failed] == ["engine host /dev/shm"]
    assert "of 96 GiB /dev/shm (sizeLimit 96Gi, raycluster-v5p.yaml, group rollout)" in failed[0].reason


def test_an_object_store_larger_than_dev_shm_stops_ray_and_the_plan_says_so(tmp_path):
    """Above 10 GB an object store that /dev/shm cannot hold stops `ray start` (ray/_private/services.py): counted
    in /dev/shm, so the host does not fit; at or below 10 GB Ray puts it in /tmp, where it takes no /dev/shm."""
    cfg = load_config(REPO / "configs" / "qwen3-8b-v6e.yaml")
    rollout = slice_shares(cfg.placement)["rollout"]
    manifests = _manifests_with(tmp_path, {'object-store-memory: "68719476736"': 'object-store-memory: "600000000000"'})
    assert all("Ray does not start on group rollout" in group.ray_refusal
               for group in host_limits(rollout, manifests, "rollout"))
    result = plan(cfg, manifests=manifests)
    assert result.peak("rollout_shm").fits is False and not result.ok

    smaller = {'object-store-memory: "68719476736"': 'object-store-memory: "9000000000"',
               "sizeLimit: 512Gi": "sizeLimit: 8Gi"}
    small = _manifests_with(tmp_path / "small", smaller)
    for group in host_limits(rollout, small, "rollout"):
        assert group.object_store == 9e9 and group.shm == 8 * GIB
        assert not group.object_store_in_shm and group.ray_refusal is None
    assert "object_store" not in {part.key for part in plan(cfg, manifests=small).peak("rollout_shm").parts}


def test_rays_default_object_store_is_what_ray_computes(monkeypatch):
    """rlpipe's restatement of Ray's default (30% of the memory, at most 200 GB and 95% of /dev/shm, that cap at
    least 10 GB) against the installed Ray's own function, /dev/shm's size faked."""
    from ray._private import utils

    for memory, shm in [(360 * GIB, 96 * GIB), (1200 * GIB, 256 * GIB), (2 * GIB, 64 * 2**20), (600 * GIB, 128 * GIB),
                        (400 * GIB, 8 * GIB), (1200 * GIB, 900 * GIB)]:
        monkeypatch.setattr(utils, "get_shared_memory_bytes", lambda shm=shm: int(shm))
        assert ray_default_object_store(memory, shm) == utils.resolve_object_store_memory(int(memory)), (memory, shm)


# ------------------------------------------------------------------ chip counts


def _one_vm(pod_type: str, topology: str, learner_chips: int, host_chips: int) -> list[str]:
    engines = host_chips - learner_chips
    return [
        f"placement.learner.tpu={pod_type}", f"placement.learner.topology={topology}",
        f"placement.learner.chips={learner_chips}", f"learner.ranks={learner_chips}",
        f"placement.rollout.tpu={pod_type}", f"placement.rollout.topology={topology}",
        f"placement.rollout.chips={engines}", f"rollout.num_engines={engines}",
        "train.micro_batch_size=192", "train.prompts_per_step=24",
    ]


@pytest.mark.parametrize("chips", [2, 3, 5, 6, 7])
def test_a_learner_share_torch_tpu_has_no_topology_for_is_refused_in_one_line(chips):
    """On a v6e host torch_tpu knows 1, 4 and 8 chips (torch_tpu/_internal/utils/hardware.py); the learner's share of
    the host is its topology, so 3, 5, 6 and 7 (a KeyError at placement) and 2 (a topology torch_tpu does not
    have) are refused by the plan and by `rlpipe train`'s start-up checks, in one line."""
    cfg = load_config(REPO / "configs" / "qwen3-0.6b-gsm8k-v6e-8-one-vm.yaml", _one_vm("v6e-8", "2x4", chips, 8))
    message = (f"placement.learner.chips: a tpu learner starts on 1, 4 or 8 chips of a v6e host (the blocks torch_tpu "
               f"knows a topology for), not {chips}")
    assert slice_problems(cfg) == [message]
    with pytest.raises(ConfigError) as caught:
        check_tpu_slices(cfg)
    assert str(caught.value) == message
    layout = [check for check in plan_checks(cfg) if check.name == "slices and chip counts"]
    assert layout == [LimitCheck("slices and chip counts", False, message)]


def test_every_learner_share_the_plan_accepts_gets_an_environment():
    """A share the plan lets through builds its ranks' environment (no KeyError at placement), and 2 chips of a v5p
    host, which torch_tpu knows, passes."""
    for pod_type, topology, host_chips in (("v6e-8", "2x4", 8), ("v5litepod-8", "2x4", 8), ("v5p-8", "2x2x1", 4)):
        for chips in range(1, host_chips):
            cfg = load_config(REPO / "configs" / "qwen3-0.6b-gsm8k-v6e-8-one-vm.yaml",
                              _one_vm(pod_type, topology, chips, host_chips))
            generation = slice_shares(cfg.placement)["learner"].tslice.generation
            accepted = not [p for p in slice_problems(cfg) if p.startswith("placement.learner.chips")]
            assert accepted == (chips in ENGINE_CHIP_COUNTS[generation]), (pod_type, chips)
            if accepted:
                assert torchtpu_process_env(["10.0.0.1"], chips, 0, 0, None)["TORCH_TPU_DEVICES_PER_HOST"] == str(chips)


# ------------------------------------------------------------------ LoRA and the engines' platform


def test_the_lora_refusal_reads_the_engine_platform_not_placement(monkeypatch):
    from rlpipe.config import Config
    from rlpipe.weightsync.form import Kind, decide_weight_form

    on_tpu = load_config(REPO / "configs" / "qwen3-0.6b-gsm8k-v6e.yaml", ["learner.lora.rank=8"])
    assert on_tpu.engine_platform == "vllm-torchtpu"
    form = decide_weight_form(on_tpu)
    assert form.kind is Kind.MERGED and "vllm-torchtpu" in form.why_merged
    off_tpu = load_config(None, ["learner.lora.rank=8"])
    assert off_tpu.engine_platform == "vllm-cpu" and decide_weight_form(off_tpu).kind is Kind.ADAPTERS
    # The platform value alone decides: engines on TorchTPU however they were placed, and the other way round.
    monkeypatch.setattr(Config, "engine_platform", property(lambda self: "vllm-torchtpu"))
    assert decide_weight_form(off_tpu).kind is Kind.MERGED
    monkeypatch.setattr(Config, "engine_platform", property(lambda self: "vllm-cpu"))
    assert decide_weight_form(on_tpu).kind is Kind.ADAPTERS


def test_an_engine_on_torchtpu_refuses_adapters_in_one_line(monkeypatch, tmp_path):
    """The engine checks the platform it finds: adapters handed to an engine that runs vLLM on TorchTPU stop it
    before vLLM starts."""
    from rlpipe.rollout import engine as rollout
    from rlpipe.config import RolloutConfig, SyncConfig
    from rlpipe.config.learner import LoraConfig
    from rlpipe.weightsync.form import Kind, WeightForm

    monkeypatch.setattr(rollout, "vllm_platform", lambda: "torchtpu")
    cfg = RolloutConfig(dtype="bfloat16")
    adapters = WeightForm(Kind.ADAPTERS, LoraConfig(rank=8))
    with pytest.raises(RuntimeError, match="^learner.lora: this engine runs vLLM on TorchTPU"):
        rollout.RolloutEngine(str(tmp_path), cfg, 0, sync=SyncConfig(), form=adapters)


@pytest.mark.parametrize("recipe", ["qwen3-8b-v6e.yaml", "qwen3-30b-a3b-v6e.yaml", "llama3-70b-v5p.yaml"])
def test_docs_give_the_engine_hosts_dev_shm(recipe):
    rows = [line for line in (REPO / "docs" / "tpu.md").read_text().splitlines() if line.startswith(f"| `{recipe}`")]
    assert len(rows) == 1, recipe
    cell = [cell.strip() for cell in rows[0].strip("|").split("|")][4]
    peak = plan(load_config(REPO / "configs" / recipe)).peak("rollout_shm")
    assert cell.startswith(f"{peak.total_gib:.2f}") and cell.endswith(f"of {peak.limit_bytes / GIB:.0f}"), cell
