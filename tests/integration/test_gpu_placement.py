"""The roles' GPUs on a Ray cluster that declares GPUs (this machine has none; Ray hands out the ids it declares and
sets CUDA_VISIBLE_DEVICES as it would on a GPU node): the placement a run makes
(`EngineRoles.place_learner_and_engines`) gives an engine the GPU of the learner rank it shares, two ranks two GPUs,
engines of their own GPUs other GPUs, and an actor of no GPU none; a layout the cluster cannot hold is refused before
anything is placed."""

from __future__ import annotations

import os

import pytest
import ray

from actors.roles import EngineRoles
from rlpipe.config import ConfigError, load_config
from rlpipe.startup.preflight import check_cluster_resources

pytestmark = pytest.mark.integration


@ray.remote
class _Probe:
    def seen(self) -> tuple[str | None, list[str]]:
        return os.environ.get("CUDA_VISIBLE_DEVICES"), [str(gpu) for gpu in ray.get_gpu_ids()]


@pytest.fixture(scope="module")
def two_gpu_cluster():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=6, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(*overrides):
    return load_config(None, ["rollout.group_size=2", "train.prompts_per_step=4", "learner.device=cuda",
                              "ray.placement_timeout_s=60", *overrides])


def _seen(cfg) -> dict[str, list[tuple[str | None, list[str]]]]:
    """What each learner rank, engine and reward worker of `cfg`'s placement is shown."""
    roles = EngineRoles(cfg, note=lambda line: None)
    try:
        learners, engines = roles.place_learner_and_engines()
        rewards = roles._place("reward", 1)
        probes = {
            role: [_Probe.options(**placed.options(index, {})).remote() for index in range(len(placed.slots))]
            for role, placed in (("learner", learners), ("rollout", engines), ("reward", rewards))
        }
        seen = {role: ray.get([probe.seen.remote() for probe in actors], timeout=120)
                for role, actors in probes.items()}
        for actors in probes.values():
            for probe in actors:
                ray.kill(probe)
        return seen
    finally:
        for placed in roles.placements:
            placed.remove()


def test_each_engine_sees_the_gpu_of_the_rank_it_shares_and_ranks_see_two_gpus(two_gpu_cluster):
    cfg = _cfg("learner.ranks=2", "rollout.num_engines=2")
    check_cluster_resources(cfg, ray.cluster_resources())
    seen = _seen(cfg)
    ranks, engines = seen["learner"], seen["rollout"]
    assert [len(ids) for _, ids in ranks + engines] == [1, 1, 1, 1]
    assert {visible for visible, _ in ranks} == {"0", "1"}  # NCCL refuses two ranks on one GPU
    for (rank_visible, rank_ids), (engine_visible, engine_ids) in zip(ranks, engines):
        assert rank_visible == engine_visible == rank_ids[0] == engine_ids[0]
    assert seen["reward"] == [("", [])]  # Ray would leave it unset: every GPU of the node


def test_engines_on_gpus_of_their_own_see_another_gpu_than_the_rank(two_gpu_cluster):
    seen = _seen(_cfg("learner.ranks=1", "rollout.num_engines=1", "placement.learner.gpus=1"))
    (rank_visible, _), = seen["learner"]
    (engine_visible, _), = seen["rollout"]
    assert {rank_visible, engine_visible} == {"0", "1"}


def test_a_layout_the_cluster_cannot_hold_is_refused_in_one_line(two_gpu_cluster):
    cfg = _cfg("learner.ranks=2", "rollout.num_engines=1", "placement.learner.gpus=1")  # 2 ranks + 1 engine = 3
    with pytest.raises(ConfigError, match=r"^learner.device: the roles need 3 GPU\(s\) .*, the cluster has 2$"):
        check_cluster_resources(cfg, ray.cluster_resources())
