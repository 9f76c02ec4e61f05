"""Which GPUs the learner ranks and the engines take (rlpipe/hardware/gpu_layout.py): the default that puts an engine
beside a learner rank on one GPU, explicit shares, the one-line refusals, vLLM's memory fraction of a share, the
cluster's GPU count, the bundles that pair a rank and an engine, and `rlpipe plan`'s GPU figures. Placement on a Ray
cluster that declares GPUs is tests/integration/test_gpu_placement.py."""

from __future__ import annotations

import pytest

from actors.placement import PlacedRole, Slot, cpu_bundles
from rlpipe.config import ConfigError, RolePlacement, load_config
from rlpipe.hardware.gpu_layout import engine_memory_fraction, gpu_layout, gpu_problems, gpus_of_cluster_needed
from rlpipe.plan import plan
from rlpipe.plan.model_size import ModelSize
from rlpipe.startup.preflight import check_cluster_resources, check_gpu_layout


def _cfg(*overrides):
    return load_config(None, ["rollout.group_size=2", "train.prompts_per_step=4", *overrides])


def test_with_a_cuda_learner_each_engine_shares_a_ranks_gpu_half_each_by_default():
    layout = gpu_layout(_cfg("learner.device=cuda", "learner.ranks=2", "rollout.num_engines=2"))
    assert (layout.learner, layout.rollout, layout.colocated) == (0.5, 0.5, True)
    assert layout.gpus == 2 and "2 engine(s) sharing a learner rank's GPU" in layout.describe()
    fewer = gpu_layout(_cfg("learner.device=cuda", "learner.ranks=2", "rollout.num_engines=1"))
    assert fewer.colocated and fewer.gpus == 2  # rank 1's GPU is its own, reserved whole


def test_engines_take_gpus_of_their_own_where_they_cannot_pair_with_a_rank():
    more = gpu_layout(_cfg("learner.device=cuda", "learner.ranks=1", "rollout.num_engines=2"))
    assert (more.learner, more.rollout, more.colocated, more.gpus) == (1.0, 1.0, False, 3)
    wide = gpu_layout(_cfg("learner.device=cuda", "rollout.tensor_parallel=2", "rollout.num_engines=1"))
    assert (wide.learner, wide.rollout, wide.gpus) == (1.0, 2.0, 3)
    whole = gpu_layout(_cfg("learner.device=cuda", "placement.learner.gpus=1"))
    assert (whole.learner, whole.rollout, whole.colocated) == (1.0, 1.0, False)


def test_explicit_shares_and_engines_on_gpus_beside_a_cpu_learner():
    share = gpu_layout(_cfg("learner.device=cuda", "placement.learner.gpus=0.7"))
    assert (share.learner, share.rollout, share.colocated) == (0.7, pytest.approx(0.3), True)
    cpu_learner = _cfg("placement.rollout.gpus=0.25", "rollout.num_engines=3")
    layout = gpu_layout(cpu_learner)
    assert (layout.learner, layout.rollout, layout.colocated, layout.gpus) == (0.0, 0.25, False, 0.75)
    assert gpus_of_cluster_needed(cpu_learner) == 1 and cpu_learner.engine_platform == "vllm"
    assert not gpu_layout(_cfg()).on_gpus and _cfg().engine_platform == "vllm-cpu"
    assert _cfg("learner.device=cuda").engine_platform == "vllm"
    assert _cfg("learner.device=cuda", "placement.rollout.gpus=0").engine_platform == "vllm-cpu"


def test_vllm_claims_its_memory_fraction_of_the_engines_share():
    assert engine_memory_fraction(_cfg("learner.device=cuda", "rollout.gpu_memory_utilization=0.8")) == 0.4
    assert engine_memory_fraction(_cfg("placement.rollout.gpus=1", "rollout.gpu_memory_utilization=0.8")) == 0.8
    assert engine_memory_fraction(_cfg("rollout.gpu_memory_utilization=0.3")) == 0.3  # CPU: unchanged


@pytest.mark.parametrize("overrides, message", [
    (["placement.learner.gpus=1"], "placement.learner.gpus: the learner takes GPUs with learner.device cuda"),
    (["learner.device=cuda", "placement.learner.gpus=2"], "a cuda learner rank runs on one GPU or a share of one"),
    (["learner.device=cuda", "placement.learner.gpus=0.5", "placement.rollout.gpus=1"],
     "placement.learner.gpus: a share of a GPU (0.5) is for sharing it with an engine"),
    (["learner.device=cuda", "placement.learner.gpus=0.5", "placement.rollout.gpus=0.6"],
     "add up to more than the GPU"),
    (["learner.device=cuda", "placement.learner.gpus=0.5", "placement.rollout.gpus=0.5", "rollout.num_engines=2"],
     "placement.rollout.gpus: 2 engines cannot each share one of 1 learner ranks' GPUs"),
    (["placement.rollout.gpus=1", "rollout.tensor_parallel=2"], "an engine of rollout.tensor_parallel 2 takes 2"),
    (["placement.rollout.gpus=0.5", "rollout.tensor_parallel=2"], "a share of one GPU (0.5) holds one worker"),
    (["placement.rollout.gpus=1.5"], "an engine of rollout.tensor_parallel 1 takes 1 whole GPUs"),
    (["placement.reward.gpus=1"], "placement.reward.gpus: the reward role runs on CPUs"),
    (["placement.scorer.gpus=0.5"], "placement.scorer.gpus: the scorer role runs on CPUs"),
])
def test_an_impossible_layout_is_refused_in_one_line_naming_the_key(overrides, message):
    cfg = _cfg(*overrides)
    problems = gpu_problems(cfg)
    assert problems and message in problems[0] and "\n" not in problems[0]
    with pytest.raises(ConfigError, match="^" + problems[0].split(":")[0]):
        check_gpu_layout(cfg)
    assert problems[0] in plan(cfg, _tiny_model()).problems


