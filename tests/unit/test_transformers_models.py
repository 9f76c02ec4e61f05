"""The transformers-backed learner (model.impl, rlpipe/models/transformers_lm.py): for rlpipe's own families it gives
rlpipe's decoder's log-probs and updates; families rlpipe does not implement load from their folders on `meta` with
the checkpoint's names, give transformers' own log-probs, keep packed sequences apart, and train; what only rlpipe's
decoder offers is refused in one line before anything starts."""

from __future__ import annotations

import pytest
import torch

from rlpipe.bench.tiny_model import build_tiny_model
from rlpipe.config import ConfigError, load_config
from rlpipe.models.hf import CheckpointWeights, check_weights, meta_model, stored_tensors
from rlpipe.models.packing import packed_token_logprobs
from rlpipe.models.registry import implementation, model_architecture
from rlpipe.startup.preflight import check_model_impl
from rlpipe.training.forward import padded_token_logprobs
from rlpipe.training.learner import Learner, combine_rank_metrics
from tests.unit.test_packing import _batch

TOLERANCE = 1e-5  # float32: the two codes differ in the order of a few sums
NEW_FAMILIES = ["gemma3_text", "olmo2", "phi3", "glm4", "granite", "smollm3"]
LENGTHS = torch.tensor([20, 12, 7])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return {family: build_tiny_model(tmp_path_factory.mktemp(family), family)
            for family in ["llama", "qwen3", *NEW_FAMILIES]}


def _loaded(path: str, impl: str = "auto"):
    model = meta_model(path, impl)
    CheckpointWeights(path, model).load_into(model, "cpu")
    return model


