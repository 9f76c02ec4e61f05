"""The learner rank without Ray: log-probs, the update, micro-batching, schedules, weights for sync."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.config import load_config
from rlpipe.run.controller import make_train_batch
from rlpipe.training.learner import Learner, combine_rank_metrics
from rlpipe.training.train_engine import lr_factor, token_logprobs
from rlpipe.types import Completion, Group, Prompt, TrainBatch
from tests.batches import four_samples as _batch


def _config(model_path, *overrides):
    return load_config(
        None,
        [
            f"model.path={model_path}",
            "rollout.group_size=2",
            "train.prompts_per_step=2",
            "train.micro_batch_size=4",
            "train.lr=1e-2",
            "train.steps=4",
            *overrides,
        ],
    )


def _step(learner: Learner, batch: TrainBatch) -> dict[str, float]:
    return combine_rank_metrics([learner.train_step(batch)])


def test_token_logprobs_match_a_direct_computation(tiny_qwen3):
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3))
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    got = token_logprobs(learner.model, ids)
    logits = learner.model(ids)[0]
    expected = [0.0] + [torch.log_softmax(logits[t - 1], -1)[ids[0, t]].item() for t in range(1, 5)]
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert learner.engine.sequence_logprobs(ids[0].tolist()) == pytest.approx(expected, abs=1e-6)


def test_train_batch_aligns_tokens_masks_and_logprobs():
    batch = TrainBatch.from_sequences([[1, 2], [3]], [[4, 5, 6], [7]], [[-0.1, -0.2, -0.3], [-0.4]], [1.0, -1.0], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 4, 5, 6], [3, 7, 0, 0, 0]]
    assert batch.completion_mask.tolist() == [[False, False, True, True, True], [False, True, False, False, False]]
    assert batch.rollout_logprobs[0, 2:].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch.slice(1, 2).input_ids.tolist() == [[3, 7]]  # trimmed to its own length


def test_micro_batching_gives_the_same_update_as_one_batch(tiny_qwen3):
    # With adam_eps 1 the first AdamW step is about lr x gradient (g / (|g| + 1)), so updated weights compare
    # gradients: with the default eps, Adam's normalisation turns float noise in a near-zero gradient into a
    # full-size step of either sign.
    results = []
    for micro in (4, 2, 1):
        learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, f"train.micro_batch_size={micro}", "train.adam_eps=1"))
        metrics = _step(learner, _batch())
        results.append((metrics, learner.model.state_dict()))
    (base_metrics, updated), others = results[0], results[1:]
    for metrics, weights in others:
        assert metrics["loss"] == pytest.approx(base_metrics["loss"], abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(base_metrics["grad_norm"], rel=1e-5)
        for name, tensor in updated.items():
            torch.testing.assert_close(weights[name], tensor, atol=1e-8, rtol=0)
    start = Learner.from_config(tiny_qwen3, _config(tiny_qwen3)).model.state_dict()
    assert any(not torch.equal(start[k], updated[k]) for k in updated)  # the update did change the weights


def test_mini_batches_take_several_optimizer_steps(tiny_qwen3):
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "train.mini_batch_size=2", "train.micro_batch_size=1"))
    assert learner.optimizer_steps_per_batch == 2
    metrics = _step(learner, _batch())
    assert learner.engine.optimizer_steps_taken == 2
    assert learner.policy_version == 1
    # After the first optimizer step the policy differs from the one that produced old_logprobs.
    assert metrics["clip_fraction"] >= 0.0 and math.isfinite(metrics["loss"])


@pytest.mark.heavy
def test_num_iterations_passes_over_the_batch_again_against_the_policy_that_generated_it(tiny_qwen3):
    """Two passes over a batch are the two mini-batches of the batch given twice: both take their ratio against
    the log-probs computed before the first update."""
    twice = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "train.num_iterations=2", "train.adam_eps=1"))
    metrics = _step(twice, _batch())
    assert twice.engine.optimizer_steps_taken == 2 and twice.policy_version == 1
    assert twice.engine.total_steps == 2 * 4  # the schedule spans every pass
    doubled = Learner.from_config(tiny_qwen3, _config(
        tiny_qwen3, "train.prompts_per_step=4", "train.mini_batch_size=4", "train.adam_eps=1"))
    expected = _step(doubled, _batch().take(torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])))
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(expected["clip_fraction"])
    once = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "train.adam_eps=1"))
    _step(once, _batch())
    for name, tensor in twice.model.state_dict().items():
        torch.testing.assert_close(tensor, doubled.model.state_dict()[name], atol=1e-7, rtol=0)
    assert any(not torch.equal(tensor, once.model.state_dict()[name]) for name, tensor in twice.model.state_dict().items())


def test_reference_model_only_with_a_kl_term(tiny_qwen3):
    assert Learner.from_config(tiny_qwen3, _config(tiny_qwen3)).reference is None
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "algo.kl_beta=0.1"))
    assert learner.reference is not None
    metrics = _step(learner, _batch())
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # first step: policy equals reference
    second = _step(learner, _batch(seed=1))
    assert second["kl"] > 0


def test_logprob_gap_is_measured_against_the_rollout(tiny_qwen3):
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3))
    batch = _batch()
    exact = learner.engine.logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.completion_mask, exact, torch.zeros_like(exact))
    metrics = _step(learner, batch)
    assert metrics["logprob_gap/max_abs"] < 1e-5
    batch.rollout_logprobs = torch.where(batch.completion_mask, exact + 0.5, torch.zeros_like(exact))
    learner2 = Learner.from_config(tiny_qwen3, _config(tiny_qwen3))
    assert _step(learner2, batch)["logprob_gap/mean_abs"] == pytest.approx(0.5, abs=1e-4)


@pytest.mark.heavy
def test_masked_importance_sampling_drops_the_tokens_the_rollout_disagrees_on(tiny_qwen3):
    batch = _batch()
    overrides = ["algo.tis_cap=null", "algo.mis_threshold=3"]
    dropping = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *overrides))
    exact = dropping.engine.logprobs(batch)
    # The engine is far off (ratio e^2 > 3) on the first two sequences only.
    shift = torch.zeros_like(exact)
    shift[:2] = 2.0
    batch.rollout_logprobs = torch.where(batch.completion_mask, exact - shift, torch.zeros_like(exact))
    metrics = _step(dropping, batch)
    completion_tokens = batch.completion_mask.sum(-1)
    expected = float(completion_tokens[:2].sum() / completion_tokens.sum())
    assert metrics["mis/dropped_fraction"] == pytest.approx(expected)
    # Dropping them equals training on the other two sequences alone (same token normalisation).
    alone = _batch()
    alone.advantages[:2] = 0.0
    # Both run all four rows, so float noise from a different batching cannot reach Adam's steps.
    reference = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "algo.tis_cap=null", "learner.skip_zero_advantage=false"))
    _step(reference, alone)
    for (name, got), want in zip(dropping.model.named_parameters(), reference.model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert "mis/dropped_fraction" not in _step(Learner.from_config(tiny_qwen3, _config(tiny_qwen3)), batch)


def test_samples_with_zero_advantage_are_not_run_and_the_update_is_the_same(tiny_qwen3):
    # Two optimizer steps a batch: the first mini-batch keeps one row of two, the second none (AdamW still steps,
    # on zero gradients, with the momentum of the first); then a batch where every advantage is 0.
    overrides = ("train.mini_batch_size=2", "train.micro_batch_size=1", "train.weight_decay=0.1")
    skipping = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *overrides))
    running = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *overrides, "learner.skip_zero_advantage=false"))
    assert skipping.skip_zero_advantage and not running.skip_zero_advantage
    first, second = _batch(0), _batch(1)
    first.advantages[1:] = 0.0
    second.advantages[:] = 0.0
    start = {name: p.detach().clone() for name, p in skipping.model.named_parameters()}
    for batch, rows in ((first, 1), (second, 0)):
        got, expected = _step(skipping, batch), _step(running, batch)
        assert got["learner/samples_run"] == rows and expected["learner/samples_run"] == 4
        assert got["train_tokens"] == batch.completion_mask[:rows].sum()
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-7)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], abs=1e-7)
        for (name, param), other in zip(skipping.model.named_parameters(), running.model.parameters()):
            torch.testing.assert_close(param, other, rtol=1e-6, atol=1e-7, msg=name)
    assert "entropy" not in got and "logprob_gap/mean_abs" not in got  # nothing ran to average over
    assert all(not torch.equal(start[name], p) for name, p in skipping.model.named_parameters())
    # A KL term gives every sample a gradient: nothing is skipped then.
    assert not Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "algo.kl_beta=0.1")).skip_zero_advantage


def test_weight_sync_reads_whole_tensors_when_unsharded(tiny_qwen3):
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3))
    state = learner.model.state_dict()
    assert learner.weight_shapes() == {name: tuple(t.shape) for name, t in state.items()}
    local = learner.local_weights()
    assert list(local) == list(state)
    assert all(local[name] is state[name] or torch.equal(local[name], state[name]) for name in state)


def test_lr_schedule():
    assert [lr_factor(s, 2, 10, "constant", 0.1) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(2, 2, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(6, 2, 10, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_factor(10, 2, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert [lr_factor(s, 2, 10, "linear", 0.1) for s in (0, 1, 2, 6, 9, 10, 11)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.5, 0.125, 0.0, 0.0])


def _groups(rewards: list[list[float | None]]) -> list[Group]:
    groups = []
    for index, values in enumerate(rewards):
        prompt = Prompt(index, "q", [1, 2, 3])
        completions = [Completion([4 + i, 5], [-0.5, -0.5], "x", "stop", 0) for i in range(len(values))]
        groups.append(Group(prompt, completions, rewards=list(values)))
    return groups


def test_train_batch_leaves_out_unscored_samples_and_optionally_uniform_groups(tiny_qwen3):
    cfg = _config(tiny_qwen3, "rollout.group_size=3", "train.micro_batch_size=3")
    batch, stats = make_train_batch(_groups([[1.0, 0.0, None], [1.0, 1.0, 1.0]]), cfg, pad_id=0)
    assert len(batch) == 5 and stats["samples_trained"] == 5
    # Two scored samples, 1 and 0: +-0.5 over the unbiased std, sqrt(0.5) (the population std, 0.5, gives +-1).
    assert batch.advantages.tolist()[:2] == pytest.approx([0.5 ** 0.5, -(0.5 ** 0.5)], abs=1e-4)
    cfg = _config(tiny_qwen3, "rollout.group_size=3", "train.micro_batch_size=3", "algo.drop_uniform_groups=true")
    batch, stats = make_train_batch(_groups([[1.0, 0.0, None], [1.0, 1.0, 1.0]]), cfg, pad_id=0)
    assert len(batch) == 2
    batch, stats = make_train_batch(_groups([[None, None, None], [1.0, 1.0, 1.0]]), cfg, pad_id=0)
    assert batch is None and stats["samples_trained"] == 0


@pytest.mark.heavy
def test_graph_step_equals_eager_step(tiny_qwen3):
    # eps well above float noise: Adam divides by sqrt(v) + eps, so with the default 1e-8 a near-zero gradient's
    # last-bit difference between compiled and eager kernels becomes a full-size step.
    overrides = ("train.adam_eps=1e-4", "algo.kl_beta=0.05", "learner.length_buckets=[16, 32]",
                 "data.max_prompt_tokens=16", "rollout.max_tokens=16")
    eager = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *overrides))
    graph = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *overrides, "learner.graph=true"))
    for seed in range(3):
        expected, got = _step(eager, _batch(seed)), _step(graph, _batch(seed))
        for key in ("loss", "kl", "entropy", "clip_fraction", "grad_norm", "logprob_gap/mean_abs", "lr"):
            assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    assert got["learner/graph_compiles"] == 1  # three steps, one bucket, one graph
    for name, tensor in eager.model.state_dict().items():
        torch.testing.assert_close(graph.model.state_dict()[name], tensor, atol=1e-5, rtol=0)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.heavy
def test_activation_checkpointing_changes_no_numbers(tiny_qwen3, graph):
    """Re-running each layer in backward gives the same losses and weights as keeping its activations."""
    overrides = ("train.adam_eps=1e-4", "algo.kl_beta=0.05", "learner.length_buckets=[16]", "data.max_prompt_tokens=8",
                 "rollout.max_tokens=8", f"learner.graph={str(graph).lower()}")
    plain = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *overrides))
    recomputed = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *overrides, "learner.activation_checkpointing=true"))
    assert recomputed.model.model.activation_checkpointing and not plain.model.model.activation_checkpointing
    assert not recomputed.reference.model.activation_checkpointing  # frozen, run without grad
    for seed in range(3):
        expected, got = _step(plain, _batch(seed)), _step(recomputed, _batch(seed))
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert got[key] == pytest.approx(expected[key], abs=1e-6), (seed, key)
    for name, tensor in plain.model.state_dict().items():
        torch.testing.assert_close(recomputed.model.state_dict()[name], tensor, atol=1e-6, rtol=0)


def _expected_expert_load(model, batch: TrainBatch) -> torch.Tensor:
    """Routed copies per (MoE layer, expert) over the completion tokens, from one unpacked forward per row."""
    top_k = model.config.experts_per_token
    load = torch.zeros(len(model.config.moe_layers), model.config.num_experts)
    with torch.no_grad():
        for row in range(len(batch)):
            length = int(batch.lengths[row])
            router_logits = []
            model.hidden_states(batch.input_ids[row : row + 1, :length], router_logits=router_logits)
            completion = batch.completion_mask[row, :length]
            for layer, logits in enumerate(router_logits):
                for expert in logits[completion].topk(top_k, dim=-1).indices.flatten().tolist():
                    load[layer, expert] += 1
    return load


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_router_metrics_report_the_expert_load_of_the_completion_tokens(tiny_qwen3_moe, packing):
    learner = Learner.from_config(tiny_qwen3_moe, _config(tiny_qwen3_moe, f"learner.packing={str(packing).lower()}"))
    batch = _batch()
    load = _expected_expert_load(learner.model, batch)  # before the step: the step's forward sees these weights
    metrics = _step(learner, batch)
    share = load / load.mean(dim=1, keepdim=True)
    p = load / load.sum(dim=1, keepdim=True)
    entropy = (-(p * p.clamp_min(1e-30).log()).sum(dim=1) / math.log(load.shape[1])).mean()
    assert metrics["moe/expert_load_min"] == pytest.approx(share.min().item(), abs=1e-6)
    assert metrics["moe/expert_load_max"] == pytest.approx(share.max().item(), abs=1e-6)
    assert metrics["moe/expert_load_entropy"] == pytest.approx(entropy.item(), abs=1e-6)
    assert share.max() > share.min()  # an unbalanced load, so min and max are not trivially 1
    assert metrics["moe/aux_loss"] > 0


def test_dense_models_report_no_router_metrics(tiny_qwen3):
    metrics = _step(Learner.from_config(tiny_qwen3, _config(tiny_qwen3)), _batch())
    assert not any(key.startswith("moe/") for key in metrics)


def test_router_aux_loss_is_added_with_its_coefficient(tiny_qwen3_moe):
    plain = Learner.from_config(tiny_qwen3_moe, _config(tiny_qwen3_moe))
    assert plain.objective.terms[-1].coef == 0.0  # the tiny config does not set output_router_logits
    balanced = Learner.from_config(tiny_qwen3_moe, _config(tiny_qwen3_moe, "algo.router_aux_loss_coef=0.5"))
    without, with_aux = _step(plain, _batch()), _step(balanced, _batch())
    assert with_aux["moe/aux_loss"] == pytest.approx(without["moe/aux_loss"], abs=1e-6)
    assert with_aux["loss"] - without["loss"] == pytest.approx(0.5 * without["moe/aux_loss"], abs=1e-5)
    router = "model.layers.0.mlp.gate.weight"
    moved = (balanced.model.state_dict()[router] - plain.model.state_dict()[router]).abs().max()
    assert moved > 1e-4  # the loss reaches the router's weights


def test_a_rank_of_several_must_join_its_group_before_it_trains(tiny_qwen3):
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "learner.ranks=2"), rank=0, world_size=2)
    with pytest.raises(RuntimeError, match="must join its group first"):
        learner.train_step(_batch())


def _torch_globals(obj) -> set[str]:
    """The torch classes and functions a pickle of `obj` would name (what unpickling imports from torch)."""
    import pickle
    import pickletools

    found, strings = set(), []
    for op, arg, _ in pickletools.genops(pickle.dumps(obj, protocol=5)):
        if isinstance(arg, str):
            strings.append(arg)
        if op.name == "GLOBAL":
            module, name = arg.split(" ", 1)
        elif op.name == "STACK_GLOBAL":
            module, name = strings[-2:]
        else:
            continue
        if module == "torch" or module.startswith("torch."):
            found.add(f"{module}.{name}")
    return found


def test_what_crosses_to_and_from_a_learner_names_no_torch_object(tiny_qwen3):
    """A learner may run under another torch version than the driver and the engines (placement.learner.python):
    the batch it is sent and everything it sends back pickles to numpy and plain Python values."""
    import pickle

    from rlpipe.weightsync import plan_sync
    from rlpipe.weightsync.layout import EngineLayout
    from rlpipe.models import read_hf_config

    assert _torch_globals(torch.ones(2)) and _torch_globals(torch.float32)  # the check sees torch objects
    batch = _batch()
    assert not _torch_globals(batch)
    back = pickle.loads(pickle.dumps(batch))
    for name in ("input_ids", "completion_mask", "rollout_logprobs", "advantages", "lengths"):
        assert torch.equal(getattr(back, name), getattr(batch, name)) and getattr(back, name).dtype == getattr(batch, name).dtype
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3))
    shapes = learner.weight_shapes()
    layout = EngineLayout.from_hf_config(read_hf_config(tiny_qwen3), 1, "float32")
    for sent_back in (learner.train_step(batch), shapes, learner.probe_reference([5, 9, 17], by_decoding=False), plan_sync(shapes, 1, layout, 2**16)):
        assert not _torch_globals(sent_back)