def test_a_negative_or_boolean_gpu_count_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="placement.rollout.gpus: a number of GPUs >= 0"):
        _cfg("placement.rollout.gpus=-1")
    with pytest.raises(ConfigError, match="placement.gpu_memory_gib: a size in GiB > 0"):
        _cfg("placement.gpu_memory_gib=0")


def test_the_cluster_must_hold_every_roles_gpus():
    paired = _cfg("learner.device=cuda", "learner.ranks=2", "rollout.num_engines=2")
    check_cluster_resources(paired, {"CPU": 8.0, "GPU": 2.0})
    with pytest.raises(ConfigError, match=r"^learner.device: the roles need 2 GPU\(s\) \(2 GPU\(s\): 2 engine"):
        check_cluster_resources(paired, {"CPU": 8.0, "GPU": 1.0})
    apart = _cfg("learner.device=cuda", "learner.ranks=1", "rollout.num_engines=2")
    with pytest.raises(ConfigError, match=r"the roles need 3 GPU\(s\)"):
        check_cluster_resources(apart, {"CPU": 8.0, "GPU": 2.0})
    engines = _cfg("placement.rollout.gpus=0.5", "rollout.num_engines=2")
    check_cluster_resources(engines, {"CPU": 8.0, "GPU": 1.0})
    with pytest.raises(ConfigError, match=r"^placement.rollout.gpus: the roles need 1 GPU\(s\).* has 0$"):
        check_cluster_resources(engines, {"CPU": 8.0})


def test_a_ranks_bundle_holds_a_whole_gpu_and_a_cpu_for_its_engine():
    spec = RolePlacement()
    assert cpu_bundles(spec, 2, 0.5, paired=1) == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert cpu_bundles(spec, 2, 0.25) == [{"CPU": 1.0, "GPU": 0.25}] * 2
    from ray.util.placement_group import PlacementGroup

    engine = PlacedRole("rollout", PlacementGroup.empty(), [Slot(0, gpus=0.5)]).options(0, {})
    assert engine["num_gpus"] == 0.5 and "CUDA_VISIBLE_DEVICES" not in engine["runtime_env"]["env_vars"]


def _tiny_model() -> ModelSize:
    return ModelSize.from_hf({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000,
                              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "tie_word_embeddings": True, "max_position_embeddings": 4096}, "tiny")


def test_the_plan_counts_a_gpus_learner_rank_and_engine_against_its_memory():
    model = _tiny_model()
    shared = plan(_cfg("learner.device=cuda", "placement.gpu_memory_gib=80", "rollout.gpu_memory_utilization=0.5"),
                  model)
    gpu = shared.peak("gpu")
    assert gpu.part("gpu_learner").bytes == shared.learner.total_bytes
    assert gpu.part("gpu_engine").bytes == pytest.approx(0.25 * 80 * 2**30)
    assert gpu.total_bytes == pytest.approx(gpu.part("gpu_learner").bytes + 0.25 * 80 * 2**30) and gpu.fits
    starved = plan(_cfg("learner.device=cuda", "placement.gpu_memory_gib=1", "rollout.gpu_memory_utilization=0.001"),
                   model)
    assert any(p.startswith("rollout.gpu_memory_utilization: an engine's weights and KV cache take")
               for p in starved.problems) and not starved.ok
    unknown = plan(_cfg("learner.device=cuda"), model).peak("gpu")
    assert unknown.fits is None and "placement.gpu_memory_gib is null" in unknown.missing
    assert unknown.part("gpu_engine").bytes == plan(_cfg("learner.device=cuda"), model).rollout.total_bytes
    with pytest.raises(KeyError):
        plan(_cfg(), model).peak("gpu")


def test_an_engine_refuses_gpus_its_vllm_cannot_use_and_a_cuda_vllm_without_a_gpu():
    from actors.rollout import platform_refusal

    assert platform_refusal("cuda", ["0"]) is None and platform_refusal("cpu", []) is None
    assert platform_refusal("torchtpu", []) is None
    on_cpu = platform_refusal("cpu", ["1"])
    assert on_cpu.startswith("rollout: Ray gave this engine GPU(s) 1") and "placement.rollout.gpus: 0" in on_cpu
    assert platform_refusal("cuda", []).startswith("rollout: this engine's vLLM is for CUDA but Ray gave it no GPU")


def test_a_run_whose_gpus_cannot_hold_its_roles_stops_before_anything_starts(tmp_path):
    from rlpipe.startup.preflight import check_gpu_memory
    from bench.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", "qwen3")
    check_gpu_memory(_cfg("learner.device=cuda", "placement.gpu_memory_gib=80"), model)
    check_gpu_memory(_cfg("learner.device=cuda", "rollout.gpu_memory_utilization=0.0001"), model)  # no size: no check
    with pytest.raises(ConfigError, match=r"^rollout.gpu_memory_utilization: an engine's weights and KV cache take"):
        check_gpu_memory(_cfg("learner.device=cuda", "placement.gpu_memory_gib=1",
                              "rollout.gpu_memory_utilization=0.0001"), model)
    # The engine claims half of 1 GiB, and the learner rank needs more than the other half.
    with pytest.raises(ConfigError, match=r"^placement.gpu_memory_gib: the fullest GPU would hold .* of 1 GiB$"):
        check_gpu_memory(_cfg("learner.device=cuda", "placement.gpu_memory_gib=1",
                              "rollout.gpu_memory_utilization=1.0"), model)
