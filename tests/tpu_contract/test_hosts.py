"""rlpipe/tpu/hosts.py: every shipped TPU recipe's actors' environments pass through the TPU packages' own launch and
binding code, a placement that puts engines on one chip fails in one line that names the clash, and `tpu_host` is
what lets vllm-torchtpu's topology look-up find a host here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from rlpipe.config import load_config
from rlpipe.tpu import hosts
from rlpipe.hardware.tpu_layout import slice_shares

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(
    path.name for path in (REPO / "configs").glob("*.yaml")
    if ((yaml.safe_load(path.read_text()).get("placement") or {}).get("learner") or {}).get("tpu")
)


def _recipe(name: str):
    return load_config(REPO / "configs" / name)


@pytest.fixture(scope="module")
def packages_imported():
    """What the checks import, imported before os.environ is compared: some set variables when first imported
    (Ray, which vLLM's ParallelConfig imports when it is first made, sets RAY_CLIENT_MODE)."""
    from vllm.config import ParallelConfig
    from vllm.v1.executor.multiproc_executor import WorkerProc  # noqa: F401

    from vllm_torchtpu.platforms.tpu_platform import TpuPlatform  # noqa: F401
    from vllm_torchtpu.worker import tpu_worker  # noqa: F401

    ParallelConfig(tensor_parallel_size=2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_tpu_recipes_environments_pass_and_leave_os_environ_as_it_was(recipe, packages_imported):
    before = dict(os.environ)
    checks = hosts.environment_checks(_recipe(recipe))
    assert [name for name, _, _ in checks] == [hosts.LEARNER_RANKS, hosts.ENGINES]
    for name, passed, reason in checks:
        assert passed, f"{name}: {reason}"
        assert reason and "\n" not in reason
    assert dict(os.environ) == before


def _ray_slice(hosts_count: int, subnet: int) -> tuple[dict[int, str], list[dict]]:
    """A slice's bundles as Ray hands them over (bundle -> node id) and its nodes (`ray.nodes()`)."""
    nodes = [{"NodeID": f"n{b}", "NodeManagerAddress": f"10.{subnet}.{b}.1", "Labels": {}} for b in range(hosts_count)]
    return {b: f"n{b}" for b in range(hosts_count)}, nodes


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_checks_feed_the_environments_placement_gives(recipe):
    """The checks derive each actor's environment with placement's functions in placement's order (rlpipe core does
    not import actors/): the environments actors/placement.py's `slice_slots` gives."""
    from rlpipe.actors.placement import slice_slots

    cfg = _recipe(recipe)
    shares = slice_shares(cfg.placement)
    learner, rollout = shares["learner"], shares["rollout"]
    derived = hosts.learner_rank_envs(learner)
    coords = {bundle: host_coords for bundle, (host_coords, _) in enumerate(derived)}
    bundle_coords = None if learner.tslice.hosts == 1 else {  # each bundle's host's chips, as the checks place them
        bundle: list(reversed(hosts.slice_host_coords(learner.tslice.topology)))[bundle] for bundle in coords}
    slots = slice_slots(learner, *_ray_slice(learner.tslice.hosts, 0), 1, "tpu", bundle_coords, hosts.SESSION_ID)
    assert [slot.env for slot in slots] == [env for _, ranks in derived for env in ranks]
    tp = cfg.rollout.tensor_parallel
    engines = slice_slots(rollout, *_ray_slice(rollout.tslice.hosts, 1), tp)
    for bundle in range(rollout.tslice.hosts):  # every host alike
        assert [slot.env for slot in engines if slot.bundle_index == bundle] == [
            env for _, env in hosts.host_engine_variables(rollout, tp)]


@pytest.mark.parametrize("recipe", ["qwen3-0.6b-gsm8k-v6e.yaml", "qwen3-30b-a3b-v6e.yaml"])
def test_engines_given_the_same_chips_fail_in_one_line_that_names_the_clash(recipe, monkeypatch, packages_imported):
    real = hosts.engine_process_env
    monkeypatch.setattr(hosts, "engine_process_env", lambda first_chip, chips: real(0, chips))
    cfg = _recipe(recipe)
    before = dict(os.environ)
    [engines] = [check for check in hosts.environment_checks(cfg) if check[0] == hosts.ENGINES]
    name, passed, reason = engines
    assert not passed and "\n" not in reason
    assert reason.startswith("engines 0 and 1 both open chip 0"), reason
    assert dict(os.environ) == before


def test_learner_hosts_ranked_in_rays_order_fail_against_torch_tpus_node_rank(monkeypatch):
    monkeypatch.setattr(hosts, "host_rank_order", lambda coords, topology: list(range(len(coords))))
    [learner] = [check for check in hosts.environment_checks(_recipe("qwen3-8b-v6e.yaml"))
                 if check[0] == hosts.LEARNER_RANKS]
    name, passed, reason = learner
    assert not passed and "\n" not in reason
    assert reason.startswith("host 0 (first chip at "), reason
    assert "NODE_RANK '0' where torch_tpu's launch helper sets" in reason, reason


def test_tpu_host_gives_vllm_torchtpus_topology_look_up_a_host_and_only_within_it():
    from vllm_torchtpu.platforms.tpu_platform import TpuPlatform

    with pytest.raises(ValueError, match="No TPU devices found"):
        TpuPlatform._get_tpu_topology(4)
    with hosts.tpu_host("v6e", 8):
        assert TpuPlatform._get_tpu_topology(4) == "2,2,1"  # a 2x2 block of the 2x4 chips of a v6e host
        assert TpuPlatform._get_tpu_topology(8) == "2,4,1"
    with pytest.raises(ValueError, match="No TPU devices found"):
        TpuPlatform._get_tpu_topology(4)
