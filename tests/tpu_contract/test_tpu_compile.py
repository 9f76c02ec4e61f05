"""TPU kernels compiled — not only lowered — for a TPU generation on a host without one (rlpipe/tpu/kernels.py:
JAX's compile-only topology and libtpu's compiler, Mosaic included), at the Qwen3-30B-A3B recipe's learner shapes: every
case of every kernel kind, forward and backward, compiles, and the compiler reports the VMEM its Mosaic kernel takes;
so does the kernel TorchTPU's own `splash_sdpa` runs for unpacked rows, with the block sizes rlpipe hands it.
v6e only by default; v5e and v5p are opt-in (-m slow), as `python bench/tpu_compile.py` covers them."""

from __future__ import annotations

import pytest

from rlpipe.bench.tpu_compile import model_shapes
from rlpipe.tpu.kernels import CASES, CHIPS, Case, ModelShapes, compile_case, topology_devices

MODEL = "qwen3-30b-a3b"  # the recipe with every kernel kind (its experts too) and the fewer tokens per pass
OTHER_CHIPS = [pytest.param(chip, marks=pytest.mark.slow) for chip in CHIPS if chip != "v6e"]


@pytest.fixture(scope="module")
def shapes() -> ModelShapes:
    return model_shapes(MODEL)


def _compiles(case: Case, chip: str, devices) -> None:
    result = compile_case(case, chip, devices, MODEL)
    assert result.compiled, f"{case.kernel} [{case.shapes}] on {chip}: {result.error}"
    # Every case here runs a Mosaic kernel (ragged_dot: XLA's own), and the compiler gives it scoped VMEM.
    assert result.kernel_vmem and result.kernel_vmem > 0, case.kernel


def test_the_shapes_come_from_the_recipe_and_the_model_config(shapes):
    # configs/qwen3-30b-a3b-v6e.yaml: 8 rows a pass, 256 prompt + 768 completion tokens in the 1024 bucket;
    # configs/models/Qwen3-30B-A3B.json: hidden 2048, 128 experts, 8 a token, expert intermediate 768.
    assert (shapes.rows, shapes.seq, shapes.hidden, shapes.vocab) == (8, 1024, 2048, 151936)
    assert (shapes.experts, shapes.experts_per_token, shapes.expert_intermediate) == (128, 8, 768)
    assert shapes.routed_rows == 8 * 1024 * 8


@pytest.mark.parametrize("chip", ["v6e", *OTHER_CHIPS])
@pytest.mark.parametrize("kind", list(CASES))
def test_every_case_of_each_kernel_compiles_forward_and_backward_with_its_vmem_reported(kind, chip, shapes):
    """All of a kind's cases, not its first: splash's packed row with segment ids (what the recipes run) as well as
    its unpacked rows, and each expert matmul (gate+up, down) of the grouped kernels."""
    cases = CASES[kind](shapes)
    forwards, backwards = cases[0::2], cases[1::2]
    assert forwards and len(forwards) == len(backwards)
    for forward, backward in zip(forwards, backwards):
        assert forward.kernel.endswith(" fwd") and backward.kernel == forward.kernel[:-3] + "bwd"
        assert forward.shapes == backward.shapes
    if kind == "splash":
        assert [case.kernel for case in forwards] == ["splash rows fwd", "splash packed fwd"]
    devices = topology_devices(chip)
    for case in cases:
        _compiles(case, chip, devices)


