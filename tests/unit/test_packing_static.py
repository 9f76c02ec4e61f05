"""The static packed layout: rows packed (a group's prompt once) into a row of a fixed width, the layout as tensors
only, so a graph captured with static shapes runs every batch of that width. Its log-probs, entropies, gradients
and router logits equal the padded rows' ones, and a compiled pass compiles once per width."""

from __future__ import annotations

import pytest
import torch

from rlpipe.config import KernelsConfig
from rlpipe.kernels.attention import document_attention_mask
from rlpipe.models import CausalLM, ModelArchitecture, load_model
from rlpipe.models.architecture import FULL_ATTENTION, SLIDING_ATTENTION
from rlpipe.models.packing import PADDING_DOCUMENT, pack, pack_static, packed_length, packed_static_token_logprobs

TOLERANCE = 1e-5  # fp32; packing changes only the order of some sums
TEMPERATURE = 0.9
KERNELS = KernelsConfig(logprob_chunk=100)  # several vocabulary chunks, as on a real vocabulary


def _rows(seed: int, groups: int = 2, group_size: int = 2, prompt_sizes=(2, 9), completion_sizes=(1, 9), width=None):
    """GRPO-shaped rows: input_ids [B, T] right-padded with 0, lengths, prompt lengths and the completion mask.
    Each group's rows share one prompt, except the last row, whose prompt differs from its group's in the last
    token (so it runs on its own), and whose completion is empty when there are three groups or more."""
    generator = torch.Generator().manual_seed(seed)

    def draw(sizes):
        size = int(torch.randint(*sizes, (1,), generator=generator))
        return torch.randint(3, 300, (size,), generator=generator).tolist()

    prompts, completions = [], []
    for _ in range(groups):
        prompt = draw(prompt_sizes)
        for _ in range(group_size):
            prompts.append(list(prompt))
            completions.append(draw(completion_sizes))
    prompts[-1][-1] = prompts[-1][-1] % 299 + 1
    if groups >= 3:
        completions[-1] = []
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    input_ids = torch.zeros(len(prompts), width or max(lengths), dtype=torch.long)
    completion_mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        input_ids[row, : lengths[row]] = torch.tensor(prompt + completion)
        completion_mask[row, len(prompt) : lengths[row]] = True
    return input_ids, torch.tensor(lengths), torch.tensor([len(p) for p in prompts]), completion_mask


def _padded_token_logprobs(model, input_ids, router_logits=None):
    """The reference: each row run on its own terms (right-padded, causal attention), full logits and a log-softmax;
    (log-prob, entropy) [B, T] of each token given the ones before it, 0 at the first token."""
    hidden = model.hidden_states(input_ids, router_logits=router_logits)[:, :-1]
    logprobs = torch.log_softmax(torch.nn.functional.linear(hidden, model.output_embedding()) / TEMPERATURE, dim=-1)
    picked = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1).detach()
    return torch.nn.functional.pad(picked, (1, 0)), torch.nn.functional.pad(entropy, (1, 0))


def _sliding_window_model() -> CausalLM:
    torch.manual_seed(0)
    config = ModelArchitecture(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        qk_norm=True, sliding_window=3, layer_types=(SLIDING_ATTENTION, FULL_ATTENTION), initializer_range=0.1,
    )
    return CausalLM(config)


@pytest.fixture(params=["qwen3", "qwen3_moe", "sliding_window"])
def model_factory(request):
    """A function building a fresh copy of the model (each forward under comparison gets its own gradients)."""
    if request.param == "sliding_window":
        return _sliding_window_model
    path = request.getfixturevalue(f"tiny_{request.param}")
    return lambda: load_model(path)


