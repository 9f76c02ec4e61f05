"""Sequence packing in the learner: a micro-batch's sequences run as one row of real tokens (position ids restart
per sequence, attention stays within each; a group's common prompt runs once, its completions reading it), and
everything computed from it equals the padded path."""

from __future__ import annotations

import pytest
import torch

from rlpipe.config import KernelsConfig, load_config
from rlpipe.kernels import linear_logprob
from rlpipe.training.learner import Learner, combine_rank_metrics
from rlpipe.models.packing import bucket_length, pack, packed_length
from rlpipe.training.train_engine import token_logprobs
from rlpipe.models import CausalLM, ModelArchitecture
from rlpipe.models.architecture import FULL_ATTENTION, SLIDING_ATTENTION
from rlpipe.types import TrainBatch

TOLERANCE = 1e-5  # fp32; packing changes only the order of some sums


def _batch(seed: int = 0, rows: int = 4) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 9, (2, rows), generator=generator).tolist()
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in sizes[0]]
    completions = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in sizes[1]]
    logprobs = [(-torch.rand(len(c), generator=generator) - 0.5).tolist() for c in completions]
    advantages = torch.randn(rows, generator=generator).tolist()
    return TrainBatch.from_sequences(prompts, completions, logprobs, advantages, pad_id=0)


def _group_batch(seed: int = 0, groups: int = 2, group_size: int = 3) -> TrainBatch:
    """GRPO-shaped: each group's rows share one prompt (the last row's prompt differs from its group's in the last
    token only, so it must run on its own)."""
    generator = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(groups):
        prompt = torch.randint(3, 300, (int(torch.randint(2, 9, (1,), generator=generator)),), generator=generator)
        for _ in range(group_size):
            prompts.append(prompt.tolist())
            completions.append(torch.randint(3, 300, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator).tolist())
    prompts[-1] = prompts[-1][:-1] + [prompts[-1][-1] % 299 + 1]
    logprobs = [(-torch.rand(len(c), generator=generator) - 0.5).tolist() for c in completions]
    advantages = torch.randn(len(prompts), generator=generator).tolist()
    return TrainBatch.from_sequences(prompts, completions, logprobs, advantages, pad_id=0)


def _prompt_lengths(batch: TrainBatch) -> torch.Tensor:
    return batch.completion_mask.int().argmax(dim=1)


def _model(sliding_window: int | None = None) -> CausalLM:
    torch.manual_seed(0)
    layer_types = (SLIDING_ATTENTION, FULL_ATTENTION) if sliding_window else ()
    config = ModelArchitecture(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        qk_norm=True, sliding_window=sliding_window, layer_types=layer_types, initializer_range=0.1,
    )
    return CausalLM(config)


def test_pack_lays_the_real_tokens_of_each_row_back_to_back():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    packed, positions, segments, where = pack(ids, torch.tensor([3, 2, 4]))
    assert packed.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert segments == ((3,), (2,), (4,))
    assert where.tolist() == [[0, 1, 2, -1], [3, 4, -1, -1], [5, 6, 7, 8]]


