"""Causal attention with grouped-query heads (and an optional sliding window), softmax scale 1/sqrt(head_dim).

q [B, Hq, T, D]; k, v [B, Hkv, T, D] with Hq a multiple of Hkv (query head h reads kv head h // (Hq / Hkv)).
The `torch` implementation also takes keys that start before the queries (k, v [B, Hkv, P + T, D]: the queries are
the last T positions), which is how a packed row's continuations read the prompt they share.
A packed row reaches attention one of two ways: `masked_attention` under an explicit [W, W] mask
(`document_attention_mask`, which also expresses shared prompts; torch only), or `document_attention` with each
token's document id (a query sees the earlier keys of its own document: every document one sequence), which the
Pallas path runs without ever forming a [W, W] tensor.

- `torch`: the reference — kv heads repeated, `scaled_dot_product_attention` (what the model runs by default).
- `pallas`: JAX's splash attention (the Pallas TPU kernel jax ships, which TorchTPU wraps as
  `torch.tpu.ops.splash_sdpa`): blocks wholly masked are skipped, grouped kv heads are read in place, segment ids
  keep packed documents apart. On TorchTPU tensors without segments, TorchTPU's op; with segments (its op takes
  none), the JAX kernel through TorchTPU's bridge; on XLA tensors, torch_xla's flash kernel; elsewhere the JAX
  kernel interpreted, through the `rlpipe::splash_attention` custom op.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from rlpipe.kernels._jax import call, call_experimental, jax_modules, round_up, run_kernel, with_autograd

IMPLEMENTATIONS = ("torch", "pallas")


def causal_attention(q, k, v, window: int | None = None, impl: str = "torch") -> torch.Tensor:
    if impl == "torch":
        return reference_attention(q, k, v, window)
    _check_impl(impl)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"model.kernels.attention={impl}: keys must cover exactly the queries' positions")
    if q.device.type == "xla":
        return _xla_attention(q, k, v, window)
    return splash_attention(q, k, v, None, window)


def document_attention(q, k, v, document: torch.Tensor, window: int | None = None, impl: str = "torch") -> torch.Tensor:
    """Attention over a packed row q [1, Hq, W, D] whose token i sees token j iff document[i] == document[j],
    j <= i and i - j < window: each document one sequence, back to back (document [W], integer ids)."""
    if impl == "torch":
        index = torch.arange(document.shape[0], device=document.device)
        return masked_attention(q, k, v, document_attention_mask(document, torch.zeros_like(document), index, window))
    _check_impl(impl)
    return splash_attention(q, k, v, document.reshape(1, -1), window)


def _check_impl(impl: str) -> None:
    if impl not in IMPLEMENTATIONS:
        choices = ", ".join(IMPLEMENTATIONS)
        raise ValueError(f"model.kernels.attention: unknown implementation {impl!r}; choose one of {choices}")


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


# ------------------------------------------------------------------ Pallas: JAX's splash attention


def _splash_block(length: int) -> int:
    """The splash kernel's block for a row of `length` tokens (a multiple of 128): the largest of 512, 256, 128
    that divides it, as the kernel takes whole blocks only."""
    return next(block for block in (512, 256, 128) if length % block == 0)


@functools.lru_cache(maxsize=None)
def _causal_mask_type():
    """JAX's causal mask, with the blocks wholly on one side of the diagonal answered from their corners. Making a
    splash kernel reads its whole [T, T] mask block by block on the host (its block map), and evaluating every
    element of every block costs seconds at tens of thousands of tokens (30 s for both maps at 80k); only the
    diagonal's blocks need it. One class per process: JAX keeps the maps it built by the mask's type and shape."""
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    class CornerCausalMask(masks.CausalMask):
        def __getitem__(self, idx):
            if isinstance(idx, tuple) and len(idx) == 2 and all(isinstance(part, slice) and part.step in (None, 1)
                                                                for part in idx):
                rows = self.q_sequence[idx[0]]
                start = 0 if idx[1].start is None else idx[1].start
                stop = self.shape[1] if idx[1].stop is None else idx[1].stop
                if len(rows) and 0 <= start < stop <= self.shape[1]:
                    if rows.min() + self.offset >= stop - 1:  # every query at or after every key
                        return np.ones((len(rows), stop - start), dtype=np.bool_)
                    if rows.max() + self.offset < start:  # every query before every key
                        return np.zeros((len(rows), stop - start), dtype=np.bool_)
            return super().__getitem__(idx)

    return CornerCausalMask


def _splash_kernel(heads: int, length: int, window: int, interpret_mode: bool):
    """JAX's splash kernel for one row of `heads` query heads and `length` tokens: causal, and within `window` when
    one is given (query i sees key j iff i - j < window)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape = (length, length)
    mask = masks.LocalMask(shape, (window - 1, 0), offset=0) if window else _causal_mask_type()(shape)
    block = _splash_block(length)
    blocks = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )
    return splash.make_splash_mha(
        masks.MultiHeadMask([mask] * heads), block_sizes=blocks, head_shards=1, q_seq_shards=1,
        interpret=interpret_mode,
    )


