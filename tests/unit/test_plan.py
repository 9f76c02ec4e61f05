"""`rlpipe plan`: per-chip memory arithmetic, the load and host-RAM peaks against the deploy manifests, shipped
architectures, pod types, the TPU recipes, exit codes."""

import json
from pathlib import Path

import pytest

from rlpipe.cli import main
from rlpipe.config import ConfigError, load_config
from rlpipe.hardware.device import tpu_slice
from rlpipe.models.registry import model_architecture
from rlpipe.plan import GIB, ModelSize, load_architecture, plan
from rlpipe.plan.engine import BUCKETS_IN_FLIGHT, kv_heads_per_chip
from rlpipe.plan.learner import DCP_COPY_AHEAD
from rlpipe.plan.pods import MANIFESTS_DIR, PodLimit, memory_quantity, pod_memory_limit
from rlpipe.weightsync.sender import _PACK_AHEAD

REPO = Path(__file__).resolve().parents[2]
# Every recipe in configs/ that places a role on a TPU slice.
TPU_RECIPES = sorted(p.name for p in (REPO / "configs").glob("*.yaml") if "tpu:" in p.read_text())

# A made-up architecture small enough to count by hand.
TINY = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
}


def _tiny_folder(tmp_path: Path, **extra) -> Path:
    folder = tmp_path / "tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**TINY, **extra}))
    return folder


def _tiny_config(folder: Path, *extra: str):
    return load_config(
        None,
        [
            f"model.path={folder}",
            "model.dtype=float32",
            "learner.ranks=2",
            "learner.device=tpu",
            "model.kernels.attention=pallas",
            "learner.param_dtype=bfloat16",
            "learner.reduce_dtype=float32",
            "train.prompts_per_step=2",
            "rollout.group_size=2",
            "train.micro_batch_size=2",
            "data.max_prompt_tokens=8",
            "rollout.max_tokens=8",
            "rollout.max_model_len=16",
            "rollout.num_engines=1",
            "rollout.tensor_parallel=2",
            "rollout.dtype=bfloat16",
            "placement.learner.tpu=v5p-4",
            "placement.learner.topology=1x2x1",
            "placement.rollout.tpu=v5p-4",
            "placement.rollout.topology=1x2x1",
            *extra,
        ],
    )