def test_pack_runs_a_prompt_that_consecutive_rows_share_once():
    ids = torch.tensor([[5, 6, 7, 1, 0], [5, 6, 8, 9, 2], [5, 6, 3, 0, 0], [5, 7, 3, 0, 0], [4, 4, 4, 4, 0]])
    # Rows 0-2 share the prompt [5, 6]; row 3's differs; row 4 has no completion token (its prompt is all of it).
    packed, positions, segments, where = pack(ids, torch.tensor([4, 5, 3, 3, 4]), torch.tensor([2, 2, 2, 2, 4]))
    assert packed.tolist() == [[5, 6, 7, 1, 8, 9, 2, 3, 5, 7, 3, 4, 4, 4, 4]]
    assert positions.tolist() == [[0, 1, 2, 3, 2, 3, 4, 2, 0, 1, 2, 0, 1, 2, 3]]
    assert segments == ((2, 2, 3, 1), (2, 1), (4,))
    assert where[:3, :2].tolist() == [[0, 1]] * 3  # one copy of the shared prompt
    assert where[1].tolist() == [0, 1, 4, 5, 6] and where[3].tolist() == [8, 9, 10, -1, -1]
    assert (packed[0, where.clamp(min=0)] == ids)[where >= 0].all()


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-window"])
@pytest.mark.parametrize("recompute", [False, True], ids=["", "activation-checkpointing"])
@pytest.mark.parametrize("shared", [False, True], ids=["", "shared-prompts"])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(window, recompute, shared):
    batch = _group_batch() if shared else _batch()
    real = torch.arange(batch.input_ids.shape[1]) < batch.lengths[:, None]
    results = {}
    for packed in (False, True):
        model = _model(window)
        model.model.activation_checkpointing = recompute
        logprobs, entropy = token_logprobs(
            model, batch.input_ids, 0.9, with_entropy=True, kernels=KernelsConfig(),
            lengths=batch.lengths if packed else None,
            prompt_lengths=_prompt_lengths(batch) if packed and shared else None,
        )
        # A loss over the real tokens only, weighted so every position's gradient differs.
        weights = torch.linspace(0.5, 1.5, logprobs.numel()).view(logprobs.shape)
        (logprobs * weights * real).sum().backward()
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        results[packed] = (logprobs.detach(), entropy, grads)
    padded, packed = results[False], results[True]
    torch.testing.assert_close(packed[0][real], padded[0][real], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(packed[1][real], padded[1][real], atol=TOLERANCE, rtol=0)
    assert packed[0][~real].abs().sum() == 0 and packed[0][:, 0].abs().sum() == 0  # padding and first tokens: 0
    for name, grad in padded[2].items():
        torch.testing.assert_close(packed[2][name], grad, atol=TOLERANCE, rtol=1e-4, msg=name)


def test_only_the_scored_tokens_go_through_the_output_projection(monkeypatch):
    import rlpipe.models.packing

    model, batch = _model(), _batch()
    rows = []

    def counting(hidden, *args, **kwargs):
        rows.append(hidden.shape[0])
        return linear_logprob(hidden, *args, **kwargs)

    padded = token_logprobs(model, batch.input_ids)
    monkeypatch.setattr(rlpipe.models.packing, "linear_logprob", counting)
    scored = token_logprobs(model, batch.input_ids, lengths=batch.lengths, scored=batch.completion_mask)
    mask = batch.completion_mask
    assert rows == [int(mask.sum())]  # the completion tokens, not the prompts, not the padding
    torch.testing.assert_close(scored[mask], padded[mask], atol=TOLERANCE, rtol=0)
    assert scored[~mask].abs().sum() == 0
    nothing = token_logprobs(model, batch.input_ids, lengths=batch.lengths, scored=torch.zeros_like(mask))
    assert nothing.abs().sum() == 0 and rows[-1] == 1  # a pass that scores nothing still runs one row


def test_packed_attention_keeps_sequences_apart():
    """Changing one sequence changes no other sequence's log-probs (no attention across the packed row)."""
    model, batch = _model(), _batch()
    before = token_logprobs(model, batch.input_ids, lengths=batch.lengths)
    changed = batch.input_ids.clone()
    changed[0, : int(batch.lengths[0])] = 7
    after = token_logprobs(model, changed, lengths=batch.lengths)
    torch.testing.assert_close(after[1:], before[1:], atol=0, rtol=0)
    assert not torch.allclose(after[0], before[0])


def test_continuations_of_a_shared_prompt_do_not_see_each_other():
    """Changing one completion changes no other row's log-probs; changing the shared prompt changes every row's."""
    model, batch = _model(), _group_batch()
    prompts = _prompt_lengths(batch)
    before = token_logprobs(model, batch.input_ids, lengths=batch.lengths, prompt_lengths=prompts)
    changed = batch.input_ids.clone()
    changed[1, int(prompts[1]) : int(batch.lengths[1])] = 7
    after = token_logprobs(model, changed, lengths=batch.lengths, prompt_lengths=prompts)
    others = torch.arange(len(batch)) != 1
    torch.testing.assert_close(after[others], before[others], atol=0, rtol=0)
    assert not torch.allclose(after[1], before[1])
    changed = batch.input_ids.clone()
    changed[:3, 0] = 7  # the first group's prompt, in every row of the group
    after = token_logprobs(model, changed, lengths=batch.lengths, prompt_lengths=prompts, scored=batch.completion_mask)
    assert all(not torch.allclose(after[row], before[row] * batch.completion_mask[row]) for row in range(3))


def _learner_config(model_path: str, *overrides: str):
    return load_config(None, [
        f"model.path={model_path}", "rollout.group_size=2", "train.prompts_per_step=4", "train.micro_batch_size=4",
        "train.mini_batch_size=4", "train.lr=1e-3", "train.steps=3", "algo.kl_beta=0.1", *overrides,
    ])


def _learner_pair(model_path: str, key: str):
    """Two learners with the boolean config `key` off and on, the weights they start from, and for each the token
    count of every forward of its policy and reference models (recorded at the embedding)."""
    learners = {on: Learner.from_config(model_path, _learner_config(model_path, f"{key}={str(on).lower()}")) for on in (False, True)}
    start = {name: tensor.clone() for name, tensor in learners[True].model.state_dict().items()}
    seen = {on: [] for on in learners}
    for on, learner in learners.items():
        for model in (learner.model, learner.reference):
            model.model.embed_tokens.register_forward_hook(
                lambda module, args, out, tokens=seen[on]: tokens.append(args[0].numel())
            )
    return learners, start, seen


def _train_both_and_compare_metrics(learners, batch) -> None:
    metrics = {on: combine_rank_metrics([learner.train_step(batch)]) for on, learner in learners.items()}
    for key, value in metrics[False].items():
        assert metrics[True][key] == pytest.approx(value, abs=TOLERANCE, rel=1e-4), key


def _assert_same_weights(learners, start) -> None:
    off, on = learners[False].model.state_dict(), learners[True].model.state_dict()
    # Adam turns a gradient's rounding into a step of about lr wherever the gradient is tiny, hence lr 1e-3.
    assert max((tensor - start[name]).abs().max() for name, tensor in on.items()) > 100 * TOLERANCE
    for name, tensor in off.items():
        torch.testing.assert_close(on[name], tensor, atol=TOLERANCE, rtol=1e-4, msg=name)


def test_a_packed_learner_trains_as_the_padded_one_without_computing_padding(tiny_qwen3):
    """Three GRPO updates (two optimizer steps each, old and reference log-probs, KL) packed and padded: same
    metrics and weights; and the packed model sees exactly the batch's real tokens (its output projection only
    the completion tokens)."""
    learners, start, seen = _learner_pair(tiny_qwen3, "learner.packing")
    for step in range(3):
        batch = _batch(seed=step, rows=8)
        _train_both_and_compare_metrics(learners, batch)
        widths = [int(batch.lengths[i : i + 4].max()) for i in (0, 4)]
        # Per update: old log-probs, reference log-probs, then the training forward, each per micro-batch.
        assert seen[True][-6:] == [int(batch.lengths[i : i + 4].sum()) for i in (0, 4)] * 3
        assert seen[False][-6:] == [4 * width for width in widths] * 3
        assert sum(seen[True][-6:]) < sum(seen[False][-6:])
    _assert_same_weights(learners, start)


def test_a_learner_sharing_prompts_trains_as_one_that_does_not(tiny_qwen3):
    """Three GRPO updates on group-shaped batches with learner.share_prompts on and off: same metrics and weights,
    and with it on the model sees each group's prompt once per micro-batch."""
    learners, start, seen = _learner_pair(tiny_qwen3, "learner.share_prompts")
    for step in range(3):
        batch = _group_batch(seed=step, groups=4, group_size=2)
        _train_both_and_compare_metrics(learners, batch)
        prompts = _prompt_lengths(batch).tolist()
        rows = [batch.input_ids[row, : prompts[row]].tolist() for row in range(len(batch))]
        for first in (0, 4):
            micro = range(first, first + 4)
            distinct = sum(prompts[row] for row in micro if row == first or rows[row] != rows[row - 1])
            completions = sum(int(batch.lengths[row]) - prompts[row] for row in micro)
            assert seen[True][-6 + first // 4 :: 2] == [distinct + completions] * 3  # old, reference, training
            assert seen[False][-6 + first // 4 :: 2] == [int(batch.lengths[first : first + 4].sum())] * 3
        assert sum(seen[True][-6:]) < sum(seen[False][-6:])
    _assert_same_weights(learners, start)


@pytest.mark.heavy
def test_the_graph_step_packs_and_shares_prompts_as_the_eager_step_does(tiny_qwen3):
    """The compiled step on packed rows with shared prompts (a static layout padded to a length bucket) against the
    eager packed step: same metrics and weights over five updates of group batches with random lengths, and one
    graph per packed-row bucket met, however the groups and lengths fall."""
    overrides = ("train.adam_eps=1e-4", "learner.length_buckets=[16, 32, 64]", "data.max_prompt_tokens=16",
                 "rollout.max_tokens=16", "algo.kl_beta=0", "train.mini_batch_size=null", "train.prompts_per_step=3",
                 "rollout.group_size=3", "train.micro_batch_size=3", "learner.skip_zero_advantage=false")
    eager = Learner.from_config(tiny_qwen3, _learner_config(tiny_qwen3, *overrides))
    graph = Learner.from_config(tiny_qwen3, _learner_config(tiny_qwen3, *overrides, "learner.graph=true"))
    start = {name: tensor.clone() for name, tensor in eager.model.state_dict().items()}
    shapes = set()
    for step in range(5):
        batch = _group_batch(seed=10 + step, groups=3, group_size=3)
        packed = []
        for first in range(0, 9, 3):
            part = batch.slice(first, first + 3)
            mask = part.completion_mask
            prompts = torch.where(mask.any(1), mask.int().argmax(1), part.lengths)
            packed.append(packed_length(part.input_ids, part.lengths, prompts))
        shapes.add(bucket_length(max(packed), [3 * bucket for bucket in (16, 32, 64)]))
        expected = combine_rank_metrics([eager.train_step(batch)])
        got = combine_rank_metrics([graph.train_step(batch)])
        for key in ("loss", "entropy", "clip_fraction", "grad_norm", "logprob_gap/mean_abs", "train_tokens"):
            assert got[key] == pytest.approx(expected[key], abs=TOLERANCE), (step, key)
    assert got["learner/graph_compiles"] == len(shapes) < 5  # shapes, not batches, decide the compiles
    moved = max((tensor - start[name]).abs().max() for name, tensor in eager.model.state_dict().items())
    assert moved > 100 * TOLERANCE
    for name, tensor in eager.model.state_dict().items():
        torch.testing.assert_close(graph.model.state_dict()[name], tensor, atol=TOLERANCE, rtol=1e-4, msg=name)


@pytest.mark.heavy
def test_a_graph_step_on_fewer_samples_runs_empty_passes_instead_of_compiling_again(tiny_qwen3):
    """Uniform groups dropped make a step's batch smaller; the captured step pads it with empty micro-batch passes,
    so it keeps its one graph, and the update equals the eager one."""
    overrides = ("train.adam_eps=1e-4", "learner.length_buckets=[16]", "data.max_prompt_tokens=8",
                 "rollout.max_tokens=8", "algo.kl_beta=0", "train.mini_batch_size=null", "train.prompts_per_step=3",
                 "rollout.group_size=3", "train.micro_batch_size=3", "learner.skip_zero_advantage=false")
    eager = Learner.from_config(tiny_qwen3, _learner_config(tiny_qwen3, *overrides))
    graph = Learner.from_config(tiny_qwen3, _learner_config(tiny_qwen3, *overrides, "learner.graph=true"))
    for groups in (3, 2, 1):
        batch = _group_batch(seed=groups, groups=groups, group_size=3)
        expected = combine_rank_metrics([eager.train_step(batch)])
        got = combine_rank_metrics([graph.train_step(batch)])
        for key in ("loss", "grad_norm", "train_tokens"):
            assert got[key] == pytest.approx(expected[key], abs=TOLERANCE), (groups, key)
    assert got["learner/graph_compiles"] == 1
    for name, tensor in eager.model.state_dict().items():
        torch.testing.assert_close(graph.model.state_dict()[name], tensor, atol=TOLERANCE, rtol=1e-4, msg=name)
