"""Parity of every kernel implementation with its torch reference (forward and gradient), the bridges' custom-op
contracts, and the chunked log-prob path's memory bound."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlpipe.config import KernelsConfig
from rlpipe.kernels import causal_attention, document_attention, linear_logprob, reference_linear_logprob, rms_norm
from rlpipe.kernels import attention as attention_module
from rlpipe.kernels import gmm as gmm_module
from rlpipe.kernels import logprob as logprob_module
from rlpipe.kernels import rmsnorm as rmsnorm_module
from rlpipe.kernels._jax import interpret
from rlpipe.training.train_engine import token_logprobs
from rlpipe.models import load_model
from rlpipe.models.moe import Experts, TopKRouter


@pytest.fixture
def small_blocks(monkeypatch):
    # Blocks far smaller than the shapes below, so every grid axis has several steps and ragged edges.
    monkeypatch.setattr(logprob_module, "BLOCK_TOKENS", 16)
    monkeypatch.setattr(logprob_module, "BLOCK_VOCAB", 128)
    monkeypatch.setattr(rmsnorm_module, "BLOCK_ROWS", 8)
    monkeypatch.setattr(gmm_module, "BLOCK_M", 8)


def _logprob_case(dtype=torch.float32, rows=37, width=48, vocab=1000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(vocab, width, generator=generator)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[:3] = torch.tensor([0, vocab - 1, 127])  # the first and last vocab entries, and a block edge
    upstream = torch.randn(rows, generator=generator)
    return hidden, weight, targets, upstream


def _with_grads(fn, hidden, weight, targets, upstream):
    logprob, entropy = fn(hidden, weight, targets)
    grads = torch.autograd.grad((logprob * upstream).sum(), (hidden, weight))
    return logprob.detach(), entropy.detach(), *grads


def test_pallas_runs_interpreted_off_tpu():
    assert interpret()


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.heavy
def test_logprob_matches_the_reference_in_value_entropy_and_gradient_fp32(small_blocks, impl, temperature):
    case = _logprob_case()
    expected = _with_grads(lambda h, w, t: reference_linear_logprob(h, w, t, 1 / temperature), *case)
    got = _with_grads(lambda h, w, t: linear_logprob(h, w, t, temperature, impl=impl, chunk=300), *case)
    for name, want, have in zip(["logprob", "entropy", "grad hidden", "grad weight"], expected, got):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=name)  # fp32: agreement to 1e-5
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.float32


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
@pytest.mark.heavy
def test_logprob_in_bf16_stays_close_to_the_fp32_reference(small_blocks, impl):
    hidden, weight, targets, upstream = _logprob_case(torch.bfloat16)
    as_fp32 = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    expected = _with_grads(reference_linear_logprob, *as_fp32, targets, upstream)
    got = _with_grads(lambda h, w, t: linear_logprob(h, w, t, impl=impl, chunk=300), hidden, weight, targets, upstream)
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    # bf16 products (8-bit mantissa) against fp32 ones: agreement to about 2 % of the values' scale.
    for name, want, have in zip(["logprob", "entropy", "grad hidden", "grad weight"], expected, got):
        scale = want.abs().max().item()
        assert (have.float() - want).abs().max().item() <= 0.02 * scale + 1e-2, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_pallas_matches_the_reference(small_blocks, dtype):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 40, generator=generator).to(dtype).requires_grad_()  # 21 rows: a ragged last block
    weight = (1 + 0.1 * torch.randn(40, generator=generator)).to(dtype).requires_grad_()
    upstream = torch.randn(3, 7, 40, generator=generator).to(dtype)
    results = []
    for impl in ("torch", "pallas"):
        out = rms_norm(x, weight, 1e-6, impl)
        results.append((out.detach(), *torch.autograd.grad((out * upstream).sum(), (x, weight))))
    tolerance = 1e-5 if dtype == torch.float32 else 4e-2  # bf16: the kernel keeps fp32 where torch rounds
    for name, want, have in zip(["value", "grad x", "grad weight"], *results):
        assert have.dtype == want.dtype, name
        torch.testing.assert_close(have.float(), want.float(), rtol=tolerance, atol=tolerance, msg=name)


def _attention_case(dtype, batch=2, heads=4, kv_heads=2, length=21, dim=8):
    generator = torch.Generator().manual_seed(2)
    q, k, v, upstream = (
        torch.randn(batch, h, length, dim, generator=generator).to(dtype)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), upstream


@pytest.mark.parametrize("window", [None, 5, 140])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.heavy
def test_attention_pallas_matches_the_reference_fp32(window, kv_heads):
    # 300 positions: the kernel's smallest block is 128, so three query blocks, a ragged last one, blocks above the
    # diagonal skipped, and with a window of 5 blocks below it too (140 spans a block edge); kv_heads 2 and 1 share
    # each kv head between query heads.
    q, k, v, upstream = _attention_case(torch.float32, kv_heads=kv_heads, length=300)
    results = []
    for impl in ("torch", "pallas"):
        out = causal_attention(q, k, v, window, impl)
        results.append((out.detach(), *torch.autograd.grad((out * upstream).sum(), (q, k, v))))
    for name, want, have in zip(["out", "grad q", "grad k", "grad v"], *results):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("window", [None, 6])
def test_document_attention_pallas_keeps_packed_documents_apart_like_the_mask(window):
    # Documents of 100, 1, 150 and 9 tokens back to back (one straddles a block edge), then padding (-1): each token
    # sees only its own document's earlier tokens.
    document = torch.cat([torch.full((n,), doc) for doc, n in ((0, 100), (1, 1), (2, 150), (3, 9), (-1, 20))])
    q, k, v, upstream = _attention_case(torch.float32, batch=1, length=document.shape[0])
    results = []
    for impl in ("torch", "pallas"):
        out = document_attention(q, k, v, document, window, impl)
        results.append((out.detach(), *torch.autograd.grad((out * upstream).sum(), (q, k, v))))
    for name, want, have in zip(["out", "grad q", "grad k", "grad v"], *results):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=name)
    # A document's output is what attention over that document alone gives.
    alone = causal_attention(*(x[:, :, 101:251] for x in (q, k, v)), window)
    torch.testing.assert_close(results[1][0][:, :, 101:251], alone.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length, block, offset", [(1280, 256, 0), (2048, 128, 0), (1024, 128, 100), (1024, 128, -130)])
def test_the_splash_kernels_causal_mask_gives_jaxs_own_block_maps(length, block, offset):
    """The mask the kernel is made with answers whole blocks off the diagonal from their corners: every block map
    JAX builds from it (forward and dq, dkv) and every slice of it equal those of JAX's own causal mask."""
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info

    ours, theirs = attention_module._causal_mask_type()((length, length), offset), masks.CausalMask((length, length),
                                                                                                     offset)
    for process in (mask_info.process_mask, mask_info.process_mask_dkv):
        (got, got_function), (want, want_function) = (
            process(masks.MultiHeadMask([mask] * 3), (block, block)) for mask in (ours, theirs))
        assert (got_function is None) == (want_function is None)
        for name in want._fields:
            have, expected = getattr(got, name), getattr(want, name)
            assert (have is None) == (expected is None), name
            if expected is not None:
                assert have.dtype == expected.dtype and np.array_equal(have, expected), name
    edges = [0, 1, block - 1, block, block + 1, length // 2, length - block, length - 1, length]
    spans = [slice(start, stop) for start, stop in zip(edges, edges[1:])] + [slice(None)]
    for rows in spans:
        for cols in spans:
            have, expected = ours[rows, cols], theirs[rows, cols]
            assert have.dtype == expected.dtype and np.array_equal(have, expected), (rows, cols)


@pytest.mark.heavy
def test_attention_pallas_in_bf16_stays_close_to_the_fp32_reference():
    q, k, v, upstream = _attention_case(torch.bfloat16, length=200)
    as_fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = causal_attention(*as_fp32)
    want_grads = torch.autograd.grad((want * upstream.float()).sum(), as_fp32)
    have = causal_attention(q, k, v, impl="pallas")
    have_grads = torch.autograd.grad((have * upstream).sum(), (q, k, v))
    assert have.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in have_grads)
    for name, a, b in zip(["out", "grad q", "grad k", "grad v"], (want, *want_grads), (have, *have_grads)):
        assert (b.float() - a).abs().max().item() <= 0.02 * a.abs().max().item() + 1e-2, name


