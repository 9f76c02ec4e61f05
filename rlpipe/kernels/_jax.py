"""Running JAX (Pallas) kernels on torch tensors.

Tensors cross by DLPack, so no bytes are copied on the way in or out (bf16 included). Off TPU the kernels run in
Pallas' interpret mode: the same kernel code and block specs, executed by XLA on the host, which is what the
parity tests check. jax is imported on first use, so the torch paths never pay for it.
"""

from __future__ import annotations

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
