"""Causal attention with grouped-query heads (and an optional sliding window), softmax scale 1/sqrt(head_dim).

q [B, Hq, T, D]; k, v [B, Hkv, T, D] with Hq a multiple of Hkv (query head h reads kv head h // (Hq / Hkv)).
The `torch` implementation also takes keys that start before the queries (k, v [B, Hkv, P + T, D]: the queries are
the last T positions), which is how a packed row's continuations read the prompt they share.
`masked_attention` takes an explicit boolean mask instead (`document_attention_mask`: a whole packed row at once,
with shapes that do not depend on how it is laid out; torch only).

- `torch`: the reference — kv heads repeated, `scaled_dot_product_attention` (what the model runs by default).
- `pallas`: flash attention. Forward: grid (batch, query head, query block, kv block), the kv blocks a reduction
  axis with a running max and sum per query row; it keeps the log-sum-exp for backward. Backward: one kernel
  accumulates dq over kv blocks, another dk and dv over every query block of every query head sharing the kv
  head — so grouped heads never materialise repeated k/v. Blocks wholly above the diagonal (or outside the
  window) are skipped. Reached through the `rlpipe::pallas_attention` custom op.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from rlpipe.kernels._jax import call, jax_modules, round_up, run_kernel, with_autograd

IMPLEMENTATIONS = ("torch", "pallas")
BLOCK_Q, BLOCK_KV = 128, 128


def causal_attention(q, k, v, window: int | None = None, impl: str = "torch") -> torch.Tensor:
    if impl == "torch":
        return reference_attention(q, k, v, window)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"model.kernels.attention={impl}: keys must cover exactly the queries' positions")
    if impl == "pallas":
        if q.device.type == "xla":
            return _xla_attention(q, k, v, window)
        return pallas_attention(q.contiguous(), k.contiguous(), v.contiguous(), window or 0)
    raise ValueError(f"model.kernels.attention: unknown implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")


def reference_attention(q, k, v, window: int | None = None) -> torch.Tensor:
    k, v = _repeat_kv_heads(q, k, v)
    earlier = k.shape[2] - q.shape[2]  # keys before the first query (a shared prompt); sdpa's is_causal assumes 0
    if window is None and earlier == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q.shape[2], window, q.device, earlier))


def _repeat_kv_heads(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v with as many heads as q. Explicit repetition rather than sdpa's enable_gqa: every compile backend
    (inductor, XLA) lowers it."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return k, v


def masked_attention(q, k, v, mask: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """Attention under an explicit mask [T, T] (bool, True where query i may attend key j) that replaces causality,
    e.g. `document_attention_mask`'s for a packed row. Every query must see at least one key (itself, there).
    torch's scaled_dot_product_attention only: the Pallas kernel knows causal and window masks, no other."""
    if impl != "torch":
        raise ValueError(f"model.kernels.attention={impl}: an attention mask over a packed row needs attention=torch")
    k, v = _repeat_kv_heads(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def document_attention_mask(
    document: torch.Tensor, sequence: torch.Tensor, positions: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """[W, W] bool over a packed row of W tokens, True where token i may attend token j: same document, j <= i, and
    j on the document's shared prefix (sequence 0) or on i's own continuation (sequence[j] == sequence[i]); with a
    sliding window also positions[i] - positions[j] < window, positions being each token's position in its own
    sequence. document, sequence, positions: [W] integer tensors. Every token sees at least itself."""
    index = torch.arange(document.shape[0], device=document.device)
    allowed = (document[:, None] == document[None, :]) & (index[None, :] <= index[:, None])
    allowed = allowed & ((sequence[None, :] == 0) | (sequence[None, :] == sequence[:, None]))
    if window is not None:
        allowed = allowed & (positions[:, None] - positions[None, :] < window)
    return allowed


def _xla_attention(q, k, v, window: int | None) -> torch.Tensor:
    """`pallas` on an xla tensor: torch_xla's Pallas flash attention inside the XLA program where it can run (TPU,
    no sliding window), else the reference (see rlpipe/kernels/_xla.py)."""
    from rlpipe.kernels._xla import pallas_bridge_available

    if window is not None or not pallas_bridge_available():
        return reference_attention(q, k, v, window)
    from torch_xla.experimental.custom_kernel import flash_attention

    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # torch_xla's kernel takes as many kv heads as query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return flash_attention(q, k, v, causal=True, sm_scale=1.0 / math.sqrt(q.shape[-1]))


def causal_mask(length: int, window: int | None, device: torch.device, earlier: int = 0) -> torch.Tensor:
    """[T, earlier + T] bool, True where query i (at position earlier + i) may attend key j: j <= earlier + i and,
    with a window, earlier + i - j < window."""
    distance = torch.arange(earlier, earlier + length, device=device)[:, None] - torch.arange(earlier + length, device=device)
    return (distance >= 0) & (distance < (window or earlier + length))


# ------------------------------------------------------------------ Pallas


def _visible(q_start, k_start, block_q, block_kv, window):
    """Whether any (query, key) pair of these blocks may attend (the block is not wholly masked)."""
    jnp = jax_modules()[1]
    below_diagonal = k_start <= q_start + block_q - 1
    if not window:
        return below_diagonal
    return jnp.logical_and(below_diagonal, q_start - (k_start + block_kv - 1) < window)


def _scores(q, k, q_start, k_start, scale, length, window):
    """Scaled scores [bq, bkv] in float32, -inf where masked (causal, window, padding)."""
    jax, jnp, _ = jax_modules()
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    rows = q_start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 0)
    cols = k_start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    allowed = (cols <= rows) & (cols < length)
    if window:
        allowed = allowed & (rows - cols < window)
    return jnp.where(allowed, scores, -jnp.inf)


def _forward_kernel(q_ref, k_ref, v_ref, acc_ref, max_ref, sum_ref, *, block_q, block_kv, scale, length, window):
    jax, jnp, pl = jax_modules()
    q_index, kv_index = pl.program_id(2), pl.program_id(3)

    @pl.when(kv_index == 0)
    def _start():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)

    q_start, k_start = q_index * block_q, kv_index * block_kv

    @pl.when(_visible(q_start, k_start, block_q, block_kv, window))
    def _accumulate():
        v = v_ref[0, 0]
        scores = _scores(q_ref[0, 0], k_ref[0, 0], q_start, k_start, scale, length, window)
        old_max = max_ref[0, 0]
        new_max = jnp.maximum(old_max, scores.max(axis=1, keepdims=True))
        # A row with nothing visible yet keeps max -inf; subtracting 0 instead keeps exp() at 0, not NaN.
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.exp(scores - safe_max)
        rescale = jnp.exp(old_max - safe_max)
        sum_ref[0, 0] = sum_ref[0, 0] * rescale + probs.sum(axis=1, keepdims=True)
        acc_ref[0, 0] = acc_ref[0, 0] * rescale + jnp.dot(
            probs.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        max_ref[0, 0] = new_max


def _probs_and_score_grads(q, k, v, grad_out, lse, delta, q_start, k_start, scale, length, window):
    jax, jnp, _ = jax_modules()
    probs = jnp.exp(_scores(q, k, q_start, k_start, scale, length, window) - lse)
    grad_probs = jax.lax.dot_general(grad_out, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return probs, probs * (grad_probs - delta)


def _grad_q_kernel(q_ref, k_ref, v_ref, grad_out_ref, lse_ref, delta_ref, grad_q_ref, *, block_q, block_kv, scale, length, window):
    jax, jnp, pl = jax_modules()
    q_index, kv_index = pl.program_id(2), pl.program_id(3)

    @pl.when(kv_index == 0)
    def _start():
        grad_q_ref[...] = jnp.zeros(grad_q_ref.shape, jnp.float32)

    q_start, k_start = q_index * block_q, kv_index * block_kv

    @pl.when(_visible(q_start, k_start, block_q, block_kv, window))
    def _accumulate():
        k = k_ref[0, 0]
        _, grad_scores = _probs_and_score_grads(
            q_ref[0, 0], k, v_ref[0, 0], grad_out_ref[0, 0], lse_ref[0, 0], delta_ref[0, 0],
            q_start, k_start, scale, length, window,
        )
        grad_q_ref[0, 0] += jnp.dot(grad_scores.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale


def _grad_kv_kernel(
    q_ref, k_ref, v_ref, grad_out_ref, lse_ref, delta_ref, grad_k_ref, grad_v_ref, *, block_q, block_kv, scale, length, window, q_blocks
):
    jax, jnp, pl = jax_modules()
    kv_index, inner = pl.program_id(2), pl.program_id(3)  # inner walks (query head in the group, query block)

    @pl.when(inner == 0)
    def _start():
        grad_k_ref[...] = jnp.zeros(grad_k_ref.shape, jnp.float32)
        grad_v_ref[...] = jnp.zeros(grad_v_ref.shape, jnp.float32)

    q_start, k_start = (inner % q_blocks) * block_q, kv_index * block_kv

    @pl.when(_visible(q_start, k_start, block_q, block_kv, window))
    def _accumulate():
        q, grad_out = q_ref[0, 0], grad_out_ref[0, 0]
        probs, grad_scores = _probs_and_score_grads(
            q, k_ref[0, 0], v_ref[0, 0], grad_out, lse_ref[0, 0], delta_ref[0, 0],
            q_start, k_start, scale, length, window,
        )
        contract_rows = (((0,), (0,)), ((), ()))
        grad_v_ref[0, 0] += jax.lax.dot_general(
            probs.astype(grad_out.dtype), grad_out, contract_rows, preferred_element_type=jnp.float32
        )
        grad_k_ref[0, 0] += jax.lax.dot_general(
            grad_scores.astype(q.dtype), q, contract_rows, preferred_element_type=jnp.float32
        ) * scale


@functools.lru_cache(maxsize=None)
def _pallas_functions(window: int, block_q: int, block_kv: int, interpret_mode: bool):
    jax, jnp, pl = jax_modules()

    def layout(q, k):
        batch, heads, length, dim = q.shape
        bq, bkv = min(block_q, round_up(length, 8)), min(block_kv, round_up(length, 8))
        padded = round_up(length, math.lcm(bq, bkv))
        return batch, heads, k.shape[1], length, dim, bq, bkv, padded

    def pad(x, padded):
        return jnp.pad(x, ((0, 0), (0, 0), (0, padded - x.shape[2]), (0, 0)))

    def forward(q, k, v):
        batch, heads, kv_heads, length, dim, bq, bkv, padded = layout(q, k)
        groups = heads // kv_heads
        kwargs = dict(block_q=bq, block_kv=bkv, scale=1 / math.sqrt(dim), length=length, window=window)
        q_spec = pl.BlockSpec((1, 1, bq, dim), lambda b, h, i, j: (b, h, i, 0))
        kv_spec = pl.BlockSpec((1, 1, bkv, dim), lambda b, h, i, j: (b, h // groups, j, 0))
        row_spec = pl.BlockSpec((1, 1, bq, 1), lambda b, h, i, j: (b, h, i, 0))
        acc, row_max, row_sum = pl.pallas_call(
            functools.partial(_forward_kernel, **kwargs),
            out_shape=[
                jax.ShapeDtypeStruct((batch, heads, padded, dim), jnp.float32),
                jax.ShapeDtypeStruct((batch, heads, padded, 1), jnp.float32),
                jax.ShapeDtypeStruct((batch, heads, padded, 1), jnp.float32),
            ],
            grid=(batch, heads, padded // bq, padded // bkv),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=[q_spec, row_spec, row_spec],
            interpret=interpret_mode,
        )(pad(q, padded), pad(k, padded), pad(v, padded))
        row_sum = jnp.where(row_sum > 0, row_sum, 1.0)  # padded query rows see nothing
        out = (acc / row_sum)[:, :, :length].astype(q.dtype)
        lse = (row_max + jnp.log(row_sum))[:, :, :length, 0]
        return out, lse

    def backward(q, k, v, out, lse, grad_out):
        batch, heads, kv_heads, length, dim, bq, bkv, padded = layout(q, k)
        groups = heads // kv_heads
        q_blocks = padded // bq
        kwargs = dict(block_q=bq, block_kv=bkv, scale=1 / math.sqrt(dim), length=length, window=window)
        delta = (grad_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)  # rowsum(dO * O)
        rows = [jnp.pad(x, ((0, 0), (0, 0), (0, padded - length)))[..., None] for x in (lse, delta)]
        inputs = (pad(q, padded), pad(k, padded), pad(v, padded), pad(grad_out, padded), *rows)

        q_spec = pl.BlockSpec((1, 1, bq, dim), lambda b, h, i, j: (b, h, i, 0))
        kv_spec = pl.BlockSpec((1, 1, bkv, dim), lambda b, h, i, j: (b, h // groups, j, 0))
        row_spec = pl.BlockSpec((1, 1, bq, 1), lambda b, h, i, j: (b, h, i, 0))
        grad_q = pl.pallas_call(
            functools.partial(_grad_q_kernel, **kwargs),
            out_shape=jax.ShapeDtypeStruct((batch, heads, padded, dim), jnp.float32),
            grid=(batch, heads, q_blocks, padded // bkv),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
            out_specs=q_spec,
            interpret=interpret_mode,
        )(*inputs)

        # Grid (batch, kv head, kv block, query head in the group x query block).
        def query_block(b, g, j, r):
            return (b, g * groups + r // q_blocks, r % q_blocks, 0)

        q_spec = pl.BlockSpec((1, 1, bq, dim), query_block)
        row_spec = pl.BlockSpec((1, 1, bq, 1), query_block)
        kv_spec = pl.BlockSpec((1, 1, bkv, dim), lambda b, g, j, r: (b, g, j, 0))
        grad_k, grad_v = pl.pallas_call(
            functools.partial(_grad_kv_kernel, **kwargs, q_blocks=q_blocks),
            out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, padded, dim), jnp.float32)] * 2,
            grid=(batch, kv_heads, padded // bkv, groups * q_blocks),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
            out_specs=[kv_spec, kv_spec],
            interpret=interpret_mode,
        )(*inputs)
        return tuple(g[:, :, :length].astype(x.dtype) for g, x in ((grad_q, q), (grad_k, k), (grad_v, v)))

    return jax.jit(forward), jax.jit(backward)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, interpret_mode: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _pallas_functions(window, BLOCK_Q, BLOCK_KV, interpret_mode)[0](q, k, v)


def _backward_pass(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
    window: int, interpret_mode: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _pallas_functions(window, BLOCK_Q, BLOCK_KV, interpret_mode)[1](q, k, v, out, lse, grad_out)


@torch.library.custom_op("rlpipe::pallas_attention", mutates_args=())
def _pallas_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    return run_kernel(_forward, q, k, v, window)


@_pallas_attention_op.register_fake
def _(q, k, v, window):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("rlpipe::pallas_attention_backward", mutates_args=())
def _pallas_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return run_kernel(_backward_pass, *(t.contiguous() for t in (q, k, v, out, lse, grad_out)), window)


@_pallas_attention_backward.register_fake
def _(q, k, v, out, lse, grad_out, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, window = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.window = window


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*call(_pallas_attention_backward, _backward_pass, q, k, v, out, lse, grad_out, ctx.window), None)


with_autograd(_pallas_attention_op, _forward, _backward, _setup_context)


def pallas_attention(q, k, v, window: int = 0) -> torch.Tensor:
    """window 0: plain causal."""
    return call(_pallas_attention_op, _forward, q, k, v, window)[0]
