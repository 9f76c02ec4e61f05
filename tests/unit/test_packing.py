"""Sequence packing in the learner: a micro-batch's sequences run as one row of real tokens (position ids restart
per sequence, attention stays within each), and everything computed from it equals the padded path."""

from __future__ import annotations

import pytest
import torch

from rlpipe.config import KernelsConfig, load_config
from rlpipe.kernels import linear_logprob
from rlpipe.learner import Learner, combine_rank_metrics, pack, token_logprobs
from rlpipe.models import CausalLM, ModelConfig
from rlpipe.models.llama import FULL_ATTENTION, SLIDING_ATTENTION
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


def _model(sliding_window: int | None = None) -> CausalLM:
    torch.manual_seed(0)
    layer_types = (SLIDING_ATTENTION, FULL_ATTENTION) if sliding_window else ()
    config = ModelConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        qk_norm=True, sliding_window=sliding_window, layer_types=layer_types, initializer_range=0.1,
    )
    return CausalLM(config)


def test_pack_lays_the_real_tokens_of_each_row_back_to_back():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    packed, positions, segments, real = pack(ids, torch.tensor([3, 2, 4]))
    assert packed.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert segments == (3, 2, 4)
    assert real.sum() == 9 and not real[0, 3] and not real[1, 2:].any()


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-window"])
@pytest.mark.parametrize("recompute", [False, True], ids=["", "activation-checkpointing"])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(window, recompute):
    batch = _batch()
    real = torch.arange(batch.input_ids.shape[1]) < batch.lengths[:, None]
    results = {}
    for packed in (False, True):
        model = _model(window)
        model.model.activation_checkpointing = recompute
        logprobs, entropy = token_logprobs(
            model, batch.input_ids, 0.9, with_entropy=True, kernels=KernelsConfig(),
            lengths=batch.lengths if packed else None,
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
    import rlpipe.learner

    model, batch = _model(), _batch()
    rows = []

    def counting(hidden, *args, **kwargs):
        rows.append(hidden.shape[0])
        return linear_logprob(hidden, *args, **kwargs)

    padded = token_logprobs(model, batch.input_ids)
    monkeypatch.setattr(rlpipe.learner, "linear_logprob", counting)
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


def _learner_config(model_path: str, *overrides: str):
    return load_config(None, [
        f"model.path={model_path}", "rollout.group_size=2", "train.prompts_per_step=4", "train.micro_batch_size=4",
        "train.mini_batch_size=4", "train.lr=1e-3", "train.steps=3", "algo.kl_beta=0.1", *overrides,
    ])


def test_a_packed_learner_trains_as_the_padded_one_without_computing_padding(tiny_qwen3):
    """Three GRPO updates (two optimizer steps each, old and reference log-probs, KL) packed and padded: same
    metrics and weights; and the packed model sees exactly the batch's real tokens (its output projection only
    the completion tokens)."""
    learners = {
        packing: Learner(tiny_qwen3, _learner_config(tiny_qwen3, f"learner.packing={str(packing).lower()}"))
        for packing in (False, True)
    }
    start = {name: tensor.clone() for name, tensor in learners[True].model.state_dict().items()}
    seen = {packing: [] for packing in learners}
    for packing, learner in learners.items():
        for model in (learner.model, learner.reference):
            model.model.embed_tokens.register_forward_hook(
                lambda module, args, out, tokens=seen[packing]: tokens.append(args[0].numel())
            )
    for step in range(3):
        batch = _batch(seed=step, rows=8)
        metrics = {packing: combine_rank_metrics([learner.train_step(batch)]) for packing, learner in learners.items()}
        for key, value in metrics[False].items():
            assert metrics[True][key] == pytest.approx(value, abs=TOLERANCE, rel=1e-4), key
        widths = [int(batch.lengths[i : i + 4].max()) for i in (0, 4)]
        # Per update: old log-probs, reference log-probs, then the training forward, each per micro-batch.
        assert seen[True][-6:] == [int(batch.lengths[i : i + 4].sum()) for i in (0, 4)] * 3
        assert seen[False][-6:] == [4 * width for width in widths] * 3
        assert sum(seen[True][-6:]) < sum(seen[False][-6:])
    padded, packed = learners[False].model.state_dict(), learners[True].model.state_dict()
    # Adam turns a gradient's rounding into a step of about lr wherever the gradient is tiny, hence lr 1e-3.
    assert max((tensor - start[name]).abs().max() for name, tensor in packed.items()) > 100 * TOLERANCE
    for name, tensor in padded.items():
        torch.testing.assert_close(packed[name], tensor, atol=TOLERANCE, rtol=1e-4, msg=name)
