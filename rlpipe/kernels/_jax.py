"""Running JAX (Pallas) kernels on torch tensors.

Each kernel is one JAX function of arrays, then static scalars, then `interpret` (`run_kernel`). On a TorchTPU
tensor it becomes a torch op through TorchTPU's own bridge to JAX kernels (`torch.tpu.pallas.jax_op`), which exports
the function for TPU (Mosaic) and runs it on the chip, inside a compiled graph too. Elsewhere tensors cross by DLPack,
so no bytes are copied on the way in or out (bf16 included), and off TPU the kernels run in Pallas' interpret mode:
the same kernel code and block specs, executed by XLA on the host, which is what the parity tests check. jax is
imported on first use, so the torch paths never pay for it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch


def jax_modules():
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    return jax, jnp, pl


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
    """`kernel(*args, interpret)` on torch tensors, returning a tensor or a tuple of them.

    `kernel`'s annotations are what TorchTPU's bridge reads to build the op's schema: tensors (annotated
    `torch.Tensor`, the op's own types; the function itself sees jax arrays) and static scalars."""
    if any(isinstance(arg, torch.Tensor) and arg.device.type == "tpu" for arg in args):
        return torchtpu_op(kernel)(*args, False)
    outputs = kernel(*(to_jax(arg) if isinstance(arg, torch.Tensor) else arg for arg in args), interpret())
    if isinstance(outputs, (tuple, list)):
        return tuple(to_torch(out).clone() for out in outputs)
    return to_torch(outputs).clone()


@functools.cache
def torchtpu_op(kernel: Callable):
    """`kernel` registered as the TorchTPU op `rlpipe_tpu::<module>_<name>` (once per process)."""
    import torch_tpu  # noqa: F401  (adds torch.tpu)

    name = f"rlpipe_tpu::{kernel.__module__.rsplit('.', 1)[-1]}_{kernel.__name__.strip('_')}"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*jax_op is experimental")
        return torch.tpu.pallas.jax_op(name, kernel)