def test_pack_static_is_packs_row_padded_with_its_layout_as_tensors():
    ids = torch.tensor([[5, 6, 7, 1, 0], [5, 6, 8, 9, 2], [5, 6, 3, 0, 0], [5, 7, 3, 0, 0], [4, 4, 4, 4, 0]])
    lengths, prompts = torch.tensor([4, 5, 3, 3, 4]), torch.tensor([2, 2, 2, 2, 4])
    # Rows 0-2 share the prompt [5, 6]; row 3's differs; row 4 has no completion token.
    assert packed_length(ids, lengths, prompts) == 15
    layout = pack_static(ids, lengths, prompts, width=18)
    packed, positions, _, where = pack(ids, lengths, prompts)
    assert layout.input_ids.tolist() == [packed[0].tolist() + [0, 0, 0]]
    assert layout.position_ids.tolist() == [positions[0].tolist() + [0, 0, 0]]
    assert layout.document.tolist() == [0] * 8 + [1] * 3 + [2] * 4 + [PADDING_DOCUMENT] * 3
    assert layout.sequence.tolist() == [0, 0, 1, 1, 2, 2, 2, 3, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    assert torch.equal(layout.token_index, where)
    # The packed token before each packed token in its own sequence; 0 where there is none.
    assert layout.source.tolist() == [0, 0, 1, 2, 1, 4, 5, 1, 0, 8, 9, 0, 11, 12, 13, 0, 0, 0]
    assert layout.predicted().tolist() == [
        [False, True, True, True, False], [False, True, True, True, True], [False, True, True, False, False],
        [False, True, True, False, False], [False, True, True, True, False],
    ]
    completions = torch.arange(5) >= prompts[:, None]
    assert layout.packed_mask(completions).nonzero().flatten().tolist() == [2, 3, 4, 5, 6, 7, 10]
    # Without prompt lengths each row is a block of its own, all of it "prompt".
    alone = pack_static(ids, lengths, None, width=19)
    assert alone.document.tolist() == [0] * 4 + [1] * 5 + [2] * 3 + [3] * 3 + [4] * 4
    assert alone.sequence.abs().sum() == 0


def test_pack_static_refuses_a_width_the_row_does_not_fit():
    ids, lengths, prompts, _ = _rows(seed=0)
    needed = packed_length(ids, lengths, prompts)
    assert needed < int(lengths.sum())  # the shared prompts count once
    pack_static(ids, lengths, prompts, width=needed)
    with pytest.raises(ValueError, match=f"{needed} tokens, more than its width {needed - 1}"):
        pack_static(ids, lengths, prompts, width=needed - 1)


def test_the_mask_keeps_blocks_continuations_and_padding_apart():
    ids, lengths, prompts, _ = _rows(seed=1, groups=3)
    layout = pack_static(ids, lengths, prompts, width=packed_length(ids, lengths, prompts) + 3)
    mask = document_attention_mask(layout.document, layout.sequence, layout.position_ids[0])
    document, sequence = layout.document, layout.sequence
    for i in range(layout.width):
        for j in range(layout.width):
            expected = document[i] == document[j] and j <= i and sequence[j] in (0, sequence[i])
            assert bool(mask[i, j]) == bool(expected), (i, j)
    assert mask.diagonal().all()  # no token is left without a key
    windowed = document_attention_mask(document, sequence, layout.position_ids[0], window=2)
    assert torch.equal(windowed, mask & (layout.position_ids[0][:, None] - layout.position_ids[0][None, :] < 2))


@pytest.mark.parametrize("recompute", [False, True], ids=["", "activation-checkpointing"])
def test_static_packed_logprobs_gradients_and_router_logits_equal_the_padded_ones(model_factory, recompute):
    ids, lengths, prompts, scored = _rows(seed=2, groups=3, group_size=3)
    layout = pack_static(ids, lengths, prompts, width=packed_length(ids, lengths, prompts) + 5)
    # A loss over the scored tokens, weighted so every position's gradient differs.
    weights = torch.linspace(0.5, 1.5, ids.numel()).view(ids.shape)
    results = {}
    for packed in (False, True):
        model = model_factory()
        model.model.activation_checkpointing = recompute
        router_logits = [] if model.config.num_experts else None
        if packed:
            logprobs, entropy = packed_static_token_logprobs(
                model, layout, ids, scored, TEMPERATURE, with_entropy=True, kernels=KERNELS, router_logits=router_logits
            )
        else:
            logprobs, entropy = _padded_token_logprobs(model, ids, router_logits)
        (logprobs * weights * scored).sum().backward()
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        results[packed] = (logprobs.detach(), entropy, grads, router_logits)
    padded, packed = results[False], results[True]
    torch.testing.assert_close(packed[0][scored], padded[0][scored], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(packed[1][scored], padded[1][scored], atol=TOLERANCE, rtol=0)
    assert packed[0][~scored].abs().sum() == 0 and packed[1][~scored].abs().sum() == 0
    for name, grad in padded[2].items():
        torch.testing.assert_close(packed[2][name], grad, atol=TOLERANCE, rtol=1e-4, msg=name)
    if padded[3] is not None:
        # The completion tokens' router logits, picked out of the W packed positions by the layout.
        completions = layout.packed_mask(scored)
        assert len(packed[3]) == len(padded[3]) and int(completions.sum()) == int(scored.sum())
        for packed_logits, padded_logits in zip(packed[3], padded[3]):
            assert packed_logits.shape[0] == layout.width
            torch.testing.assert_close(
                packed_logits[completions], padded_logits[scored.reshape(-1)], atol=TOLERANCE, rtol=0
            )


@pytest.mark.heavy
def test_static_packed_rows_through_the_pallas_kernel_by_document_ids_equal_the_padded_ones(model_factory):
    # Packed without shared prompts (as the Pallas kernel takes them), each document one sequence; long enough rows
    # that documents straddle the kernel's 128-token blocks.
    ids, lengths, _, scored = _rows(seed=5, groups=3, group_size=3, prompt_sizes=(20, 40), completion_sizes=(10, 30))
    layout = pack_static(ids, lengths, None, width=packed_length(ids, lengths, None) + 7)
    weights = torch.linspace(0.5, 1.5, ids.numel()).view(ids.shape)
    results = {}
    for impl in ("torch", "pallas"):
        model = model_factory().set_kernels(attention=impl)
        if impl == "torch":
            logprobs, _ = _padded_token_logprobs(model, ids)
        else:
            logprobs = packed_static_token_logprobs(model, layout, ids, scored, TEMPERATURE, kernels=KERNELS)
        (logprobs * weights * scored).sum().backward()
        results[impl] = (logprobs.detach(), {name: param.grad.clone() for name, param in model.named_parameters()})
    assert layout.width > 2 * 128
    torch.testing.assert_close(results["pallas"][0][scored], results["torch"][0][scored], atol=TOLERANCE, rtol=0)
    # Weight gradients sum over every token, in the kernel's block order: a little more rounding than the log-probs.
    for name, grad in results["torch"][1].items():
        torch.testing.assert_close(results["pallas"][1][name], grad, atol=5 * TOLERANCE, rtol=1e-4, msg=name)


def test_static_packed_logprobs_without_a_scored_mask_cover_every_predicted_token(tiny_qwen3):
    model = load_model(tiny_qwen3)
    ids, lengths, prompts, _ = _rows(seed=3)
    layout = pack_static(ids, lengths, prompts, width=64)
    with torch.no_grad():
        packed = packed_static_token_logprobs(model, layout, ids, temperature=TEMPERATURE, kernels=KERNELS)
        padded = _padded_token_logprobs(model, ids)[0]
    predicted = layout.predicted()
    torch.testing.assert_close(packed[predicted], padded[predicted], atol=TOLERANCE, rtol=0)
    assert packed[~predicted].abs().sum() == 0


class _CountingBackend:
    """A torch.compile backend that counts the graphs handed to the real one."""

    def __init__(self, backend: str) -> None:
        self.backend = torch._dynamo.backends.registry.lookup_backend(backend)
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return self.backend(graph, example_inputs)


BUCKETS = (24, 64)


def _bucketed_batches():
    """Six batches of 4 rows [4, 20] whose lengths all differ, three packing into at most 24 tokens, three into
    25 to 64."""
    small = [_rows(seed, prompt_sizes=(2, 5), completion_sizes=(1, 4), width=20) for seed in range(3)]
    large = [_rows(seed, prompt_sizes=(5, 9), completion_sizes=(6, 11), width=20) for seed in range(3, 6)]
    return [batch for pair in zip(small, large) for batch in pair]


def _width(ids, lengths, prompts) -> int:
    return min(bucket for bucket in BUCKETS if bucket >= packed_length(ids, lengths, prompts))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.heavy
def test_a_compiled_pass_compiles_once_per_width_and_equals_eager(family, request):
    model = load_model(request.getfixturevalue(f"tiny_{family}"))
    model.model.activation_checkpointing = True  # as in the learner's step: the checkpointed layers are captured too
    router_logits = [] if model.config.num_experts else None

    def forward(layout, ids, scored):
        logits = [] if router_logits is not None else None
        logprobs, entropy = packed_static_token_logprobs(
            model, layout, ids, scored, TEMPERATURE, with_entropy=True, kernels=KERNELS, router_logits=logits
        )
        loss = (logprobs * scored).sum()
        if logits:
            # A router term over the completion tokens, masked rather than indexed so the shapes stay static.
            completions = layout.packed_mask(scored)[:, None]
            loss = loss + sum(torch.where(completions, layer_logits, 0.0).square().sum() for layer_logits in logits)
        return logprobs, entropy, loss

    torch._dynamo.reset()
    counter = _CountingBackend("aot_eager")
    compiled = torch.compile(forward, backend=counter, fullgraph=True, dynamic=False)
    batches = _bucketed_batches()
    assert len({tuple(lengths.tolist()) for _, lengths, _, _ in batches}) == len(batches)
    widths = [_width(ids, lengths, prompts) for ids, lengths, prompts, _ in batches]
    assert sorted(set(widths)) == list(BUCKETS)
    for (ids, lengths, prompts, scored), width in zip(batches, widths):
        layout = pack_static(ids, lengths, prompts, width)
        results = []
        for step in (forward, compiled):
            model.zero_grad()
            logprobs, entropy, loss = step(layout, ids, scored)
            loss.backward()
            results.append((logprobs.detach(), entropy, [param.grad.clone() for param in model.parameters()]))
        (eager_logprobs, eager_entropy, eager_grads), (logprobs, entropy, grads) = results
        torch.testing.assert_close(logprobs, eager_logprobs, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(entropy, eager_entropy, atol=TOLERANCE, rtol=0)
        for grad, eager_grad in zip(grads, eager_grads):
            torch.testing.assert_close(grad, eager_grad, atol=TOLERANCE, rtol=1e-4)
    assert counter.graphs == len(BUCKETS)


@pytest.mark.heavy
def test_inductor_compiles_the_static_packed_pass(tiny_qwen3):
    """One width through inductor (fullgraph, static shapes): the mask and the masked attention lower, forward
    and backward, and give the eager values."""
    model = load_model(tiny_qwen3)
    ids, lengths, prompts, scored = _rows(seed=4, groups=3)
    layout = pack_static(ids, lengths, prompts, width=packed_length(ids, lengths, prompts) + 4)

    def loss(layout, ids, scored):
        return (packed_static_token_logprobs(model, layout, ids, scored, TEMPERATURE, kernels=KERNELS) * scored).sum()

    torch._dynamo.reset()
    counter = _CountingBackend("inductor")
    compiled = torch.compile(loss, backend=counter, fullgraph=True, dynamic=False)
    results = []
    for step in (loss, compiled):
        model.zero_grad()
        value = step(layout, ids, scored)
        value.backward()
        results.append((value.detach(), [param.grad.clone() for param in model.parameters()]))
    (eager_value, eager_grads), (value, grads) = results
    torch.testing.assert_close(value, eager_value, atol=TOLERANCE, rtol=1e-6)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad, atol=TOLERANCE, rtol=1e-4)
    assert counter.graphs == 1


def test_rows_of_length_zero_take_no_place_in_the_packed_row():
    """A micro-batch padded to its row count with empty rows packs to the same tokens, so a packed bucket that
    holds the real rows exactly still holds them."""
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 1], [0, 0, 0, 0], [0, 0, 0, 0]])
    lengths, prompts = torch.tensor([4, 4, 0, 0]), torch.tensor([2, 2, 0, 0])
    assert packed_length(ids, lengths, prompts) == packed_length(ids[:2], lengths[:2], prompts[:2]) == 6
    layout = pack_static(ids, lengths, prompts, width=6)
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9, 1]]
    assert (layout.token_index[2:] == -1).all()
