"""The Graph Trainer: functional AdamW against torch's, the compiled step against the eager one, bounded recompiles.

Compilation dominates this file's runtime (tens of seconds per graph on a small CPU, a few seconds once inductor's
FX graph cache is warm), so the model is tiny and every trainer uses the same hyperparameters and batch size:
graphs that match one compiled earlier (here or in a previous run) come from the cache.
"""

import copy

import pytest
import torch

from rlpipe.models import build_model
from rlpipe.models.packing import bucket_length
from rlpipe.parallel.graph_trainer import FunctionalAdamW, GraphTrainStep
from rlpipe.types import LossStats

TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    # Larger than HF's 0.02 so gradients, and the differences a wrong update would make, are not tiny.
    initializer_range=0.1,
)
BUCKETS = [8, 16]
BATCH_SIZE = 2
# eps well above fp32 reduction noise: Adam's first update is lr * g / (|g| + eps), so an element whose gradient is
# ~eps moves by a visibly different amount when inductor sums in another order (seen: a 3e-8 gradient gave a 1.6e-4
# parameter difference with eps=1e-8). That is Adam's conditioning, not the capture under test; AdamW's arithmetic
# itself is checked against torch's with eps=1e-8 below.
HYPERPARAMETERS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1, grad_clip=1.0)
PARAM_TOLERANCE = 1e-5


def next_token_loss(model, batch):
    """Masked next-token cross-entropy, normalised by `batch["token_scale"]` (1 / tokens in the whole batch) so
    that micro-batch losses add up to the batch's."""
    input_ids, mask = batch["input_ids"], batch["loss_mask"][:, 1:]
    logprobs = torch.log_softmax(model(input_ids).float()[:, :-1], dim=-1)
    picked = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    loss = -(picked * mask).sum() * batch["token_scale"]
    return loss, {"tokens": mask.sum()}