def _grouped_case(dtype, sizes=(5, 0, 13, 1, 9, 0), k=20, n=30):
    generator = torch.Generator().manual_seed(4)
    group_sizes = torch.tensor(sizes)
    x = torch.randn(int(group_sizes.sum()), k, generator=generator).to(dtype).requires_grad_()
    weights = torch.randn(len(sizes), k, n, generator=generator).to(dtype).requires_grad_()
    return x, weights, group_sizes, torch.randn(x.shape[0], n, generator=generator).to(dtype)


def _per_group_loop(x, weights, group_sizes):
    """The plainest statement of the op, row by row: what both implementations must equal."""
    groups = torch.repeat_interleave(torch.arange(len(group_sizes)), group_sizes)
    return torch.stack([x[row] @ weights[group] for row, group in enumerate(groups.tolist())])


@pytest.mark.parametrize("impl", ["torch", "pallas"])
def test_grouped_matmul_matches_a_per_row_loop_fp32(small_blocks, impl):
    # Row tiles of 8 over groups of 5, 0, 13, 1, 9, 0 rows (28, padded to 32): groups start and end inside tiles,
    # several groups share a tile, empty groups get zero gradients.
    x, weights, group_sizes, upstream = _grouped_case(torch.float32)
    results = []
    for fn in (_per_group_loop, lambda *a: gmm_module.grouped_matmul(*a, impl=impl)):
        out = fn(x, weights, group_sizes)
        results.append((out.detach(), *torch.autograd.grad((out * upstream).sum(), (x, weights))))
    for name, want, have in zip(["out", "grad x", "grad weights"], *results):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=name)
    assert results[1][2][1].abs().max() == 0 and results[1][2][5].abs().max() == 0