def _splash_sdpa_arguments(shapes: ModelShapes, window: int | None) -> tuple[dict, tuple]:
    """What rlpipe's wrapper for unpacked rows (attention._torchtpu_splash) makes TorchTPU's `splash_sdpa` build its
    kernel from: the keyword arguments of torch_tpu's `_make_splash_attention_fn` and the q, k, v shapes its
    forward takes, read by running the real `splash_sdpa` on meta tensors up to the point where it builds the op."""
    import torch
    import torch_tpu  # noqa: F401  (torch.tpu.ops)
    from torch_tpu._internal.ops import splash_attention as torchtpu_splash

    from rlpipe.kernels import attention

    built = {}

    class Built(Exception):
        pass

    def record(**splash_args):
        built["args"] = splash_args
        raise Built

    def record_inputs(q, k, v, **kwargs):
        built["shapes"] = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        return splash_sdpa(q, k, v, **kwargs)

    splash_sdpa, get_names = torch.tpu.ops.splash_sdpa, torchtpu_splash._get_splash_op_names
    torch.tpu.ops.splash_sdpa, torchtpu_splash._get_splash_op_names = record_inputs, record
    try:
        q = torch.empty(shapes.rows, shapes.heads, shapes.seq, shapes.head_dim, dtype=torch.bfloat16, device="meta")
        kv = torch.empty(shapes.rows, shapes.kv_heads, shapes.seq, shapes.head_dim, dtype=torch.bfloat16,
                         device="meta")
        with pytest.raises(Built):
            attention._torchtpu_splash(q, kv, kv, window)
    finally:
        torch.tpu.ops.splash_sdpa, torchtpu_splash._get_splash_op_names = splash_sdpa, get_names
    return built["args"], built["shapes"]


def _splash_sdpa_cases(shapes: ModelShapes, window: int | None) -> list[Case]:
    """The forward (out, logsumexp) and the residual-fed backward TorchTPU's splash op runs, as torch_tpu builds
    them from `_splash_sdpa_arguments`, with the arrays splash_sdpa hands them (kv heads repeated to q's)."""
    import jax
    import jax.numpy as jnp
    from torch_tpu._internal.ops import splash_attention as torchtpu_splash

    args, (q_shape, _, _) = _splash_sdpa_arguments(shapes, window)
    forward, backward = torchtpu_splash._make_splash_attention_fn(**args)
    batch, heads, length, dim = q_shape
    q = jax.ShapeDtypeStruct(q_shape, jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, args["n_kv_heads"], length, dim), jnp.bfloat16)
    out, lse = jax.eval_shape(forward, q, kv, kv)
    described = f"{batch} x {length} tokens, {heads} q / {args['n_kv_heads']} kv heads x {dim}, block {args['block_q']}"
    return [Case("splash_sdpa fwd", described, forward, (q, kv, kv)),
            Case("splash_sdpa bwd", described, backward, (q, kv, kv, out, lse, out))]


@pytest.mark.parametrize("chip", ["v6e", *OTHER_CHIPS])
def test_torchtpus_splash_op_compiles_with_the_block_sizes_rlpipe_passes(chip, shapes):
    """Unpacked rows on `tpu` tensors take `torch.tpu.ops.splash_sdpa`, which builds JAX's splash kernel itself
    (torch_tpu/_internal/ops/splash_attention.py) from rlpipe's block sizes: a block the chip cannot take fails
    here, at compile time, rather than in the first step on a slice."""
    args, (q_shape, k_shape, _) = _splash_sdpa_arguments(shapes, None)
    # The recipe's rows reached the op whole (1024 tokens: no padding), with rlpipe's blocks and its GQA flag.
    assert q_shape == (shapes.rows, shapes.heads, shapes.seq, shapes.head_dim)
    assert k_shape == (shapes.rows, shapes.kv_heads, shapes.seq, shapes.head_dim)
    assert (args["seq_len"], args["n_heads"], args["n_kv_heads"]) == (shapes.seq, shapes.heads, shapes.heads)
    assert args["is_causal"] and args["local_window_size"] is None
    devices = topology_devices(chip)
    for case in _splash_sdpa_cases(shapes, None):
        _compiles(case, chip, devices)


def test_a_kernel_over_its_vmem_limit_fails_with_the_compilers_figures():
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

    case = Case("copy", "4096 x 2048", too_big, (jax.ShapeDtypeStruct((4096, 2048), jnp.float32),))
    result = compile_case(case, "v6e")
    assert not result.compiled and result.kernel_vmem is None
    assert "\n" not in result.error and "vmem" in result.error.lower(), result.error
