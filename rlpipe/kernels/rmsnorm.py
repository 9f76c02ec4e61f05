"""RMSNorm: y = weight * (x / sqrt(mean(x^2) + eps)), statistics in float32 and the normalised value cast back to
x's dtype before the weight, as Hugging Face computes it.

- `torch`: the reference, written with torch ops (what the model runs by default).
- `pallas`: a row-blocked Pallas kernel and its backward (the weight's gradient is reduced over the row blocks,
  its accumulator resident across the grid), reached through the `rlpipe::pallas_rms_norm` custom op.
"""

from __future__ import annotations

import functools

import torch

from rlpipe.kernels._jax import call, jax_modules, round_up, run_kernel, tpu_compiler_params, with_autograd

IMPLEMENTATIONS = ("torch", "pallas")
BLOCK_ROWS = 256


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "torch") -> torch.Tensor:
    if impl == "torch" or x.device.type == "xla":  # no Pallas RMSNorm inside an XLA program: rlpipe/kernels/_xla.py
        return reference_rms_norm(x, weight, eps)
    if impl == "pallas":
        shape = x.shape
        return call(pallas_rms_norm, _forward, x.reshape(-1, shape[-1]), weight, eps).view(shape)
    raise ValueError(f"model.kernels.rmsnorm: unknown implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _forward_kernel(x_ref, weight_ref, out_ref, *, eps):
    jax, jnp, _ = jax_modules()
    x = x_ref[...]
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt((x32 * x32).mean(axis=1, keepdims=True) + eps)
    out_ref[...] = (weight_ref[...] * normed.astype(x.dtype)).astype(out_ref.dtype)


def _backward_kernel(x_ref, weight_ref, grad_ref, grad_x_ref, grad_weight_ref, *, eps):
    jax, jnp, pl = jax_modules()

    @pl.when(pl.program_id(0) == 0)
    def _start():
        grad_weight_ref[...] = jnp.zeros(grad_weight_ref.shape, jnp.float32)

    x32 = x_ref[...].astype(jnp.float32)
    grad = grad_ref[...].astype(jnp.float32)
    weight = weight_ref[...].astype(jnp.float32)
    inverse_rms = jax.lax.rsqrt((x32 * x32).mean(axis=1, keepdims=True) + eps)
    normed = x32 * inverse_rms
    grad_weight_ref[...] += (grad * normed).sum(axis=0, keepdims=True)
    scaled = grad * weight  # gradient with respect to the normalised value
    grad_x = inverse_rms * (scaled - normed * (scaled * normed).mean(axis=1, keepdims=True))
    grad_x_ref[...] = grad_x.astype(grad_x_ref.dtype)


@functools.lru_cache(maxsize=None)
def _pallas_functions(eps: float, block_rows: int, interpret_mode: bool):
    jax, jnp, pl = jax_modules()

    def blocks(x):
        rows, width = x.shape
        block = min(block_rows, round_up(rows, 8))
        padded = jnp.pad(x, ((0, round_up(rows, block) - rows), (0, 0)))
        return padded, block, width

    def forward(x, weight):
        padded, block, width = blocks(x)
        out_dtype = jnp.result_type(x.dtype, weight.dtype)
        out = pl.pallas_call(
            functools.partial(_forward_kernel, eps=eps),
            out_shape=jax.ShapeDtypeStruct(padded.shape, out_dtype),
            grid=(padded.shape[0] // block,),
            in_specs=[pl.BlockSpec((block, width), lambda i: (i, 0)), pl.BlockSpec((1, width), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((block, width), lambda i: (i, 0)),
            interpret=interpret_mode,
            compiler_params=tpu_compiler_params(),
        )(padded, weight[None, :])
        return out[: x.shape[0]]

    def backward(x, weight, grad):
        padded, block, width = blocks(x)
        grad_padded = jnp.pad(grad, ((0, padded.shape[0] - x.shape[0]), (0, 0)))  # zero rows add nothing
        rows_spec = pl.BlockSpec((block, width), lambda i: (i, 0))
        weight_spec = pl.BlockSpec((1, width), lambda i: (0, 0))
        grad_x, grad_weight = pl.pallas_call(
            functools.partial(_backward_kernel, eps=eps),
            out_shape=[
                jax.ShapeDtypeStruct(padded.shape, x.dtype),
                jax.ShapeDtypeStruct((1, width), jnp.float32),
            ],
            grid=(padded.shape[0] // block,),
            in_specs=[rows_spec, weight_spec, rows_spec],
            out_specs=[rows_spec, weight_spec],
            interpret=interpret_mode,
            compiler_params=tpu_compiler_params(),
        )(padded, weight[None, :], grad_padded)
        return grad_x[: x.shape[0]], grad_weight[0].astype(weight.dtype)

    return jax.jit(forward), jax.jit(backward)


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float, interpret_mode: bool) -> torch.Tensor:
    return _pallas_functions(eps, BLOCK_ROWS, interpret_mode)[0](x, weight)


def _backward_pass(
    x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float, interpret_mode: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _pallas_functions(eps, BLOCK_ROWS, interpret_mode)[1](x, weight, grad)


@torch.library.custom_op("rlpipe::pallas_rms_norm", mutates_args=())
def pallas_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, width], weight [width]."""
    return run_kernel(_forward, x, weight, eps)


@pallas_rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("rlpipe::pallas_rms_norm_backward", mutates_args=())
def pallas_rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return run_kernel(_backward_pass, x, weight, grad, eps)


@pallas_rms_norm_backward.register_fake
def _(x, weight, grad, eps):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = call(pallas_rms_norm_backward, _backward_pass, x, weight, grad.contiguous(), ctx.eps)
    return grad_x, grad_weight, None


with_autograd(pallas_rms_norm, _forward, _backward, _setup_context, _backward_pass)
