"""Running JAX (Pallas) kernels on torch tensors.

Each kernel is one JAX function of arrays, then static scalars, then `interpret`, and each has a torch custom op of
rlpipe's (`rlpipe::...`) whose body runs it by DLPack (`run_kernel`): no bytes are copied on the way in or out
(bf16 included), and off TPU the kernel runs in Pallas' interpret mode — the same kernel code and block specs,
executed by XLA on the host, which is what the parity tests check. DLPack cannot carry TorchTPU's `tpu` tensors, so
on those `call` runs the kernel as an op of TorchTPU's own bridge to JAX kernels (`torch.tpu.pallas.jax_op`, the
way vllm-torchtpu calls its own): it exports the function for TPU (Mosaic) and runs it on the chip, inside a compiled
graph too, with the same autograd as rlpipe's op (`with_autograd`). jax is imported on first use, so the torch paths
never pay for it.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch


def jax_modules():
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    return jax, jnp, pl


# Mosaic's default scoped VMEM limit (16 MiB on v5e and v5p, 32 MiB on v6e, as the compiler's errors give it) is
# smaller than what rlpipe's log-prob and RMSNorm backward kernels take at Qwen3-8B's hidden size 4096 (about 31 and
# 24 MiB: double-buffered blocks and float32 temporaries), which then fail to compile for v5e and v5p
# (CompileTimeScopedVmemOom). 48 MiB leaves them room and stays under the smallest VMEM of the three (v5p: 63.94
# MiB). `python bench/tpu_compile.py` compiles the kernels for each chip and prints the VMEM each one takes.
VMEM_LIMIT_BYTES = 48 * 2**20


def tpu_compiler_params(vmem_limit_bytes: int = VMEM_LIMIT_BYTES):
    """Mosaic compiler parameters for a `pallas_call` (ignored in interpret mode)."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(vmem_limit_bytes=vmem_limit_bytes)


def to_jax(tensor: torch.Tensor):
    jax, _, _ = jax_modules()
    return jax.dlpack.from_dlpack(tensor.detach().contiguous())


def to_torch(array) -> torch.Tensor:
    return torch.from_dlpack(array)


def interpret() -> bool:
    """Pallas compiles for TPU (Mosaic); anywhere else the kernel is interpreted."""
    jax, _, _ = jax_modules()
    return jax.default_backend() != "tpu"


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def run_kernel(kernel: Callable, *args):
    """`kernel(*args, interpret)` on host tensors by DLPack, returning a tensor or a tuple of them."""
    outputs = kernel(*(to_jax(arg) if isinstance(arg, torch.Tensor) else arg for arg in args), interpret())
    if isinstance(outputs, (tuple, list)):
        return tuple(to_torch(out).clone() for out in outputs)
    return to_torch(outputs).clone()


def call(op, kernel: Callable, *args):
    """rlpipe's op `op` on `args`; on TorchTPU tensors, `kernel` as a TorchTPU op instead. Inside a compiled graph
    that op must already exist (`register_torchtpu_ops`): Dynamo cannot trace its registration."""
    if any(isinstance(arg, torch.Tensor) and arg.device.type == "tpu" for arg in args):
        if torch.compiler.is_compiling():
            tpu_op = _TORCHTPU_OPS.get(kernel)
            if tpu_op is None:
                raise RuntimeError(
                    f"the TorchTPU op of {kernel.__module__}.{kernel.__name__} is not registered; "
                    "call rlpipe.kernels.register_torchtpu_ops() before compiling code that runs it"
                )
        else:
            tpu_op = torchtpu_op(kernel)
        return tpu_op(*args, False)
    return op(*args)


_AUTOGRAD: dict[Callable, tuple[Callable, Callable]] = {}
# Every kernel `call` may run as a TorchTPU op (forward and backward passes), and the ops made of them so far: a
# plain dict, which a compiled graph reads like any other global, where a cached registration function would be
# traced into (and stop a `fullgraph` compile at its warning filter).
_KERNELS: list[Callable] = []
_TORCHTPU_OPS: dict[Callable, Callable] = {}


def with_autograd(op, kernel: Callable, backward: Callable, setup_context: Callable, backward_kernel: Callable) -> None:
    """Differentiate rlpipe's op `op` with `backward`, and `kernel`'s TorchTPU op the same way once it is made;
    `backward_kernel` is the kernel `backward` runs."""
    op.register_autograd(backward, setup_context=setup_context)
    _AUTOGRAD[kernel] = (backward, setup_context)
    _KERNELS.extend((kernel, backward_kernel))


def register_torchtpu_ops() -> None:
    """Make every kernel's TorchTPU op now, before a step on `tpu` tensors is traced (once per process)."""
    for kernel in _KERNELS:
        torchtpu_op(kernel)


def torchtpu_op(kernel: Callable):
    """`kernel` registered as the TorchTPU op `rlpipe_tpu::<module>_<name>` (once per process). `kernel`'s
    annotations are what the bridge builds the op's schema from: tensors (annotated `torch.Tensor`, the op's own
    types; the function itself sees jax arrays) and static scalars."""
    op = _TORCHTPU_OPS.get(kernel)
    if op is not None:
        return op
    import torch_tpu  # noqa: F401  (adds torch.tpu)

    name = f"rlpipe_tpu::{kernel.__module__.rsplit('.', 1)[-1]}_{kernel.__name__.strip('_')}"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*jax_op is experimental")
        op = torch.tpu.pallas.jax_op(name, kernel)
    if kernel in _AUTOGRAD:  # rlpipe's op's autograd, past the trailing `interpret` input
        backward, setup_context = _AUTOGRAD[kernel]
        op.register_autograd(
            lambda ctx, *grads: (*backward(ctx, *grads), None),
            setup_context=lambda ctx, inputs, output: setup_context(ctx, inputs[:-1], output),
        )
    _TORCHTPU_OPS[kernel] = op
    return op


def call_experimental(op: Callable, *args, **kwargs):
    """A TorchTPU op marked experimental (`torch.tpu.ops.*`), without the warning it gives on every eager call; under
    torch.compile it does not warn, and dynamo cannot trace a warning filter."""
    if torch.compiler.is_compiling():
        return op(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is experimental")
        return op(*args, **kwargs)
