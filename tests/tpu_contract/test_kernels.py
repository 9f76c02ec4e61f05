"""rlpipe's Pallas kernels through TorchTPU's own bridge to JAX kernels (`torch.tpu.pallas.jax_op`), on a host
without a TPU: every kernel registers as a TorchTPU op, and its fake (shape) implementation — which exports the JAX
function for TPU, lowering each Pallas kernel to Mosaic for the chip generation named — gives the shapes and dtypes
rlpipe's own ops declare. What this cannot show without a chip: the kernels compiling and running on the TPU."""

from __future__ import annotations

import jax
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from rlpipe.kernels import attention, gmm, logprob, rmsnorm
from rlpipe.kernels._jax import torchtpu_op

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _no_metadata_server(monkeypatch):
    """TorchTPU's ops on (fake) `tpu` tensors look for the chip through libtpu, which without this asks the GCE
    metadata server, retrying for minutes where none answers."""
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")


def _rms_norm():
    x, weight = torch.empty(300, 256, dtype=BF16), torch.empty(256, dtype=BF16)
    out = torch.ops.rlpipe.pallas_rms_norm(x, weight, 1e-6)
    return [
        (rmsnorm._forward, (x, weight, 1e-6), out),
        (rmsnorm._backward_pass, (x, weight, out, 1e-6),
         torch.ops.rlpipe.pallas_rms_norm_backward(x, weight, out, 1e-6)),
    ]


def _attention(window: int):
    q = torch.empty(1, 4, 256, 128, dtype=BF16)
    k, v = torch.empty(1, 2, 256, 128, dtype=BF16), torch.empty(1, 2, 256, 128, dtype=BF16)
    documents = torch.empty(1, 256, dtype=torch.int32)
    out = torch.ops.rlpipe.splash_attention(q, k, v, documents, window)
    grads = torch.ops.rlpipe.splash_attention_backward(q, k, v, documents, out, window)
    return [
        (attention._forward, (q, k, v, documents, window), out),
        (attention._backward_pass, (q, k, v, documents, out, window), grads),
    ]


def _grouped_matmul():
    # 200 rows: megablox's 128-row tiles with a ragged last one, which rlpipe pads to a whole tile.
    x, weights = torch.empty(200, 256, dtype=BF16), torch.empty(4, 256, 512, dtype=BF16)
    group_sizes = torch.empty(4, dtype=torch.int32)
    out = torch.ops.rlpipe.pallas_grouped_matmul(x, weights, group_sizes)
    grads = torch.ops.rlpipe.pallas_grouped_matmul_backward(x, weights, group_sizes, out)
    return [
        (gmm._forward, (x, weights, group_sizes), out),
        (gmm._backward_pass, (x, weights, group_sizes, out), grads),
    ]


def _linear_logprob():
    hidden, weight = torch.empty(128, 256, dtype=BF16), torch.empty(1024, 256, dtype=BF16)
    targets = torch.empty(128, dtype=torch.int32)
    outputs = torch.ops.rlpipe.pallas_linear_logprob(hidden, weight, targets, 1.0)
    grads = torch.ops.rlpipe.pallas_linear_logprob_backward(hidden, weight, targets, outputs[2], outputs[0], 1.0)
    return [
        (logprob._forward, (hidden, weight, targets, 1.0), outputs),
        (logprob._backward_pass, (hidden, weight, targets, outputs[2], outputs[0], 1.0), grads),
    ]


CASES = {
    "rmsnorm": _rms_norm,
    "attention": lambda: _attention(0),
    "attention-window": lambda: _attention(64),
    "grouped-matmul": _grouped_matmul,
    "logprob": _linear_logprob,
}