def _splash_attention(q, k, v, segments, window: int, interpret_mode: bool):
    """Splash attention over jax arrays q [B, Hq, T, D], k, v [B, Hkv, T, D] and segment ids [B, T] (a query sees
    only keys of its own segment): rows are padded to whole blocks, padding in a segment of its own."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    jax, jnp, _ = jax_modules()
    batch, heads, length, dim = q.shape
    padded = round_up(length, 128)
    extra = padded - length

    def pad(x):
        return jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0)))

    # The kernel does not scale the scores: scale q, in float32 so bf16 loses nothing to it.
    q = (q.astype(jnp.float32) / math.sqrt(dim)).astype(q.dtype)
    segments = jnp.pad(segments.astype(jnp.int32), ((0, 0), (0, extra)), constant_values=-1)
    kernel = _splash_kernel(heads, padded, window, interpret_mode)
    run = jax.vmap(kernel, in_axes=(0, 0, 0, splash.SegmentIds(0, 0)))
    out = run(pad(q), pad(k), pad(v), splash.SegmentIds(segments, segments))
    return out[:, :, :length].astype(q.dtype)


@functools.lru_cache(maxsize=None)
def _splash_functions(window: int, interpret_mode: bool):
    jax = jax_modules()[0]

    def forward(q, k, v, segments):
        return _splash_attention(q, k, v, segments, window, interpret_mode)

    def backward(q, k, v, segments, grad_out):
        # The bridge hands the backward arrays, not the forward's JAX residuals, so the kernel's own backward (its
        # dq and dkv kernels) runs behind a re-run of the forward kernel.
        _, pullback = jax.vjp(lambda q, k, v: forward(q, k, v, segments), q, k, v)
        return pullback(grad_out.astype(q.dtype))

    return jax.jit(forward), jax.jit(backward)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, window: int, interpret_mode: bool
) -> torch.Tensor:
    return _splash_functions(window, interpret_mode)[0](q, k, v, segments)


def _backward_pass(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, grad_out: torch.Tensor,
    window: int, interpret_mode: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _splash_functions(window, interpret_mode)[1](q, k, v, segments, grad_out)


@torch.library.custom_op("rlpipe::splash_attention", mutates_args=())
def _splash_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, window: int
) -> torch.Tensor:
    return run_kernel(_forward, q, k, v, segments, window)


@_splash_attention_op.register_fake
def _(q, k, v, segments, window):
    return torch.empty_like(q)


@torch.library.custom_op("rlpipe::splash_attention_backward", mutates_args=())
def _splash_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, grad_out: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return run_kernel(_backward_pass, *(t.contiguous() for t in (q, k, v, segments, grad_out)), window)


@_splash_attention_backward.register_fake
def _(q, k, v, segments, grad_out, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, segments, window = inputs
    ctx.save_for_backward(q, k, v, segments)
    ctx.window = window


def _backward(ctx, grad_out):
    q, k, v, segments = ctx.saved_tensors
    grads = call(_splash_attention_backward, _backward_pass, q, k, v, segments, grad_out.contiguous(), ctx.window)
    return (*grads, None, None)


with_autograd(_splash_attention_op, _forward, _backward, _setup_context, _backward_pass)


def splash_attention(q, k, v, segments: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """JAX's splash attention on torch tensors; `segments` [B, T] integer ids keep packed documents apart (None:
    one segment per row). On TorchTPU tensors without segments, TorchTPU's own op for it (`splash_sdpa`, whose
    backward keeps the forward's residuals); with segments, which that op does not take, the JAX kernel through
    TorchTPU's bridge; elsewhere the kernel interpreted."""
    if segments is None and q.device.type == "tpu":
        return _torchtpu_splash(q, k, v, window)
    if segments is None:
        segments = torch.zeros(q.shape[0], q.shape[2], dtype=torch.int32, device=q.device)
    args = (q.contiguous(), k.contiguous(), v.contiguous(), segments.to(torch.int32), window or 0)
    return call(_splash_attention_op, _forward, *args)


def _torchtpu_splash(q, k, v, window: int | None) -> torch.Tensor:
    length = q.shape[2]
    extra = round_up(length, 128) - length
    if extra:  # whole blocks only; padded keys come after every real query, so causality hides them
        q, k, v = (F.pad(x, (0, 0, 0, extra)) for x in (q, k, v))
    block = _splash_block(length + extra)
    out = call_experimental(
        torch.tpu.ops.splash_sdpa, q, k, v, scale=1.0 / math.sqrt(q.shape[-1]), is_causal=True,
        # TorchTPU's window counts the keys before the query; rlpipe's counts the query too.
        local_window_size=window - 1 if window else None, enable_gqa=q.shape[1] != k.shape[1],
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
    )
    return out[:, :, :length]
