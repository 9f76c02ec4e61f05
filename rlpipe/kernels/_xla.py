"""Which implementation a `pallas` kernel choice runs as on a PyTorch/XLA device.

rlpipe's own Pallas bridges hand tensors to JAX by DLPack and run the kernel there: on an xla tensor that would
leave the XLA program (a host sync per call, and the step no longer one program). Inside an XLA program a Pallas
kernel has to be an XLA custom call, which is what torch_xla's Pallas bridge (`torch_xla.experimental.
custom_kernel`) builds, for TPU only (it lowers to Mosaic) and for a few ops: flash attention and the grouped
matmul (megablox gmm). So on xla, `pallas` means torch_xla's kernel where it exists and the device is a TPU, and
the torch implementation everywhere else — on XLA's CPU client always.
"""

from __future__ import annotations

import functools


@functools.cache
def pallas_bridge_available() -> bool:
    """Whether torch_xla's Pallas bridge can run here: a TPU behind torch_xla, and jax for tracing the kernels."""
    try:
        import torch_xla.runtime as xr

        if xr.device_type() != "TPU":
            return False
        import jax  # noqa: F401  (torch_xla traces its Pallas kernels with jax)
        import torch_xla.experimental.custom_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def xla_kernel_routes(attention: str, rmsnorm: str, logprob: str) -> dict[str, str]:
    """What each op of `model.kernels` runs as on this process's xla device, in words (for reports)."""
    bridge = pallas_bridge_available()
    fallback = "torch reference (torch_xla's Pallas bridge needs a TPU)" if not bridge else None
    return {
        "attention": (
            "torch sdpa" if attention == "torch"
            else "torch_xla Pallas flash_attention (sliding-window layers: torch sdpa)" if bridge else f"{fallback}: sdpa"
        ),
        "rmsnorm": "torch" if rmsnorm == "torch" else "torch (torch_xla has no Pallas RMSNorm kernel)",
        "logprob": logprob if logprob != "pallas" else "chunked (torch_xla has no Pallas log-prob kernel)",
    }