def test_grouped_matmul_pallas_pads_rows_to_whole_tiles_and_zeroes_empty_groups():
    # Megablox's own tile of 128 rows over 130 rows: a second, nearly empty row tile; the second group starts
    # inside the first tile and ends inside the second; empty groups first, in the middle and last.
    x, weights, group_sizes, upstream = _grouped_case(torch.float32, sizes=(0, 70, 0, 60, 0))
    assert x.shape[0] % gmm_module.BLOCK_M != 0
    results = []
    for fn in (_per_group_loop, lambda *a: gmm_module.grouped_matmul(*a, impl="pallas")):
        out = fn(x, weights, group_sizes)
        results.append((out.detach(), *torch.autograd.grad((out * upstream).sum(), (x, weights))))
    for name, want, have in zip(["out", "grad x", "grad weights"], *results):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=name)
    assert all(results[1][2][group].abs().max() == 0 for group in (0, 2, 4))
    # No rows at all: an empty result, and zero gradients for every group.
    empty = x[:0].detach().requires_grad_()
    out = gmm_module.grouped_matmul(empty, weights, torch.zeros(5, dtype=torch.int64), impl="pallas")
    assert out.shape == (0, weights.shape[2])
    assert torch.autograd.grad(out.sum(), weights)[0].abs().max() == 0


def test_grouped_matmul_pallas_in_bf16_stays_close_to_fp32(small_blocks):
    x, weights, group_sizes, upstream = _grouped_case(torch.bfloat16)
    as_fp32 = [t.detach().float().requires_grad_() for t in (x, weights)]
    want = gmm_module.grouped_matmul(as_fp32[0], as_fp32[1], group_sizes)
    want_grads = torch.autograd.grad((want * upstream.float()).sum(), as_fp32)
    have = gmm_module.grouped_matmul(x, weights, group_sizes, impl="pallas")
    have_grads = torch.autograd.grad((have * upstream).sum(), (x, weights))
    assert have.dtype == torch.bfloat16
    for name, a, b in zip(["out", "grad x", "grad weights"], (want, *want_grads), (have, *have_grads)):
        assert (b.float() - a).abs().max().item() <= 0.02 * a.abs().max().item() + 1e-2, name