def _target(device_kind: str):
    """Lower for `device_kind` on a host without one, as torch_tpu's own kernels do when exported off TPU."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v5p", "TPU v6 lite"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_kernel_is_a_torchtpu_op_that_lowers_for_the_chip(case, device_kind):
    with FakeTensorMode(), _target(device_kind):
        for kernel, args, expected in CASES[case]():
            op = torchtpu_op(kernel)
            schema = op._opoverload._schema
            assert schema.name.startswith("rlpipe_tpu::") and schema.arguments[-1].name == "interpret_mode"
            result = op(*args, False)  # the fake implementation: jax.export for TPU, so Mosaic lowers every kernel
            results = result if isinstance(result, (tuple, list)) else (result,)
            expected = expected if isinstance(expected, (tuple, list)) else (expected,)
            assert [(r.shape, r.dtype) for r in results] == [(e.shape, e.dtype) for e in expected], kernel.__qualname__


def test_the_bridge_is_the_documented_public_entry_point():
    import torch_tpu  # noqa: F401

    assert torchtpu_op(rmsnorm._forward) is torchtpu_op(rmsnorm._forward)  # registered once per process
    assert torch.tpu.pallas.jax_op.__module__ == "torch_tpu._internal.pallas.pallas"


def _rms_norm_with_three_row_blocks(
    x: torch.Tensor, weight: torch.Tensor, eps: float, interpret_mode: bool
) -> torch.Tensor:
    return rmsnorm._pallas_functions(eps, 3, interpret_mode)[0](x, weight)


def test_a_block_shape_the_chip_cannot_take_fails_the_lowering():
    """The check above is Mosaic's own: rows in blocks of 3 (not a multiple of 8) are refused for TPU, while the
    same kernel runs interpreted on the host."""
    x, weight = torch.randn(300, 128), torch.ones(128)
    arrays = jax.numpy.asarray(x.numpy()), jax.numpy.asarray(weight.numpy())
    interpreted = _rms_norm_with_three_row_blocks(*arrays, 1e-6, True)
    assert interpreted.shape == (300, 128)
    with FakeTensorMode(), _target("TPU v6 lite"), pytest.raises(ValueError, match="block shape"):
        torchtpu_op(_rms_norm_with_three_row_blocks)(torch.empty(300, 128), torch.empty(128), 1e-6, False)


def _model_calls(device):
    """Each kernel as the models call it (`model.kernels.* = pallas`), on `device`: (name, call)."""
    def tensor(*shape):
        return torch.randn(*shape, dtype=BF16, device=device)

    sizes = torch.tensor([32, 0, 96, 0], dtype=torch.int32, device=device)
    targets = torch.randint(0, 512, (64,), device=device)
    return [
        ("rmsnorm", lambda: rmsnorm.rms_norm(tensor(64, 128), tensor(128), 1e-6, impl="pallas")),
        ("attention", lambda: attention.document_attention(
            tensor(1, 4, 128, 64), tensor(1, 2, 128, 64), tensor(1, 2, 128, 64),
            torch.zeros(128, dtype=torch.int32, device=device), impl="pallas")),
        ("gmm", lambda: gmm.grouped_matmul(tensor(128, 256), tensor(4, 256, 256), sizes, impl="pallas")),
        ("logprob", lambda: logprob.linear_logprob(tensor(64, 128), tensor(512, 128), targets, impl="pallas")[0]),
    ]


class _Recorder:
    """The ops dispatched inside it."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.add(func.name())
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def test_the_models_kernels_on_tpu_tensors_run_as_torchtpu_ops(tpu_device_name):
    """On `tpu` tensors (here fake ones, through which only shapes flow) every kernel the models call is the
    TorchTPU op, not rlpipe's DLPack op, so a compiled step holds ops TorchTPU knows."""
    with FakeTensorMode(), _target("TPU v6 lite"):
        for name, model_call in _model_calls("tpu"):
            with _Recorder() as recorder:
                out = model_call()
            # The grouped matmul is TorchTPU's own op there (see the test below), the others rlpipe's kernels.
            expected = "tpu::_ragged_dot" if name == "gmm" else f"rlpipe_tpu::{name}_forward"
            assert expected in recorder.ops, name
            assert not any(op.startswith("rlpipe::") for op in recorder.ops), recorder.ops
            assert out.device.type == "tpu"