def make_batch(seed: int, lengths: list[int], bucket: int) -> dict[str, torch.Tensor]:
    """Rows of random tokens with the given real lengths, right-padded to `bucket`."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (len(lengths), bucket), generator=generator)
    mask = (torch.arange(bucket)[None, :] < torch.tensor(lengths)[:, None]).float()
    ids = ids * mask.long()  # padding token 0 past each row's end
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "token_scale": 1.0 / mask[:, 1:].sum(),
    }


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(TINY_LLAMA)


def make_trainer(model, compile: bool) -> GraphTrainStep:
    return GraphTrainStep(model, next_token_loss, **HYPERPARAMETERS, compile=compile, buckets=BUCKETS)


def assert_same_parameters(first, second, tolerance=PARAM_TOLERANCE):
    for (name, a), b in zip(first.named_parameters(), second.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=0, msg=lambda text, name=name: f"{name}: {text}")


def test_bucket_length_picks_smallest_fitting_bucket():
    assert bucket_length(1, [16, 8]) == 8
    assert bucket_length(8, [8, 16]) == 8
    assert bucket_length(9, [8, 16]) == 16
    with pytest.raises(ValueError, match="17"):
        bucket_length(17, [8, 16])


def test_functional_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    params = [torch.randn(4, 3), torch.randn(5)]
    reference = [p.clone().requires_grad_(True) for p in params]
    ours = [p.clone() for p in params]
    betas, eps, weight_decay, lr = (0.9, 0.95), 1e-8, 0.1, 1e-2
    torch_adamw = torch.optim.AdamW(reference, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    functional = FunctionalAdamW(ours, betas=betas, eps=eps, weight_decay=weight_decay)

    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for param, grad in zip(reference, grads):
            param.grad = grad.clone()
        torch_adamw.step()
        functional.update(ours, grads, torch.tensor(lr))

    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs.detach(), atol=1e-6, rtol=0)
    for index, param in enumerate(reference):
        state = torch_adamw.state[param]
        torch.testing.assert_close(functional.exp_avg[index], state["exp_avg"], atol=1e-6, rtol=0)
        torch.testing.assert_close(functional.exp_avg_sq[index], state["exp_avg_sq"], atol=1e-6, rtol=0)
    assert functional.step.item() == 3


def test_functional_adamw_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    params = [torch.randn(3, 2)]
    original = FunctionalAdamW(params, betas=(0.9, 0.95), weight_decay=0.1)
    original.update(params, [torch.randn(3, 2)], torch.tensor(1e-2))
    saved = {key: copy.deepcopy(value) for key, value in original.state_dict().items()}

    resumed_params = [params[0].clone()]
    resumed = FunctionalAdamW(resumed_params, betas=(0.5, 0.5), weight_decay=0.0)
    resumed.load_state_dict(saved)
    grad = [torch.randn(3, 2)]
    original.update(params, grad, torch.tensor(1e-2))
    resumed.update(resumed_params, grad, torch.tensor(1e-2))
    torch.testing.assert_close(resumed_params[0], params[0], atol=0, rtol=0)
    assert resumed.step.item() == 2

    with pytest.raises(ValueError, match="shape"):
        FunctionalAdamW([torch.zeros(2, 2)]).load_state_dict(saved)


@pytest.mark.heavy
def test_compiled_step_is_one_graph_and_matches_eager():
    graph_model = tiny_model()
    eager_model = copy.deepcopy(graph_model)
    graph_step, eager_step = make_trainer(graph_model, compile=True), make_trainer(eager_model, compile=False)
    # A changing learning rate must not recompile: it enters the graph as a 0-d tensor.
    learning_rates = [1e-2, 5e-3, 2e-3]

    for step_index, lr in enumerate(learning_rates):
        batch = make_batch(seed=step_index, lengths=[8, 5], bucket=8)
        graph_metrics = graph_step.step(batch, lr)
        eager_metrics = eager_step.step(batch, lr)
        assert graph_metrics.loss == pytest.approx(eager_metrics.loss, abs=PARAM_TOLERANCE)
        assert graph_metrics.grad_norm == pytest.approx(eager_metrics.grad_norm, rel=1e-5)
        assert graph_metrics.stats["tokens"] == eager_metrics.stats["tokens"] == 11

    assert graph_metrics.compiles == 1
    assert graph_metrics.graph_breaks == 0
    assert eager_metrics.compiles == 0
    assert graph_step.optimizer.step.item() == eager_step.optimizer.step.item() == len(learning_rates)
    assert_same_parameters(graph_model, eager_model)
    # The update really happened inside the graph, not only in the eager twin.
    assert not torch.equal(graph_model.lm_head.weight, tiny_model().lm_head.weight)


def chunked_logprob_loss(model, batch):
    """next_token_loss through rlpipe's chunked log-prob (a custom autograd.Function), as the learner's step runs."""
    from rlpipe.kernels.logprob import linear_logprob

    input_ids, mask = batch["input_ids"], batch["loss_mask"][:, 1:]
    hidden = model.hidden_states(input_ids, None)[:, :-1]
    picked, _ = linear_logprob(hidden.reshape(-1, hidden.shape[-1]), model.output_embedding(),
                               input_ids[:, 1:].reshape(-1), impl="chunked", chunk=16)
    loss = -(picked.view(mask.shape) * mask).sum() * batch["token_scale"]
    return loss, {"tokens": mask.sum()}


@pytest.mark.heavy
def test_a_step_compiled_again_comes_from_aotautograds_cache_custom_autograd_function_and_all():
    """A second trainer of the same step (a restarted rank, the next run) takes the traced forward and backward from
    AOTAutograd's cache, which would pass over a graph holding the chunked log-prob's autograd.Function."""
    from torch._dynamo.utils import counters

    batch = make_batch(seed=0, lengths=[8, 5], bucket=8)
    first = GraphTrainStep(tiny_model(), chunked_logprob_loss, **HYPERPARAMETERS, buckets=BUCKETS)
    first.step(batch)
    before = dict(counters["aot_autograd"])
    second_model = tiny_model()
    second = GraphTrainStep(second_model, chunked_logprob_loss, **HYPERPARAMETERS, buckets=BUCKETS)
    second.step(batch)
    assert second.compiles == 1
    spent = {key: value - before.get(key, 0) for key, value in counters["aot_autograd"].items()}
    assert spent.get("autograd_cache_hit") == 1 and not spent.get("autograd_cache_bypass"), spent
    # The cached step trains as the first did.
    assert_same_parameters(second_model, first.model)


@pytest.mark.heavy
def test_recompiles_are_bounded_by_buckets():
    trainer = make_trainer(tiny_model(), compile=True)
    # Seven distinct lengths, two buckets.
    longest_in_row = [3, 11, 6, 16, 8, 13, 5]
    for step_index, longest in enumerate(longest_in_row):
        bucket = bucket_length(longest, BUCKETS)
        metrics = trainer.step(make_batch(seed=step_index, lengths=[longest, 2], bucket=bucket), 1e-2)
    assert metrics.compiles == len(BUCKETS)
    assert metrics.graph_breaks == 0


def _micro_batch_case():
    """One batch of four rows and the same rows as two micro-batches, each scaled by the whole batch's tokens."""
    whole = make_batch(seed=7, lengths=[8, 6, 3, 7], bucket=8)
    rows_per_half = (slice(0, 2), slice(2, 4))
    halves = [{key: value[rows] for key, value in whole.items() if key != "token_scale"} for rows in rows_per_half]
    for half in halves:
        half["token_scale"] = whole["token_scale"]
    return whole, halves


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "graph"])
@pytest.mark.heavy
def test_micro_batches_sum_to_the_whole_batch(compile):
    whole, halves = _micro_batch_case()
    reference_model = tiny_model()
    micro_model = copy.deepcopy(reference_model)
    # The reference is always eager: only the micro-batched trainer's mode varies.
    reference = make_trainer(reference_model, compile=False)
    micro = make_trainer(micro_model, compile=compile)

    for lr in (1e-2, 5e-3):
        whole_metrics = reference.step(whole, lr)
        micro_metrics = micro.step(halves, lr)
        assert micro_metrics.loss == pytest.approx(whole_metrics.loss, abs=PARAM_TOLERANCE)
        assert micro_metrics.grad_norm == pytest.approx(whole_metrics.grad_norm, rel=1e-5)
        assert micro_metrics.stats["tokens"] == whole_metrics.stats["tokens"]
    assert micro_metrics.compiles == (1 if compile else 0)
    assert_same_parameters(micro_model, reference_model)