def _ids() -> torch.Tensor:
    return torch.randint(5, 300, (3, 20), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_own_family_through_transformers_gives_rlpipes_log_probs(folders, family):
    own, theirs = _loaded(folders[family], "rlpipe"), _loaded(folders[family], "transformers")
    assert (own.architecture.implementation, theirs.architecture.implementation) == ("rlpipe", "transformers")
    assert type(theirs).__module__.startswith("transformers.models.")
    assert own.state_dict().keys() == theirs.state_dict().keys()  # the checkpoint's names on both paths
    ids = _ids()
    torch.testing.assert_close(padded_token_logprobs(theirs, ids), padded_token_logprobs(own, ids), atol=TOLERANCE,
                               rtol=0)
    torch.testing.assert_close(packed_token_logprobs(theirs, ids, LENGTHS), packed_token_logprobs(own, ids, LENGTHS),
                               atol=TOLERANCE, rtol=0)


def _cfg(path: str, *extra: str):
    return load_config(None, [f"model.path={path}", "train.micro_batch_size=2", "train.lr=1e-2", "rollout.group_size=2",
                              "train.prompts_per_step=2", *extra])


def _trained(path: str, impl: str, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    learner = Learner.from_config(path, _cfg(path, f"model.impl={impl}"))
    losses = [combine_rank_metrics([learner.train_step(_batch(seed))])["loss"] for seed in range(steps)]
    return losses, {name: value.detach().clone() for name, value in learner.model.state_dict().items()}


def test_three_learner_steps_through_transformers_equal_rlpipes(folders):
    own_losses, own_weights = _trained(folders["qwen3"], "rlpipe")
    their_losses, their_weights = _trained(folders["qwen3"], "transformers")
    assert own_losses == pytest.approx(their_losses, abs=TOLERANCE)
    assert own_weights.keys() == their_weights.keys()
    # Adam divides each gradient by its own scale, so where a gradient is near 0 a last-bit difference between the
    # two codes can move a weight by up to the learning rate: the updates are compared as wholes, tensor by tensor.
    start = _loaded(folders["qwen3"]).state_dict()
    for name, value in own_weights.items():
        own_update, their_update = value - start[name], their_weights[name] - start[name]
        assert own_update.norm() > 0, name
        assert (own_update - their_update).norm() <= 0.01 * own_update.norm(), name


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_a_family_rlpipe_does_not_implement_runs_on_transformers_code(folders, family):
    from transformers import AutoModelForCausalLM

    path = folders[family]
    model = meta_model(path)  # auto
    assert model.architecture.implementation == "transformers" and not model.architecture.num_experts
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert all(buffer.device.type == "cpu" for buffer in model.buffers())  # computed tables, never stored
    # The checkpoint's names, a tied output projection under its one stored name.
    assert model.state_dict().keys() == stored_tensors(path).keys()
    assert check_weights(path).keys() == stored_tensors(path).keys()
    model = _loaded(path)
    if model.architecture.tie_word_embeddings:
        assert model.output_embedding() is model.get_input_embeddings().weight
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ids = _ids()
    logits = reference(ids).logits
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(padded_token_logprobs(model, ids)[:, 1:], expected, atol=TOLERANCE, rtol=0)
    # Packed: each sequence attends only to itself, as if run alone.
    packed = packed_token_logprobs(model, ids, LENGTHS)
    for row, length in enumerate(LENGTHS.tolist()):
        alone = padded_token_logprobs(model, ids[row : row + 1, :length])[0]
        torch.testing.assert_close(packed[row, :length], alone, atol=TOLERANCE, rtol=0)
        assert not packed[row, length:].any()


def test_a_new_family_trains_and_activation_checkpointing_changes_no_number(folders):
    losses, weights = _trained(folders["olmo2"], "auto")
    path = folders["olmo2"]
    learner = Learner.from_config(path, _cfg(path, "learner.activation_checkpointing=true"))
    assert learner.model.is_gradient_checkpointing
    checkpointed = [combine_rank_metrics([learner.train_step(_batch(seed))])["loss"] for seed in range(3)]
    assert checkpointed == pytest.approx(losses, abs=TOLERANCE)
    start = _loaded(path).state_dict()
    assert any(not torch.equal(value, start[name]) for name, value in weights.items())


@pytest.mark.parametrize("overrides, refusal", [
    (["model.impl=rlpipe"], "model.impl: rlpipe has no model code for model_type 'olmo2'"),
    (["learner.graph=true"], "learner.graph: model_type 'olmo2' runs on transformers' code (model.impl auto): the "
                             "captured step"),
    (["model.kernels.attention=pallas"], "model.kernels.attention: model_type 'olmo2' runs on transformers' code"),
    (["rollout.model_impl=rlpipe"], "rollout.model_impl: model_type 'olmo2' runs on transformers' code"),
    (["learner.device=xla"], "learner.device: model_type 'olmo2' runs on transformers' code"),
])
def test_what_only_rlpipes_decoder_offers_is_refused_in_one_line(folders, overrides, refusal):
    cfg = load_config(None, [f"model.path={folders['olmo2']}", *overrides])
    with pytest.raises(ConfigError) as refused:
        check_model_impl(cfg, folders["olmo2"], check_weights(folders["olmo2"]))
    assert str(refused.value).startswith(refusal) and "\n" not in str(refused.value)
    check_model_impl(load_config(None, [f"model.path={folders['olmo2']}"]), folders["olmo2"],
                     check_weights(folders["olmo2"]))


@pytest.mark.parametrize("config, refusal", [
    ({"model_type": "no_such_family", "vocab_size": 8}, "unsupported model_type 'no_such_family': neither rlpipe"),
    ({"model_type": "mixtral"}, "model_type 'mixtral': a mixture of experts (8 experts) runs only on rlpipe's"),
    ({"model_type": "gemma2"}, "model_type 'gemma2': its final_logit_softcapping (30.0) changes the logits"),
    ({"model_type": "granite", "logits_scaling": 8.0}, "model_type 'granite': its logits_scaling (8.0)"),
    ({"model_type": "t5"}, "model_type 't5' is not a decoder-only text model"),
])
def test_a_family_the_learner_cannot_train_through_transformers_is_named_with_why(config, refusal):
    with pytest.raises(ValueError) as refused:
        model_architecture(config)
    assert str(refused.value).startswith(refusal) and "\n" not in str(refused.value)


def test_the_implementation_follows_model_impl():
    assert implementation({"model_type": "qwen3"}) == "rlpipe"
    assert implementation({"model_type": "qwen3"}, "transformers") == "transformers"
    assert implementation({"model_type": "olmo2"}) == "transformers"
    with pytest.raises(ValueError, match="model.impl: rlpipe has no model code for model_type 'olmo2'"):
        implementation({"model_type": "olmo2"}, "rlpipe")
    with pytest.raises(ValueError, match="a mixture of experts runs on rlpipe's own model code only"):
        from rlpipe.models.registry import build_model

        with torch.device("meta"):
            build_model({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                         "num_hidden_layers": 1, "num_attention_heads": 2, "num_experts": 4,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 8}, "transformers")


def test_lora_on_a_new_family_trains_the_adapters_alone_and_exports_what_peft_loads(folders, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from rlpipe.training.lora import is_adapter_key
    from rlpipe.weightsync.form import weight_form

    path = folders["olmo2"]
    cfg = _cfg(path, "learner.lora.rank=2", "learner.lora.alpha=4")
    learner = Learner.from_config(path, cfg, form=weight_form(cfg, path))
    adapters = {name: p for name, p in learner.model.named_parameters() if is_adapter_key(name)}
    modules = {name.rpartition(".lora_")[0].split(".")[-1] for name in adapters}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    start = _loaded(path).state_dict()
    for seed in range(3):
        learner.train_step(_batch(seed))
    for name, param in learner.model.named_parameters():
        if not is_adapter_key(name):
            assert not param.requires_grad and torch.equal(param, start[name]), name  # the base never moves
    assert all(torch.count_nonzero(p) for p in adapters.values())  # every adapter trained (B left zero)
    folder = tmp_path / "adapter"
    learner.export(str(folder))
    ids = _ids()
    with torch.no_grad():
        model = learner.model
        ours = torch.nn.functional.linear(model.hidden_states(ids), model.output_embedding())
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        theirs = peft.PeftModel.from_pretrained(base, str(folder)).eval()(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def test_the_kl_reference_of_a_new_family_is_a_frozen_copy_of_its_start(folders):
    path = folders["olmo2"]
    learner = Learner.from_config(path, _cfg(path, "algo.kl_beta=0.1"))
    assert learner.reference is not learner.model and type(learner.reference) is type(learner.model)
    kl = [combine_rank_metrics([learner.train_step(_batch(seed))])["kl"] for seed in range(3)]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[1] > 0 and kl[2] > 0  # the policy moves away from it
    start = _loaded(path).state_dict()
    assert all(torch.equal(value, start[name]) for name, value in learner.reference.state_dict().items())


def test_a_family_either_side_cannot_take_is_refused_naming_that_side(tmp_path):
    # XGLM names its width d_model (read through transformers' config), but transformers runs it without SDPA.
    xglm = build_tiny_model(tmp_path / "xglm", "xglm")
    with pytest.raises(ValueError) as refused:
        check_weights(xglm)
    assert str(refused.value).startswith("transformers cannot build model_type 'xglm' for the learner "
                                         "(XGLMForCausalLM does not support an attention")
    # BioGPT's learner runs, but its weights lie under biogpt., which vLLM's model holds under other names.
    biogpt = build_tiny_model(tmp_path / "biogpt", "biogpt")
    weights = check_weights(biogpt)
    assert weights
    with pytest.raises(ConfigError) as refused:
        check_model_impl(load_config(None, [f"model.path={biogpt}"]), biogpt, weights)
    assert str(refused.value) == ("model.path: model_type 'biogpt' runs on transformers' code (model.impl auto): its "
                                  "weights lie under biogpt., which vLLM's engine holds under other names; the weight "
                                  "sync maps only model. and lm_head.")
