"""Grouped matmul for mixture-of-experts layers: rows sorted by group (expert), each group times its own matrix.

x [M, K] with rows ordered by group, weights [G, K, N], group_sizes [G] (summing to M) -> out [M, N], where the
rows of group g are multiplied by weights[g].

- `torch`: the reference, one matmul per group, reached through the `rlpipe::grouped_matmul` custom op: the
  per-group split needs the group sizes on the host, which a traced graph cannot take, so the op is opaque to
  torch.compile (its fake implementation gives the static output shape) and its backward is two more grouped
  matmuls (input gradient against the transposed weights, weight gradient per group).
- `pallas`: the kernels the stack ships rather than one of rlpipe's own.
  - On TorchTPU's `tpu` tensors: `torch.tpu.ops.ragged_dot`, TorchTPU's grouped matmul, differentiable in x and
    the weights by TorchTPU's own autograd.
  - Elsewhere: JAX's megablox grouped matmul (`jax.experimental.pallas.ops.tpu.megablox`), interpreted off TPU,
    through the `rlpipe::pallas_grouped_matmul` custom op; its backward is `jax.vjp` of the same function, that
    is megablox's own (a grouped matmul against the transposed weights for x, its transposed grouped matmul for
    the weights, zeros for groups without rows). Megablox takes bf16 or fp32 only, and needs M to be a whole
    number of row tiles: x is padded to one with rows of no group, and K and N to whole 128-wide tiles (see
    `_megablox_functions`).
"""

from __future__ import annotations

import functools

import torch

from rlpipe.kernels._jax import call, call_experimental, jax_modules, round_up, run_kernel, with_autograd

IMPLEMENTATIONS = ("torch", "pallas")
# Megablox's tiles: rows, and one size for both K and N, because its backward reuses the forward's tiling with
# the roles of K and N swapped (the input gradient contracts over N).
BLOCK_M, BLOCK_KN = 128, 128


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    if impl == "torch":
        return torch_grouped_matmul(x, weights, group_sizes)
    if impl == "pallas":
        # int32: megablox requires it, and XLA's ragged dot, which TorchTPU's lowers to, takes it.
        group_sizes = group_sizes.to(torch.int32)
        if x.device.type == "tpu":
            return _ragged_dot(x, weights, group_sizes)
        return pallas_grouped_matmul(x.contiguous(), weights.contiguous(), group_sizes)
    raise ValueError(f"grouped_matmul: unknown implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")


def reference_grouped_matmul(x, weights, group_sizes) -> torch.Tensor:
    parts = torch.split(x, group_sizes.tolist())
    return torch.cat([part @ weight for part, weight in zip(parts, weights)])


@torch.library.custom_op("rlpipe::grouped_matmul", mutates_args=())
def torch_grouped_matmul(x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    return reference_grouped_matmul(x, weights, group_sizes)


@torch_grouped_matmul.register_fake
def _(x, weights, group_sizes):
    return x.new_empty((x.shape[0], weights.shape[2]))


@torch.library.custom_op("rlpipe::grouped_matmul_backward", mutates_args=())
def _torch_grouped_matmul_backward(
    x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = reference_grouped_matmul(grad, weights.transpose(1, 2), group_sizes)
    sizes = group_sizes.tolist()
    grad_w = torch.stack([part.T @ g for part, g in zip(torch.split(x, sizes), torch.split(grad, sizes))])
    return grad_x, grad_w


@_torch_grouped_matmul_backward.register_fake
def _(x, weights, group_sizes, grad):
    # Contiguous, as the real gradients are, whatever the strides of a transposed weight view.
    return x.new_empty(x.shape), weights.new_empty(weights.shape)


def _torch_backward(ctx, grad):
    x, weights, group_sizes = ctx.saved_tensors
    return (*_torch_grouped_matmul_backward(x, weights, group_sizes, grad), None)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


torch_grouped_matmul.register_autograd(_torch_backward, setup_context=_save_inputs)


def _ragged_dot(x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    import torch_tpu  # noqa: F401  (adds torch.tpu)

    return call_experimental(torch.tpu.ops.ragged_dot, x, weights, group_sizes)


@functools.lru_cache(maxsize=None)
def _megablox_functions(block_m: int, block_kn: int, interpret_mode: bool):
    jax, jnp, _ = jax_modules()
    from jax.experimental.pallas.ops.tpu import megablox

    def product(x, weights, group_sizes):
        rows, k = x.shape
        n = weights.shape[2]
        if rows == 0:  # no row tile to size; megablox would divide by a zero tile
            return jnp.zeros((0, n), x.dtype)
        # Megablox raises unless M is a whole number of row tiles (of a multiple of 8 rows, as TPU blocks need).
        # The padding rows belong to no group (the group sizes sum to M): megablox leaves them out of the weight
        # gradient and never writes their output, which is cut off below.
        tm = min(block_m, round_up(rows, 8))
        padded_rows = round_up(rows, tm)
        # Megablox does take a ragged K or N (it masks the last K tile), but then a tile reaches past the end of
        # the array, and with the tile wider than the whole dimension (small models) the block is larger than the
        # array. Zero padding to whole tiles keeps every block inside its array; model dimensions are usually
        # multiples of 128 already, and then nothing is padded.
        kp, np_ = round_up(k, block_kn), round_up(n, block_kn)
        if (padded_rows, kp) != (rows, k):
            x = jnp.pad(x, ((0, padded_rows - rows), (0, kp - k)))
        if (kp, np_) != (k, n):
            weights = jnp.pad(weights, ((0, 0), (0, kp - k), (0, np_ - n)))
        out = megablox.gmm(x, weights, group_sizes, x.dtype, (tm, block_kn, block_kn), interpret=interpret_mode)
        return out[:rows, :n]

    def forward(x, weights, group_sizes):
        return product(x, weights, group_sizes)

    def backward(x, weights, group_sizes, grad):
        _, pullback = jax.vjp(lambda a, b: product(a, b, group_sizes), x, weights)
        return pullback(grad)

    return jax.jit(forward), jax.jit(backward)


def _forward(x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, interpret_mode: bool) -> torch.Tensor:
    return _megablox_functions(BLOCK_M, BLOCK_KN, interpret_mode)[0](x, weights, group_sizes)


def _backward_pass(
    x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, grad: torch.Tensor, interpret_mode: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _megablox_functions(BLOCK_M, BLOCK_KN, interpret_mode)[1](x, weights, group_sizes, grad)


@torch.library.custom_op("rlpipe::pallas_grouped_matmul", mutates_args=())
def pallas_grouped_matmul(x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    return run_kernel(_forward, x, weights, group_sizes)


@pallas_grouped_matmul.register_fake
def _(x, weights, group_sizes):
    return x.new_empty((x.shape[0], weights.shape[2]))


@torch.library.custom_op("rlpipe::pallas_grouped_matmul_backward", mutates_args=())
def _pallas_grouped_matmul_backward(
    x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return run_kernel(_backward_pass, x, weights, group_sizes, grad.contiguous())


@_pallas_grouped_matmul_backward.register_fake
def _(x, weights, group_sizes, grad):
    return torch.empty_like(x), torch.empty_like(weights)


def _backward(ctx, grad):
    x, weights, group_sizes = ctx.saved_tensors
    return (*call(_pallas_grouped_matmul_backward, _backward_pass, x, weights, group_sizes, grad), None)


with_autograd(pallas_grouped_matmul, _forward, _backward, _save_inputs, _backward_pass)