def test_step_reports_stats_of_any_shape_summed_over_micro_batches():
    def loss_with_vector_stat(model, batch):
        loss, stats = next_token_loss(model, batch)
        return loss, {**stats, "per_row": batch["loss_mask"].sum(-1)}

    trainer = GraphTrainStep(tiny_model(), loss_with_vector_stat, **HYPERPARAMETERS, compile=False, buckets=BUCKETS)
    _, halves = _micro_batch_case()
    metrics = trainer.step(halves, 1e-2)
    per_row = halves[0]["loss_mask"].sum(-1) + halves[1]["loss_mask"].sum(-1)
    assert metrics.stats["per_row"].tolist() == per_row.tolist()
    assert metrics.stats["tokens"] == sum(float(half["loss_mask"][:, 1:].sum()) for half in halves)


def test_typed_stats_combine_over_micro_batches_by_their_own_rule():
    """`LossStats` add up over micro-batches except the fields declared maxima, and come back as that type."""

    def loss_with_loss_stats(model, batch):
        loss, stats = next_token_loss(model, batch)
        rows = batch["loss_mask"][:, 1:].sum(-1)
        return loss, LossStats(tokens=stats["tokens"], entropy=rows.sum(), gap_abs=rows.sum(), gap_max=rows.max(),
                               gap_kl=rows.sum(), router_probability=rows)

    trainer = GraphTrainStep(tiny_model(), loss_with_loss_stats, **HYPERPARAMETERS, compile=False, buckets=BUCKETS)
    _, halves = _micro_batch_case()
    stats = trainer.step(halves, 1e-2).stats
    rows = [half["loss_mask"][:, 1:].sum(-1) for half in halves]
    assert isinstance(stats, LossStats) and stats.kl is None and stats.tokens.dtype == torch.float64
    assert float(stats.gap_max) == max(float(r.max()) for r in rows)
    assert float(stats.gap_abs) == sum(float(r.sum()) for r in rows)
    assert stats.router_probability.tolist() == (rows[0] + rows[1]).tolist()