def test_arithmetic_of_a_small_architecture_by_hand(tmp_path):
    result = plan(_tiny_config(_tiny_folder(tmp_path)))
    assert result.source == tmp_path / "tiny" / "config.json"  # the local folder wins over configs/models

    # Parameters: embedding + untied lm_head + 2 x (q, k, v, o + gate/up/down + 2 norms) + final norm.
    embed = 100 * 16
    layer = (16 * 32) + 2 * (16 * 16) + (32 * 16) + 3 * (16 * 32) + 2 * 16
    P = 2 * embed + 2 * layer + 16
    assert P == 9424
    assert result.model.params == P

    learner = result.learner
    assert learner.part("parameters").bytes == P * 4 / 2
    assert learner.part("gradients").bytes == P * 4 / 2
    assert learner.part("optimizer").bytes == 2 * P * 4 / 2
    # Without activation checkpointing autograd keeps every gathered bf16 weight for backward (all but the untied
    # input embedding, whose lookup keeps only the ids), plus the gradient of the largest unit, one decoder layer
    # (3104 > 1600): bf16 and its fp32 cast for the reduce-scatter.
    assert learner.part("gathered").bytes == (P - embed) * 2 + layer * (2 + 4)
    # One micro-batch: 2 rows x (8 + 8) tokens. Per token and layer, bf16 compute (a = 2):
    tokens = 2 * 16
    norms = 2 * (4 + 2) * 16
    qkv = 2 * (4 * 8 + 2 * 2 * 8)
    attn_out = 2 * (4 * 8)
    mlp = 2 * 4 * 32
    per_layer = norms + qkv + attn_out + mlp
    final = (4 + 2) * 16 + 4  # final norm + log-sum-exp
    assert learner.part("activations").bytes == tokens * (2 * per_layer + final)
    # Chunked log-probs: the chunk is the whole (100-entry) vocabulary here.
    logprob = 3 * 4 * tokens * 100 + 4 * tokens * 16
    assert learner.part("logprob").bytes == logprob
    assert learner.total_bytes == pytest.approx(
        P * 4 / 2 * 4 + (P - embed) * 2 + layer * 6 + tokens * (2 * per_layer + final) + logprob
    )

    # With it the re-run layer gathers its weights again: one unit at a time, its bf16 copy and its gradient. Each
    # layer keeps its bf16 input (16) and the attention kernel's output (4 heads x 8) and fp32 log-sum-exp (4 heads);
    # one layer's full activations exist during its recompute.
    checkpointed = plan(_tiny_config(_tiny_folder(tmp_path / "ac"), "learner.activation_checkpointing=true")).learner
    assert checkpointed.part("gathered").bytes == layer * (2 + 2 + 4)
    saved = 2 * (16 + 4 * 8) + 4 * 4
    assert checkpointed.part("activations").bytes == tokens * (2 * saved + per_layer + final)
    assert checkpointed.total_bytes == pytest.approx(
        P * 4 / 2 * 4 + layer * 8 + tokens * (2 * saved + per_layer + final) + logprob
    )

    # Rollout: TP 2 splits everything but k/v, whose 2 kv heads split 1 per chip (here also exactly 1/2).
    rollout = result.rollout
    assert rollout.part("weights").bytes == P * 2 / 2
    # 4 sequences (2 prompts x 2 samples, 1 engine) x 16 tokens x (k, v) x 2 layers x 1 kv head x 8 x bf16.
    assert rollout.part("kv_cache").bytes == 4 * 16 * 2 * 2 * 1 * 8 * 2
    assert result.ok and not result.problems


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"], ["mlp.down_proj", "lm_head"]])
def test_lora_counts_the_adapters_the_learner_adds_and_trains_nothing_else(tmp_path, targets):
    from rlpipe.config.learner import LoraConfig, is_targeted
    from rlpipe.training.lora import add_adapters
    from rlpipe.models.hf import meta_model

    folder = _tiny_folder(tmp_path)
    lora = LoraConfig(rank=3, target_modules=targets)
    model = meta_model(folder)
    added = sum(t.numel() for t in add_adapters(model, lora).values())
    assert added == sum(p.numel() for p in model.parameters() if p.requires_grad)
    listed = ", ".join(f'"{t}"' for t in targets)
    result = plan(_tiny_config(folder, "learner.lora.rank=3", f"learner.lora.target_modules=[{listed}]"))
    assert result.model.adapter_params(3, targets) == added
    learner, full = result.learner, plan(_tiny_config(folder)).learner
    b = 4  # float32 master weights
    assert learner.part("adapters").bytes == added * b
    assert learner.part("gradients").bytes == added * b
    assert learner.part("optimizer").bytes == 2 * added * b
    assert learner.part("parameters").bytes == full.part("parameters").bytes  # the frozen base, sharded as before
    assert learner.total_bytes < full.total_bytes
    checkpoint = result.peak("learner_host").part("host_checkpoint").bytes
    assert checkpoint < plan(_tiny_config(folder)).peak("learner_host").part("host_checkpoint").bytes
    # What a sync moves. The engines here run on TPU slices, which take no adapters: merged weights, one targeted
    # weight's rows merged in float32 at a time beside the packed parts.
    rb, ranks = 2, 2  # bf16 rollout, two learner ranks on this host
    sync = result.peak("learner_host").part("host_sync")
    full_sync = plan(_tiny_config(folder)).peak("learner_host").part("host_sync").bytes
    widest = max(n_in * n_out for name, n_in, n_out in result.model.linear_layers if is_targeted(name, targets))
    assert sync.bytes == full_sync + ranks * (widest // ranks) * (8 + b)
    # On CPU engines the adapters go alone, unless one is on lm_head; the engine keeps vLLM's adapter buffers.
    cpu = load_config(None, [f"model.path={folder}", "learner.lora.rank=3", f"learner.lora.target_modules=[{listed}]"])
    on_cpu, rb = plan(cpu), 4  # float32 rollout
    sync, staging = on_cpu.peak("learner_host").part("host_sync"), on_cpu.peak("rollout_host").part("staging")
    if "lm_head" in targets:
        assert staging.bytes == on_cpu.model.params * rb and "lora_buffers" not in [p.key for p in on_cpu.rollout.parts]
    else:
        assert sync.bytes == 2 * added * rb and "adapters alone" in sync.label and staging.bytes == added * rb
        assert on_cpu.rollout.part("lora_buffers").bytes == on_cpu.model.adapter_params(8, targets) * rb  # rank 8


@pytest.mark.heavy
def test_torch_attention_counts_the_scores_sdpa_forms(tmp_path):
    """torch's sdpa under a packed row's [W, W] mask (or on a TPU) forms s x s scores; the Pallas kernel none."""
    folder = _tiny_folder(tmp_path)
    assert "attention_scores" not in {part.key for part in plan(_tiny_config(folder)).learner.parts}
    packed = plan(_tiny_config(folder, "model.kernels.attention=torch")).learner
    width = 2 * 16  # the micro-batch's 2 rows of 16 tokens, packed end to end
    # Both layers keep their probabilities (4 heads, bf16), the running one its scores, and the bool mask.
    assert packed.part("attention_scores").bytes == (2 + 1) * 4 * width**2 * 2 + width**2
    padded = plan(_tiny_config(folder, "model.kernels.attention=torch", "learner.packing=false")).learner
    assert padded.part("attention_scores").bytes == (2 + 1) * 2 * 4 * 16**2 * 2
    recomputed = plan(
        _tiny_config(folder, "model.kernels.attention=torch", "learner.activation_checkpointing=true")
    ).learner
    assert recomputed.part("attention_scores").bytes == (1 + 1) * 4 * width**2 * 2 + width**2
    without = plan(_tiny_config(folder)).learner.total_bytes
    assert packed.total_bytes == pytest.approx(without + packed.part("attention_scores").bytes)


def test_rollout_replicates_kv_heads_when_tensor_parallel_exceeds_them(tmp_path):
    result = plan(_tiny_config(_tiny_folder(tmp_path), "rollout.tensor_parallel=4", "placement.rollout.tpu=v5litepod-4",
                               "placement.rollout.topology=2x2"))
    kv_per_layer = 2 * 16 * 16  # k_proj + v_proj
    P = result.model.params
    # Everything else (the vocabulary too) split 4 ways; k/v: 1 of the 2 heads on each chip, i.e. half of them.
    assert result.rollout.part("weights").bytes == (P - 2 * kv_per_layer) * 2 / 4 + 2 * kv_per_layer * 2 / 2
    assert result.rollout.part("kv_cache").bytes == 4 * 16 * 2 * 2 * 1 * 8 * 2
    assert kv_heads_per_chip(8, 2) == 4 and kv_heads_per_chip(4, 8) == 1 and kv_heads_per_chip(8, 8) == 1
    odd = plan(_tiny_config(_tiny_folder(tmp_path / "odd"), "rollout.tensor_parallel=3", "placement.rollout.tpu=v5litepod-3",
                       "placement.rollout.topology=1x3"))
    assert any("neither divides" in problem for problem in odd.problems)


# Published totals (model cards): Qwen3-0.6B 0.6B (0.44B non-embedding), Qwen3-8B 8.2B (6.95B non-embedding),
# Llama-3-70B 70.6B, Qwen3-30B-A3B 30.5B total / 3.3B activated (29.9B non-embedding).
@pytest.mark.parametrize(
    "name, total, non_embedding, active",
    [
        ("Qwen3-0.6B", 0.6e9, 0.44e9, None),
        ("Qwen3-8B", 8.2e9, 6.95e9, None),
        ("Meta-Llama-3-70B", 70.6e9, None, None),
        ("Qwen3-30B-A3B", 30.5e9, 29.9e9, 3.3e9),
    ],
)
def test_shipped_architectures_match_published_sizes(name, total, non_embedding, active):
    arch, source = load_architecture(f"/nonexistent/models/{name}")
    assert source == REPO / "configs" / "models" / f"{name}.json"
    assert arch.params == pytest.approx(total, rel=0.02)
    if non_embedding is not None:
        embeddings = arch.embedding_params + arch.output_params
        assert arch.params - embeddings == pytest.approx(non_embedding, rel=0.02)
    if active is not None:
        assert arch.active_params == pytest.approx(active, rel=0.02)
    else:
        assert arch.active_params == arch.params


def test_moe_counts_router_and_every_expert():
    arch = ModelSize.from_hf(
        {**TINY, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    )
    attention = (16 * 32) + 2 * (16 * 16) + (32 * 16) + 2 * 8  # + q/k norm (Qwen3)
    moe = 16 * 4 + 4 * 3 * 16 * 8
    active = 16 * 4 + 2 * 3 * 16 * 8
    assert arch.params == 2 * 100 * 16 + 2 * (attention + moe + 2 * 16) + 16
    assert arch.active_params == 2 * 100 * 16 + 2 * (attention + active + 2 * 16) + 16


def test_architecture_is_read_as_the_model_classes_read_it(tmp_path):
    """rlpipe/models parses config.json for the plan too: Qwen3's default head_dim (128, not hidden / heads), and a
    mixture of experts rlpipe does not build (transformers would run it) is a config error."""
    qwen3 = {**{key: value for key, value in TINY.items() if key != "head_dim"}, "model_type": "qwen3"}
    assert ModelSize.from_hf(qwen3).head_dim == model_architecture(qwen3).head_dim == 128
    folder = tmp_path / "mixtral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY, "model_type": "mixtral"}))
    with pytest.raises(ConfigError, match="model_type 'mixtral': a mixture of experts .* runs only on rlpipe's"):
        load_architecture(str(folder))


@pytest.mark.parametrize(
    "pod_type, chips, hbm",
    [("v5p-64", 32, 95), ("v5p-16", 8, 95), ("v6e-16", 16, 32), ("v6e-8", 8, 32), ("v5litepod-8", 8, 16), ("v4-8", 4, 32)],
)
def test_chips_per_pod_type(pod_type, chips, hbm):
    tpu = tpu_slice(pod_type)
    assert (tpu.chips, tpu.hbm_gib, tpu.hbm_bytes) == (chips, hbm, hbm * GIB)


@pytest.mark.parametrize("bad", ["v5p-7", "v9x-8", "tpu-8", "v6e"])
def test_unknown_pod_types_are_config_errors(bad):
    with pytest.raises(ConfigError, match="placement.learner.tpu"):
        plan(load_config(REPO / "configs" / "qwen3-8b-v6e.yaml", [f"placement.learner.tpu={bad}"]))


@pytest.mark.parametrize("recipe", TPU_RECIPES)
def test_every_shipped_tpu_recipe_loads_and_fits(recipe, capsys):
    cfg = load_config(REPO / "configs" / recipe)
    assert cfg.learner.device == "tpu" and cfg.placement.learner.tpu and cfg.placement.rollout.tpu
    result = plan(cfg)
    assert result.learner.fits and result.rollout.fits, (result.learner.total_gib, result.rollout.total_gib)
    assert result.ok, result.problems
    assert main(["plan", str(REPO / "configs" / recipe)]) == 0
    out = capsys.readouterr().out
    assert "plan: OK" in out and "DOES NOT FIT" not in out


def test_the_tpu_recipes_are_shipped():
    assert {
        "qwen3-0.6b-gsm8k-v6e.yaml",
        "qwen3-0.6b-gsm8k-v5e.yaml",
        "qwen3-8b-v6e.yaml",
        "llama3-70b-v5p.yaml",
        "qwen3-30b-a3b-v6e.yaml",
    } <= set(TPU_RECIPES)


def test_oversized_micro_batch_does_not_fit(capsys):
    recipe = str(REPO / "configs" / "qwen3-8b-v6e.yaml")
    assert main(["plan", recipe, "train.prompts_per_step=32", "train.micro_batch_size=16"]) == 1
    out = capsys.readouterr().out
    assert "learner on v6e-16 (16 chips x 32 GiB HBM)" in out and "DOES NOT FIT" in out and "plan: NOT OK (learner does not fit)" in out


def test_the_big_recipes_fit_only_with_activation_checkpointing():
    """Without it every gathered weight is kept for backward: 8B in bf16 alone is over half a v6e chip."""
    for recipe in ("qwen3-8b-v6e.yaml", "llama3-70b-v5p.yaml", "qwen3-30b-a3b-v6e.yaml"):
        without = plan(load_config(REPO / "configs" / recipe, ["learner.activation_checkpointing=false"]))
        arch = without.model
        kept = arch.params - (0 if arch.tie_word_embeddings else arch.embedding_params)
        assert without.learner.part("gathered").bytes == kept * 2 + arch.largest_unit_params * (2 + 4), recipe
        assert without.learner.fits is False, recipe


def test_wrong_rank_count_is_a_problem_line(capsys):
    recipe = str(REPO / "configs" / "qwen3-8b-v6e.yaml")
    fewer = ["learner.ranks=8", "train.micro_batch_size=28"]  # a rank's whole share in one pass, as the graph step needs
    result = plan(load_config(recipe, fewer))
    assert "learner.ranks = 8 but placement.learner takes 16 chips of v6e-16 (4x4) (one rank per chip)" in result.problems
    assert not result.ok
    assert main(["plan", recipe, *fewer, "rollout.num_engines=2"]) == 1
    out = capsys.readouterr().out
    assert "learner.ranks = 8 but placement.learner takes 16 chips of v6e-16" in out
    assert "rollout.num_engines x rollout.tensor_parallel = 2 but placement.rollout takes 8 chips of v6e-8" in out


def test_topology_must_match_the_pod_type():
    recipe = REPO / "configs" / "qwen3-8b-v6e.yaml"
    with pytest.raises(ConfigError, match="placement.rollout.tpu: TPU topology '4x4' does not have the 8 chips of v6e-8"):
        plan(load_config(recipe, ["placement.rollout.topology=4x4"]))


def test_unknown_model_is_a_config_error(tmp_path, capsys):
    assert main(["plan", str(REPO / "configs" / "qwen3-8b-v6e.yaml"), f"model.path={tmp_path}/NoSuchModel-1B"]) == 2
    assert "configs/models/NoSuchModel-1B.json" in capsys.readouterr().err


def test_side_without_a_slice_has_no_verdict(tmp_path):
    result = plan(load_config(None, [f"model.path={_tiny_folder(tmp_path)}"]))
    assert result.learner.fits is None and result.rollout.fits is None
    assert result.ok and not result.problems


# ------------------------------------------------------------------ peaks outside the steady step

TINY_MANIFEST = """\
apiVersion: ray.io/v1
kind: RayCluster
metadata: {{name: tiny}}
spec:
  workerGroupSpecs:
{groups}
"""
TINY_GROUP = """\
    - groupName: {role}
      numOfHosts: 1
      template:
        spec:
          nodeSelector: {{cloud.google.com/gke-tpu-accelerator: tpu-v5p-slice, cloud.google.com/gke-tpu-topology: 1x2x1}}
          containers:
            - name: ray-worker
              resources: {{limits: {{memory: "{memory}", google.com/tpu: "2"}}}}
"""


def _manifests(tmp_path: Path, learner: str = "1Gi", rollout: str = "2Gi") -> Path:
    """A folder with one RayCluster whose learner and rollout groups run the tiny config's v5p-4 slices."""
    folder = tmp_path / "kuberay"
    folder.mkdir(parents=True)
    groups = TINY_GROUP.format(role="learner", memory=learner) + TINY_GROUP.format(role="rollout", memory=rollout)
    (folder / "raycluster-tiny.yaml").write_text(TINY_MANIFEST.format(groups=groups))
    return folder


def test_peaks_of_a_small_architecture_by_hand(tmp_path):
    """The load per chip, a learner host's phases and an engine host at a sync, counted on the tiny model stored
    in bf16: P = 9424, 2 ranks on one v5p-4 host (2 chips), 1 engine of tensor-parallel 2 on the other."""
    folder = _tiny_folder(tmp_path, torch_dtype="bfloat16")
    result = plan(_tiny_config(folder, "sync.bucket_mb=0.001"), manifests=_manifests(tmp_path))
    P, embed, layer = 9424, 100 * 16, 3104
    assert result.model.stored_dtype == "bfloat16" and result.model.largest_unit_params == layer

    # Load, per chip: the float32 parameter shard, and the largest unit (a layer) as read (bf16) and cast (fp32).
    load = result.peak("learner_load")
    assert load.part("load_shard").bytes == P * 4 / 2
    assert load.part("load_unit").bytes == layer * (2 + 4)
    assert load.total_bytes == P * 4 / 2 + layer * 6
    assert load.limit_bytes == result.learner.usable_bytes and load.fits

    # A learner host (both ranks): the largest share one rank owns of one tensor is half the embedding or the
    # lm_head, 50 rows x 16; the transport keeps each rank's bf16 parts of every bucket (half the model each).
    host = result.peak("learner_host")
    rows = 50 * 16
    assert result.model.largest_rows_params(2) == rows
    kept = 2 * P * 2 / 2
    assert host.part("host_load").bytes == 2 * rows * (2 + 4)
    assert host.part("host_sync").bytes == 2 * kept  # + the object store's copy until the version is committed
    assert host.part("host_checkpoint").bytes == 2 * (rows * 4 + DCP_COPY_AHEAD) + kept
    assert host.part("host_resume").bytes == 2 * 2 * rows * 4  # an item's bytes read, and loaded as a tensor
    # Streamed: each of the 2 ranks gathers one whole tensor (the 100 x 16 embedding) at a time; rank 0 holds one
    # safetensors shard, here the whole (small) model.
    assert host.part("host_export").bytes == 2 * 100 * 16 * 4 + P * 4 + kept
    assert host.total_bytes == max(part.bytes for part in host.parts) == 2 * (rows * 4 + DCP_COPY_AHEAD) + kept
    assert host.limit_bytes == GIB and host.fits and "raycluster-tiny.yaml, group learner" in host.limit_label

    # An engine host: the staged bf16 version (the copy its workers read), 3 buckets in flight (the bucket is 0.001
    # MiB, smaller than the embedding, which is never split: 1600 x bf16), and the rollback copy.
    assert BUCKETS_IN_FLIGHT == _PACK_AHEAD + 1
    engine = result.peak("rollout_host")
    assert [part.key for part in engine.parts] == ["staging", "in_flight", "rollback"]
    assert engine.part("staging").bytes == engine.part("rollback").bytes == P * 2
    assert engine.part("in_flight").bytes == 3 * embed * 2
    assert engine.total_bytes == 2 * P * 2 + 3 * embed * 2
    assert engine.limit_bytes == 2 * GIB and engine.fits
    assert result.ok

    # Without the rollback copy, with a bucket larger than any tensor, and four engines of one chip on a host.
    four = plan(
        _tiny_config(folder, "sync.keep_previous=false", "sync.bucket_mb=1", "rollout.tensor_parallel=1",
                     "rollout.num_engines=4", "placement.rollout.tpu=v5litepod-4", "placement.rollout.topology=2x2"),
        manifests=_manifests(tmp_path / "four"),
    ).peak("rollout_host")
    assert [part.key for part in four.parts] == ["staging", "in_flight"]
    assert four.total_bytes == 4 * (P * 2 + 3 * 2**20)
    assert four.fits is None and "no TPU worker group in deploy/kuberay runs a v5litepod-4 (2x2) slice" in four.missing

    # Without the export at the end, no phase holds the whole model.
    unexported = plan(_tiny_config(folder, "metrics.export=false"), manifests=_manifests(tmp_path / "x")).peak("learner_host")
    assert "host_export" not in {part.key for part in unexported.parts}

    # The reference model (algo.kl_beta > 0) is loaded too: a second shard on the chip.
    kl = plan(_tiny_config(folder, "algo.kl_beta=0.1"), manifests=_manifests(tmp_path / "kl")).peak("learner_load")
    assert kl.total_bytes == 2 * P * 4 / 2 + layer * 6
    # Under LoRA the frozen base is the reference: no second shard, at load or in the step.
    lora_kl = plan(_tiny_config(folder, "algo.kl_beta=0.1", "learner.lora.rank=2"), manifests=_manifests(tmp_path / "lk"))
    assert lora_kl.peak("learner_load").total_bytes == P * 4 / 2 + layer * 6
    assert "reference" not in {part.key for part in lora_kl.learner.parts}
    assert "reference" in {part.key for part in plan(_tiny_config(folder, "algo.kl_beta=0.1"),
                                                     manifests=_manifests(tmp_path / "k2")).learner.parts}


def test_the_stored_dtype_is_read_from_config_json():
    assert ModelSize.from_hf(TINY).stored_dtype == "float32"  # transformers' default when neither key is there
    assert ModelSize.from_hf({**TINY, "torch_dtype": "bfloat16"}).stored_dtype == "bfloat16"
    assert ModelSize.from_hf({**TINY, "dtype": "float16", "torch_dtype": "bfloat16"}).stored_dtype == "float16"


def test_memory_quantities_and_the_group_that_runs_a_slice(tmp_path):
    assert memory_quantity("360Gi") == 360 * GIB
    assert memory_quantity("300G") == 300e9
    assert memory_quantity("512Mi") == 512 * 2**20
    assert memory_quantity(2048) == 2048
    result = plan(_tiny_config(_tiny_folder(tmp_path)), manifests=_manifests(tmp_path, "3Gi", "2Gi"))
    share = result.learner.share
    # Each role's own group where the manifest names one after it; the smallest of every matching group else.
    assert pod_memory_limit(share, tmp_path / "kuberay", "learner") == PodLimit(3 * GIB, "raycluster-tiny.yaml", "learner")
    assert pod_memory_limit(share, tmp_path / "kuberay", "reward") == PodLimit(2 * GIB, "raycluster-tiny.yaml", "rollout")
    assert "no deploy manifests" in pod_memory_limit(share, tmp_path / "none")


def test_oversized_host_peak_is_one_line_naming_it(tmp_path, capsys):
    """An engine host over its pod limit: the tiny rollout host (2 x 18848 + 3 x 3200 bytes) against 40000 bytes,
    and the 70B recipe's with 3 buckets of 50000 MiB in flight against the v5p-16 pods' 400 GiB."""
    folder = _tiny_folder(tmp_path)
    small = plan(_tiny_config(folder, "sync.bucket_mb=0.001"), manifests=_manifests(tmp_path, rollout="40000"))
    engine = small.peak("rollout_host")
    assert engine.fits is False and engine.total_bytes == 2 * 9424 * 2 + 3 * 1600 * 2
    assert engine.over_gib == pytest.approx((engine.total_bytes - 40000) / GIB)
    assert not small.ok and small.learner.fits and small.rollout.fits

    recipe = str(REPO / "configs" / "llama3-70b-v5p.yaml")
    assert main(["plan", recipe, "sync.bucket_mb=50000"]) == 1
    out = capsys.readouterr().out.splitlines()
    arch = load_architecture("/models/Meta-Llama-3-70B")[0]
    over = (2 * arch.params * 2 + 3 * 50000 * 2**20 - 400 * GIB) / GIB
    failing = [line for line in out if "DOES NOT FIT" in line or "NOT OK" in line]
    assert len(failing) == 2 and failing[0].lstrip().startswith("total")  # the engine host's total, and the verdict
    assert f"of 400 GiB pod limit (raycluster-v5p.yaml, group rollout): DOES NOT FIT (over by {over:.2f} GiB)" in failing[0]
    assert out[-1] == f"plan: NOT OK (engine host RAM at a sync over by {over:.2f} GiB)"
    assert out[out.index(failing[0]) - 4].startswith("engine host RAM at a sync, per host (1 engine x tensor-parallel 4)")


# The TPU worker groups a RayJob runs its recipe on: recipe -> {role: pod memory limit in bytes}.
def _rayjob_limits() -> dict[str, dict[str, float]]:
    import re

    import yaml

    limits: dict[str, dict[str, float]] = {}
    for path in sorted(MANIFESTS_DIR.glob("rayjob-*.yaml")):
        job = yaml.safe_load(path.read_text())
        recipe = re.search(r"configs/([A-Za-z0-9_.\-]+\.yaml)", job["spec"]["entrypoint"])[1]
        for group in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
            for container in group["template"]["spec"]["containers"]:
                if "google.com/tpu" in container["resources"]["limits"]:
                    memory = memory_quantity(container["resources"]["limits"]["memory"])
                    limits.setdefault(recipe, {})[group["groupName"]] = memory
    return limits


# Which host peaks of each shipped TPU recipe a deploy manifest gives a pod memory limit for; the others have none
# (the one-VM recipe shares each host between the two roles).
WITH_MANIFEST = {
    "qwen3-0.6b-gsm8k-v5e.yaml": {"learner_host", "rollout_host"},
    "qwen3-0.6b-gsm8k-v6e.yaml": {"learner_host", "rollout_host"},
    "qwen3-0.6b-gsm8k-v6e-8-one-vm.yaml": set(),
    "qwen3-8b-v6e.yaml": {"learner_host", "rollout_host"},
    "llama3-70b-v5p.yaml": {"learner_host", "rollout_host"},
    "qwen3-30b-a3b-v6e.yaml": {"learner_host", "rollout_host"},
}


@pytest.mark.parametrize("recipe", TPU_RECIPES)
def test_every_shipped_tpu_recipe_fits_its_deploy_manifests_pod_memory(recipe, capsys):
    """Each host peak against the TPU worker group of deploy/kuberay that runs its slice, and the load against
    the chip's HBM; where a RayJob runs the recipe, its own groups' limits hold as well."""
    assert set(WITH_MANIFEST) == set(TPU_RECIPES)
    result = plan(load_config(REPO / "configs" / recipe))
    load = result.peak("learner_load")
    assert load.fits, (recipe, load.total_gib)
    assert load.total_bytes < result.learner.total_bytes  # the load is below the step's own peak
    job = _rayjob_limits().get(recipe, {})
    for key in ("learner_host", "rollout_host"):
        peak = result.peak(key)
        if key in WITH_MANIFEST[recipe]:
            assert peak.fits, (recipe, key, peak.total_gib, peak.limit_label)
            role = "learner" if key == "learner_host" else "rollout"
            if role in job:
                assert peak.limit_bytes <= job[role] and peak.total_bytes <= job[role]
        else:
            assert peak.fits is None and peak.missing
            assert f"{peak.name}: {peak.missing}" in result.notes
    assert result.ok
    assert main(["plan", str(REPO / "configs" / recipe)]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out and out.rstrip().endswith("plan: OK")


@pytest.mark.parametrize("recipe", ["qwen3-8b-v6e.yaml", "qwen3-30b-a3b-v6e.yaml", "llama3-70b-v5p.yaml"])
def test_docs_give_the_plans_peaks_of_the_large_recipes(recipe):
    rows = [line for line in (REPO / "docs" / "tpu.md").read_text().splitlines() if line.startswith(f"| `{recipe}`")]
    assert len(rows) == 1, recipe
    result = plan(load_config(REPO / "configs" / recipe))
    load, host, engine = (result.peak(key) for key in ("learner_load", "learner_host", "rollout_host"))
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert cells[1] == f"{load.total_gib:.2f} of {load.limit_bytes / GIB:.2f}"
    assert cells[2].startswith(f"{host.total_gib:.2f} (export)")
    assert cells[3].startswith(f"{engine.total_gib:.2f} (")
    for cell, peak in ((cells[2], host), (cells[3], engine)):
        assert cell.endswith(f"of {peak.limit_bytes / GIB:.0f}") if peak.limit_bytes else "no manifest" in cell