def test_the_grouped_matmul_on_tpu_tensors_is_torchtpus_ragged_dot(tpu_device_name):
    """On `tpu` tensors `grouped_matmul(impl="pallas")` is `torch.tpu.ops.ragged_dot`: x [M, K], the weights
    [G, K, N] (as the experts pass them, a transposed view) and the group sizes [G] as int32 (the models count them
    in int64), in the order of the op's schema, giving [M, N] in x's dtype on the device. TorchTPU differentiates
    the op itself (its autograd kernel for `tpu`), in x and the weights. Off a chip only the op's meta kernel runs,
    which checks no shapes or dtypes: the recorded arguments are what is checked."""
    import torch_tpu  # noqa: F401

    ragged_dot = torch.ops.tpu._ragged_dot.default
    assert [arg.name for arg in ragged_dot._schema.arguments] == ["lhs", "rhs", "group_sizes"]
    assert torch._C._dispatch_has_kernel_for_dispatch_key(ragged_dot.name(), "AutogradPrivateUse1")

    calls = []

    class Arguments(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((func, args))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        x = torch.empty(200, 256, dtype=BF16, device="tpu").requires_grad_()
        stored = torch.empty(4, 512, 256, dtype=BF16, device="tpu").requires_grad_()  # [E, out, in], as stored
        sizes = torch.tensor([50, 0, 150, 0], device="tpu")
        with Arguments():
            out = gmm.grouped_matmul(x, stored.transpose(1, 2), sizes, impl="pallas")
    [(lhs, rhs, group_sizes)] = [args for func, args in calls if func is ragged_dot]
    assert (lhs.shape, lhs.dtype) == ((200, 256), BF16)
    assert (rhs.shape, rhs.dtype) == ((4, 256, 512), BF16)
    assert (group_sizes.shape, group_sizes.dtype) == ((4,), torch.int32)
    assert (out.shape, out.dtype, out.device.type) == ((200, 512), BF16, "tpu")
    assert [next_fn is not None for next_fn, _ in out.grad_fn.next_functions] == [True, True, False]


def test_a_compiled_grouped_matmul_on_tpu_tensors_holds_the_ragged_dot(tpu_device_name):
    """Traced whole by dynamo (no graph break), the call is one TorchTPU ragged dot in the graph."""
    targets = []

    def backend(graph_module, example_inputs):
        targets.extend(node.target for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module

    compiled = torch.compile(
        lambda x, w, sizes: gmm.grouped_matmul(x, w, sizes, impl="pallas"), backend=backend, fullgraph=True
    )
    with FakeTensorMode():
        x, weights = torch.empty(64, 128, dtype=BF16, device="tpu"), torch.empty(4, 128, 256, dtype=BF16, device="tpu")
        assert compiled(x, weights, torch.empty(4, dtype=torch.int64, device="tpu")).shape == (64, 256)
    assert targets == [torch.ops.tpu._ragged_dot], targets


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_torchtpu_op_is_differentiated_as_rlpipes_op_is(case):
    """The TorchTPU ops take rlpipe's ops' autograd. (Run on the host's fake tensors: torch's autograd engine has
    no `tpu` device without a chip; which backward op runs there follows the same rule as the forward above.)"""
    with FakeTensorMode(), _target("TPU v6 lite"):
        (kernel, args, _), (_, _, expected_grads) = CASES[case]()
        leaves = [a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args]
        result = torchtpu_op(kernel)(*leaves, False)
        first = result[0] if isinstance(result, (tuple, list)) else result
        with _Recorder() as recorder:
            first.float().sum().backward()
        grads = [leaf.grad for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        assert [(g.shape, g.dtype) for g in grads] == [(e.shape, e.dtype) for e in expected_grads]
        assert any(op.startswith("rlpipe::") and "backward" in op for op in recorder.ops), recorder.ops


@pytest.mark.parametrize("window", [None, 64])
def test_unpacked_attention_on_tpu_tensors_is_torchtpus_splash_op(tpu_device_name, window):
    """Rows without segment ids take TorchTPU's own splash op (`torch.tpu.ops.splash_sdpa`), whose backward keeps
    the forward's residuals; the length is padded to whole blocks and the window converted to its convention."""
    import torch_tpu  # noqa: F401

    calls = []
    splash_sdpa = torch.tpu.ops.splash_sdpa

    def recording(q, k, v, **kwargs):
        calls.append((q.shape, k.shape, kwargs))
        return splash_sdpa(q, k, v, **kwargs)

    torch.tpu.ops.splash_sdpa = recording
    try:
        with FakeTensorMode(), _target("TPU v6 lite"):
            q = torch.empty(2, 4, 200, 128, dtype=BF16, device="tpu")
            k = v = torch.empty(2, 2, 200, 128, dtype=BF16, device="tpu")
            with _Recorder() as recorder:
                out = attention.causal_attention(q, k, v, window, impl="pallas")
    finally:
        torch.tpu.ops.splash_sdpa = splash_sdpa
    assert out.shape == q.shape and out.device.type == "tpu"
    (q_shape, k_shape, kwargs), = calls
    assert q_shape[2] == k_shape[2] == 256 and kwargs["block_q"] == kwargs["block_kv"] == 256
    assert kwargs["enable_gqa"] and kwargs["local_window_size"] == (None if window is None else window - 1)
    assert kwargs["scale"] == pytest.approx(128**-0.5)
    assert any(op.startswith("pallas::") for op in recorder.ops), recorder.ops
    assert not any(op.startswith("rlpipe") for op in recorder.ops), recorder.ops