def test_the_bridges_satisfy_the_custom_op_contract(small_blocks):
    """Schema, fake (meta) implementation and autograd registration, as torch.compile and export rely on them."""
    hidden, weight, targets, _ = _logprob_case(rows=9, width=16, vocab=300)
    torch.library.opcheck(
        logprob_module.pallas_linear_logprob,
        (hidden, weight, targets.to(torch.int32), 1.0),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    x = torch.randn(10, 16, requires_grad=True)
    torch.library.opcheck(
        rmsnorm_module.pallas_rms_norm,
        (x, torch.ones(16, requires_grad=True), 1e-6),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    x, weights, group_sizes, _ = _grouped_case(torch.float32, sizes=(3, 0, 4))
    torch.library.opcheck(
        gmm_module.torch_grouped_matmul,
        (x, weights, group_sizes),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    torch.library.opcheck(
        gmm_module.pallas_grouped_matmul,
        (x, weights, group_sizes.to(torch.int32)),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    q, k, v, _ = _attention_case(torch.float32, length=9)
    torch.library.opcheck(
        attention_module._splash_attention_op,
        (q, k, v, torch.zeros(2, 9, dtype=torch.int32), 0),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def _routed_tokens(tokens=21, hidden=24, intermediate=20, experts=6, top_k=2):
    generator = torch.Generator().manual_seed(5)
    module = Experts(hidden, intermediate, experts)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.3, generator=generator)
    router = TopKRouter(hidden, experts, top_k, normalize=True)
    torch.nn.init.normal_(router.weight, 0.0, 0.5, generator=generator)
    x = torch.randn(tokens, hidden, generator=generator).requires_grad_()
    _, weights, chosen = router(x)
    # Expert 3 receives no token: its weights must get exactly zero gradient from every implementation.
    chosen = torch.where(chosen == 3, (chosen + 1) % experts, chosen)
    chosen[:, 1] = torch.where(chosen[:, 1] == chosen[:, 0], (chosen[:, 0] + 2) % experts, chosen[:, 1])
    assert not (chosen == 3).any() and (chosen[:, 0] != chosen[:, 1]).all()
    return module, x, chosen, weights, torch.randn(tokens, hidden, generator=generator)


@pytest.mark.parametrize("impl", ["torch", "pallas"])
@pytest.mark.heavy
def test_moe_experts_grouped_matmul_matches_the_per_expert_loop(small_blocks, impl):
    """Tokens sorted by expert through one grouped matmul per projection equal a loop over experts, in the output
    and in the gradients of the input, both expert weights and the routing weights."""
    module, x, chosen, weights, upstream = _routed_tokens()
    results = []
    for implementation in ("loop", impl):
        module.impl = implementation
        out = module(x, chosen, weights)
        inputs = (x, module.gate_up_proj, module.down_proj, weights)
        results.append((out.detach(), *torch.autograd.grad((out * upstream).sum(), inputs, retain_graph=True)))
    for name, want, have in zip(["out", "grad x", "grad gate_up", "grad down", "grad routing"], *results):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=name)
    assert results[1][2][3].abs().max() == 0 and results[1][3][3].abs().max() == 0
    assert results[1][2].abs().sum() > 0 and results[1][4].abs().sum() > 0


class _LargestTensor(TorchDispatchMode):
    """The largest tensor (in elements) any op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_chunked_logprob_never_builds_tokens_by_vocab_logits():
    rows, width, vocab, chunk = 512, 32, 4000, 256  # tokens x vocab (2M) dwarfs every other tensor here
    hidden, weight, targets, upstream = _logprob_case(rows=rows, width=width, vocab=vocab)
    bound = max(rows * chunk, vocab * width, rows * width)
    sizes = {}
    for impl in ("reference", "chunked"):
        with _LargestTensor() as tracker:
            logprob, _ = linear_logprob(hidden, weight, targets, impl=impl, chunk=chunk)
            torch.autograd.grad((logprob * upstream).sum(), (hidden, weight))
        sizes[impl] = tracker.largest
    assert sizes["reference"] >= rows * vocab  # the tracker does see the full logits when they exist
    assert sizes["chunked"] <= bound, sizes  # forward and backward: O(tokens x chunk) beyond inputs and grads


@pytest.mark.heavy
def test_token_logprobs_agree_across_kernel_choices_on_a_model(tiny_qwen3, small_blocks):
    model = load_model(tiny_qwen3)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = torch.log_softmax(model(ids).float()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        for logprob in ("reference", "chunked", "pallas"):
            kernels = KernelsConfig(logprob=logprob, logprob_chunk=50)
            got = token_logprobs(model, ids, kernels=kernels)
            assert got[:, 0].eq(0).all()
            torch.testing.assert_close(got[:, 1:], plain, rtol=1e-5, atol=1e-5, msg=logprob)
        model.set_kernels(rmsnorm="pallas", attention="pallas")
        torch.testing.assert_close(token_logprobs(model, ids)[:, 1:], plain, rtol=1e-5, atol=1e-5)
    # The same in training: one update through the Pallas kernels equals one through torch's.
    grads = {}
    for impl in ("torch", "pallas"):
        model.set_kernels(rmsnorm=impl, attention=impl)
        model.zero_grad()
        token_logprobs(model, ids).sum().backward()
        grads[impl] = [p.grad.clone() for p in model.parameters()]
    for name, want, have in zip([n for n, _ in model.named_parameters()], grads["torch"], grads["pallas"]):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-5, msg=name)


def test_an_unknown_implementation_names_the_config_key():
    hidden, weight, targets, _ = _logprob_case(rows=4, width=8, vocab=20)
    with pytest.raises(ValueError, match="model.kernels.logprob: unknown implementation 'fast'"):
        linear_logprob(hidden, weight, targets, impl="fast")
    with pytest.raises(ValueError, match="model.kernels.rmsnorm: unknown implementation 'fast'"):
        rms_norm(hidden, torch.ones(8), 1e-6, "fast")
    with pytest.raises(ValueError, match="model.kernels.attention: unknown implementation 'fast'"):
        causal_attention(hidden[None, None], hidden[None, None], hidden[None, None], impl="fast")
    experts = Experts(8, 4, 2)
    experts.impl = "fast"
    with pytest.raises(ValueError, match="model.kernels.experts: unknown implementation 'fast'"):
        experts(hidden, torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1))
