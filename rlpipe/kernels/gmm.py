"""Grouped matmul for mixture-of-experts layers: rows sorted by group (expert), each group times its own matrix.

x [M, K] with rows ordered by group, weights [G, K, N], group_sizes [G] (summing to M) -> out [M, N], where the
rows of group g are multiplied by weights[g].

- `torch`: the reference, one matmul per group, reached through the `rlpipe::grouped_matmul` custom op: the
  per-group split needs the group sizes on the host, which a traced graph cannot take, so the op is opaque to
  torch.compile (its fake implementation gives the static output shape) and its backward is two more grouped
  matmuls (input gradient against the transposed weights, weight gradient per group).
- `pallas`: each group's rows are laid out padded to whole row blocks, so every row block belongs to exactly one
  group; a per-block group id, prefetched as a scalar (`PrefetchScalarGridSpec`), lets the weight's BlockSpec
  fetch that group's matrix. Forward: grid (row block, column block, K block) with K the reduction axis. The
  input gradient is the same kernel against the transposed weights; the weight gradient walks the row blocks as
  its reduction axis, starting a fresh accumulator where the group changes (groups without rows get zeros).
  Reached through the `rlpipe::pallas_grouped_matmul` custom op.
"""

from __future__ import annotations

import functools

import torch

from rlpipe.kernels._jax import call, jax_modules, round_up, run_kernel, with_autograd

IMPLEMENTATIONS = ("torch", "pallas")
BLOCK_M, BLOCK_K, BLOCK_N = 128, 128, 128


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    if impl == "torch":
        return torch_grouped_matmul(x, weights, group_sizes)
    if impl == "pallas":
        return call(pallas_grouped_matmul, _forward, x.contiguous(), weights.contiguous(), group_sizes.to(torch.int32))
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


def _matmul_kernel(block_group_ref, x_ref, w_ref, out_ref):
    _, jnp, pl = jax_modules()

    @pl.when(pl.program_id(2) == 0)
    def _start():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    out_ref[...] += jnp.dot(x_ref[...], w_ref[0], preferred_element_type=jnp.float32)


def _weight_grad_kernel(block_group_ref, x_ref, grad_ref, out_ref):
    jax, jnp, pl = jax_modules()
    row_block = pl.program_id(2)
    first_of_group = (row_block == 0) | (block_group_ref[row_block] != block_group_ref[jnp.maximum(row_block - 1, 0)])

    @pl.when(first_of_group)
    def _start():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    out_ref[0] += jax.lax.dot_general(
        x_ref[...], grad_ref[...], (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )


@functools.lru_cache(maxsize=None)
def _pallas_functions(block_m: int, block_k: int, block_n: int, interpret_mode: bool):
    jax, jnp, pl = jax_modules()
    from jax.experimental.pallas import tpu as pltpu

    def layout(group_sizes, rows, groups, bm):
        """Where each row goes in the padded layout, and the group of every row block (static sizes: room for
        every group to waste almost a block)."""
        padded_rows = round_up(rows, bm) + groups * bm
        padded_sizes = (group_sizes + bm - 1) // bm * bm
        starts = jnp.cumsum(group_sizes) - group_sizes
        padded_starts = jnp.cumsum(padded_sizes) - padded_sizes
        row_group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")
        destination = jnp.arange(rows) + (padded_starts - starts)[row_group]
        block_starts = jnp.arange(padded_rows // bm) * bm
        block_group = jnp.searchsorted(jnp.cumsum(padded_sizes), block_starts, side="right")
        return destination, jnp.minimum(block_group, groups - 1).astype(jnp.int32), padded_rows

    def blocks(rows, k, n, groups):
        return min(block_m, round_up(rows, 8)), min(block_k, round_up(k, 128)), min(block_n, round_up(n, 128))

    def pad_to(x, shape):
        return jnp.pad(x, [(0, target - size) for size, target in zip(x.shape, shape)])

    def matmul(x_padded, weights, block_group, bm, bk, bn):
        """Padded rows [P, K] x weights [G, K, N] -> [P, N] float32."""
        rows, k = x_padded.shape
        n = weights.shape[2]
        kp, np_ = round_up(k, bk), round_up(n, bn)
        x_padded, weights = pad_to(x_padded, (rows, kp)), pad_to(weights, (weights.shape[0], kp, np_))
        out = pl.pallas_call(
            _matmul_kernel,
            out_shape=jax.ShapeDtypeStruct((rows, np_), jnp.float32),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(rows // bm, np_ // bn, kp // bk),
                in_specs=[
                    pl.BlockSpec((bm, bk), lambda i, j, kk, group: (i, kk)),
                    pl.BlockSpec((1, bk, bn), lambda i, j, kk, group: (group[i], kk, j)),
                ],
                out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk, group: (i, j)),
            ),
            interpret=interpret_mode,
        )(block_group, x_padded, weights)
        return out[:, :n]

    def forward(x, weights, group_sizes):
        rows, k = x.shape
        groups, _, n = weights.shape
        bm, bk, bn = blocks(rows, k, n, groups)
        destination, block_group, padded_rows = layout(group_sizes, rows, groups, bm)
        x_padded = jnp.zeros((padded_rows, k), x.dtype).at[destination].set(x)
        return matmul(x_padded, weights, block_group, bm, bk, bn)[destination].astype(x.dtype)

    def backward(x, weights, group_sizes, grad):
        rows, k = x.shape
        groups, _, n = weights.shape
        bm, bk, bn = blocks(rows, k, n, groups)
        destination, block_group, padded_rows = layout(group_sizes, rows, groups, bm)
        x_padded = jnp.zeros((padded_rows, k), x.dtype).at[destination].set(x)
        grad_padded = jnp.zeros((padded_rows, n), grad.dtype).at[destination].set(grad)
        grad_x = matmul(grad_padded, weights.transpose(0, 2, 1), block_group, bm, bn, bk)[destination]

        kp, np_ = round_up(k, bk), round_up(n, bn)
        grad_w = pl.pallas_call(
            _weight_grad_kernel,
            out_shape=jax.ShapeDtypeStruct((groups, kp, np_), jnp.float32),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(kp // bk, np_ // bn, padded_rows // bm),
                in_specs=[
                    pl.BlockSpec((bm, bk), lambda kk, j, i, group: (i, kk)),
                    pl.BlockSpec((bm, bn), lambda kk, j, i, group: (i, j)),
                ],
                out_specs=pl.BlockSpec((1, bk, bn), lambda kk, j, i, group: (group[i], kk, j)),
            ),
            interpret=interpret_mode,
        )(block_group, pad_to(x_padded, (padded_rows, kp)), pad_to(grad_padded, (padded_rows, np_)))
        grad_w = jnp.where((group_sizes > 0)[:, None, None], grad_w[:, :k, :n], 0.0)
        return grad_x.astype(x.dtype), grad_w.astype(weights.dtype)

    return jax.jit(forward), jax.jit(backward)


def _forward(x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, interpret_mode: bool) -> torch.Tensor:
    return _pallas_functions(BLOCK_M, BLOCK_K, BLOCK_N, interpret_mode)[0](x, weights, group_sizes)


def _backward_pass(
    x: torch.Tensor, weights: torch.Tensor, group_sizes: torch.Tensor, grad: torch.Tensor, interpret_mode: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _pallas_functions(BLOCK_M, BLOCK_K, BLOCK_N, interpret_mode)[1](x, weights, group_sizes, grad)


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


with_autograd(pallas_grouped_matmul, _forward, _backward, _save_inputs)
