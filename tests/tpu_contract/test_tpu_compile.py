"""TPU kernels compiled — not only lowered — for a TPU generation on a host without one (bench/tpu_compile.py: JAX's
compile-only topology and libtpu's compiler, Mosaic included), at the Qwen3-30B-A3B recipe's learner shapes: each
kernel kind's first case, forward and backward, compiles, and the compiler reports the VMEM its Mosaic kernel takes.
v6e only by default; v5e and v5p are opt-in (-m slow), as `python bench/tpu_compile.py` covers them."""

from __future__ import annotations

import pytest

from rlpipe.bench import tpu_compile

MODEL = "qwen3-30b-a3b"  # the recipe with every kernel kind (its experts too) and the fewer tokens per pass
OTHER_CHIPS = [pytest.param(chip, marks=pytest.mark.slow) for chip in tpu_compile.CHIPS if chip != "v6e"]


@pytest.fixture(scope="module")
def shapes() -> tpu_compile.ModelShapes:
    return tpu_compile.model_shapes(MODEL)


def test_the_shapes_come_from_the_recipe_and_the_model_config(shapes):
    # configs/qwen3-30b-a3b-v6e.yaml: 8 rows a pass, 256 prompt + 768 completion tokens in the 1024 bucket;
    # configs/models/Qwen3-30B-A3B.json: hidden 2048, 128 experts, 8 a token, expert intermediate 768.
    assert (shapes.rows, shapes.seq, shapes.hidden, shapes.vocab) == (8, 1024, 2048, 151936)
    assert (shapes.experts, shapes.experts_per_token, shapes.expert_intermediate) == (128, 8, 768)
    assert shapes.routed_rows == 8 * 1024 * 8


@pytest.mark.parametrize("chip", ["v6e", *OTHER_CHIPS])
@pytest.mark.parametrize("kind", list(tpu_compile.CASES))
def test_each_kernel_compiles_forward_and_backward_with_its_vmem_reported(kind, chip, shapes):
    cases = tpu_compile.CASES[kind](shapes)
    forward, backward = cases[0], cases[1]
    assert forward.kernel.endswith("fwd") and backward.kernel.endswith("bwd") and forward.shapes == backward.shapes
    devices = tpu_compile.topology_devices(chip)
    for case in (forward, backward):
        result = tpu_compile.compile_case(case, chip, devices, MODEL)
        assert result.compiled, f"{case.kernel} [{case.shapes}] on {chip}: {result.error}"
        # Every kind here runs a Mosaic kernel (ragged_dot: XLA's own), and the compiler gives it scoped VMEM.
        assert result.kernel_vmem and result.kernel_vmem > 0, case.kernel


def test_a_kernel_over_its_vmem_limit_fails_with_the_compilers_figures(shapes):
    """What the tool reports when a kernel does not compile: the compiler's one-line error with the VMEM it needed."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def copy(x_ref, out_ref):
        out_ref[...] = x_ref[...]

    def too_big(x):  # [2048, 2048] float32 blocks, double-buffered in and out: 64 MiB, over a 1 MiB limit
        block = pl.BlockSpec((2048, 2048), lambda i: (i, 0))
        return pl.pallas_call(
            copy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 2048,), in_specs=[block],
            out_specs=block, compiler_params=pltpu.CompilerParams(vmem_limit_bytes=2**20),
        )(x)

    case = tpu_compile.Case("copy", "4096 x 2048", too_big, (jax.ShapeDtypeStruct((4096, 2048), jnp.float32),))
    result = tpu_compile.compile_case(case, "v6e")
    assert not result.compiled and result.kernel_vmem is None
    assert "\n" not in result.error and "vmem" in result.error.lower(), result.error
