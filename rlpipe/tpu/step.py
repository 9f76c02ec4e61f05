"""A TPU recipe's learner step, compiled by TorchTPU's own `tpu` backend on fake `tpu` tensors, on a host without a
chip.

The learner is rlpipe's own (`rlpipe.training.learner.Learner`) built from the recipe's sections: its model (the recipe's
config.json with its layers cut, every width, head, vocabulary and expert count kept), its kernels (splash attention
with segment ids on the packed row, TorchTPU's ragged dot for experts, rlpipe's log-prob and RMSNorm kernels through
TorchTPU's JAX bridge), SimpleFSDP over the recipe's learner ranks on a fake process group, its packed widths and
micro-batches. Its parameters are fake `tpu` tensors (FakeTensorMode, the PrivateUse1 device named `tpu`, a JAX
abstract mesh of the recipe's TPU generation for the kernels' lowering): shapes and dtypes flow, no byte is held, so
a recipe's real widths cost nothing.

How far it goes without a chip, and where it stops:
- Dynamo captures the step's forward and loss whole (`fullgraph`) and hands it to TorchTPU's backend, whose
  aot_autograd, split compiler and FX passes run; only `StaticCompiler._compile`, which converts the graph to
  StableHLO on placeholder tensors of real TPU storage and compiles it through the chip's PJRT client, needs a chip.
  It is replaced by a recorder (what the piece holds) whose artifact refuses to run (`NoChip`).
- The backward cannot be traced on fake `tpu` tensors: torch's autograd engine asks the `tpu` device guard for its
  device count, which TorchTPU answers from the PJRT client ("PjRt backend unavailable"), and the engine then crashes
  the process (SIGSEGV in `GraphTask::exec_post_processing`; reproduced by `autograd_grad_reproduction`). So the
  forward and loss compile without gradients, the update after the backward (global-norm clipping and AdamW over the
  sharded gradients, `GraphTrainStep.clip_and_update`) compiles as a graph of its own, and the backward's kernels are
  compiled for the chip by JAX's compile-only topologies (`rlpipe.tpu.kernels`). The whole step as one graph,
  backward included, is captured on CPU tensors by the lane's step capture.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

# jax device kinds of each TPU generation (as its compile-only topology reports them).
DEVICE_KINDS = {"v4": "TPU v4", "v5litepod": "TPU v5 lite", "v5p": "TPU v5p", "v6e": "TPU v6 lite"}
# A reproduction of where the step stops without a chip: torch.autograd.grad on a fake `tpu` tensor.
AUTOGRAD_GRAD_REPRODUCTION = """\
import torch
torch.utils.rename_privateuse1_backend("tpu")
import torch_tpu
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    x = torch.empty(4, 4, device="tpu", requires_grad=True)
    torch.autograd.grad((x * x).sum(), [x])
"""


class NoChip(RuntimeError):
    """A piece compiled up to the chip was asked to run."""


@dataclass
class Piece:
    """One program TorchTPU's split compiler handed on to be lowered for the chip."""

    ops: int
    collectives: list[str]
    kernels: dict[str, int]


@dataclass
class GraphReport:
    """What TorchTPU's backend did with one compiled function."""

    dynamo_graphs: int = 0
    graph_breaks: int = 0
    pieces: list[Piece] = field(default_factory=list)
    stopped_at_chip: bool = False

    @property
    def collectives(self) -> dict[str, int]:
        return dict(Counter(name for piece in self.pieces for name in piece.collectives))

    @property
    def kernels(self) -> dict[str, int]:
        total: Counter = Counter()
        for piece in self.pieces:
            total.update(piece.kernels)
        return dict(total)


@dataclass
class StepReport:
    """The recipe's step on fake `tpu` tensors: the forward and loss, and the update after the backward."""

    layers: int
    ranks: int
    packed_width: int | None
    micro_batches: int
    forward: GraphReport
    update: GraphReport


def _op_name(target) -> str:
    packet = getattr(target, "overloadpacket", target)
    namespace = getattr(packet, "_qualified_op_name", None)
    return namespace or getattr(packet, "__name__", str(packet))


# Op namespaces that are kernels of their own in a TorchTPU program: rlpipe's Pallas kernels through the bridge,
# TorchTPU's own ops (its ragged dot, splash).
_KERNEL_NAMESPACES = ("rlpipe_tpu::", "tpu::", "pallas::")


@contextlib.contextmanager
def _recording_tpu_backend(report: GraphReport):
    """TorchTPU's backend, with the lowering for the chip replaced by a record of each piece it was given."""
    from torch_tpu._internal.compile import compiler
    from torch_tpu._internal.compile.torch_tpu_compiled_executable import CompiledArtifact
    from torch_tpu._internal.distributed import collective_ops

    class ChiplessArtifact(CompiledArtifact):
        def __call__(self, *args, **kwargs):
            raise NoChip("this piece was compiled up to the chip and cannot run without one")

        def __reduce__(self):
            raise NoChip("a piece compiled up to the chip has nothing to save")

    def lower_for_chip(self, graph_module, example_inputs, *args, **kwargs):
        calls = [node.target for node in graph_module.graph.nodes
                 if node.op == "call_function" and node.target is not operator.getitem]
        report.pieces.append(Piece(
            ops=len(calls),
            collectives=[_op_name(t).rpartition("::")[2] for t in calls if collective_ops.is_collective_op(t)],
            kernels=dict(Counter(name for name in map(_op_name, calls) if name.startswith(_KERNEL_NAMESPACES))),
        ))
        return ChiplessArtifact()

    lower = compiler.StaticCompiler._compile
    compiler.StaticCompiler._compile = lower_for_chip
    try:
        yield
    finally:
        compiler.StaticCompiler._compile = lower


def compile_chipless(fn, report: GraphReport, *args):
    """`fn(*args)` compiled whole (`fullgraph`) by TorchTPU's `tpu` backend up to the chip; fills `report`."""
    from rlpipe.parallel.graph_trainer import _CompileCounter, _graph_break_count

    counter = _CompileCounter("tpu")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=False)
    breaks = _graph_break_count()
    with _recording_tpu_backend(report), torch._dynamo.config.patch(trace_autograd_ops=True):
        try:
            compiled(*args)
        except NoChip:
            report.stopped_at_chip = True
    report.dynamo_graphs = counter.graphs
    report.graph_breaks = _graph_break_count() - breaks


class ShapeOnlyWeights:
    """A checkpoint that holds shapes alone: each read is an uninitialised tensor (fake, under FakeTensorMode) of
    the rows asked for. Compiling a step needs no weight's value."""

    def __init__(self, path, model, dtype):
        self.shapes = {name: value.shape for name, value in model.state_dict().items()}
        self.dtype = dtype or torch.float32

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        shape = self.shapes[name]
        if rows is not None and len(shape):
            first, stop, _ = rows.indices(shape[0])
            shape = (max(0, stop - first), *shape[1:])
        return torch.empty(shape, dtype=self.dtype)


def cut_model_config(source: Path, layers: int, into: Path) -> Path:
    """A model folder holding `source` (a config.json) with its first `layers` decoder layers."""
    hf = json.loads(source.read_text())
    hf["num_hidden_layers"] = min(layers, hf["num_hidden_layers"])
    for key in ("layer_types",):  # per-layer lists follow the cut
        if isinstance(hf.get(key), list):
            hf[key] = hf[key][:layers]
    if isinstance(hf.get("mlp_only_layers"), list):
        hf["mlp_only_layers"] = [index for index in hf["mlp_only_layers"] if index < layers]
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_text(json.dumps(hf))
    return into


def name_tpu_device() -> None:
    """The `tpu` device name, which torch_tpu gives torch's PrivateUse1 device on a TPU host only."""
    from rlpipe.hardware.tpu_env import COLLECTIVES_IN_GRAPH

    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no GCE metadata server to wait for
    os.environ.update(COLLECTIVES_IN_GRAPH)  # as a learner rank's environment has it (read once per process)
    if torch._C._get_privateuse1_backend_name() != "tpu":
        torch.utils.rename_privateuse1_backend("tpu")


@contextlib.contextmanager
def fake_tpu(generation: str):
    """Fake `tpu` tensors on this host, and the JAX abstract mesh the kernels lower for (`generation`, e.g. v6e)."""
    name_tpu_device()
    import jax
    import torch_tpu  # noqa: F401  (the `tpu` device, its ops and compile backend)
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = jax.sharding.AbstractDevice(device_kind=DEVICE_KINDS[generation], num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)
    with FakeTensorMode(allow_non_fake_inputs=True), jax.sharding.use_abstract_mesh(mesh):
        yield


@contextlib.contextmanager
def fake_process_group(ranks: int):
    """A default process group of `ranks` ranks, this process rank 0, whose collectives carry no data (torch's
    fake backend, here for the `tpu` device too)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup
    from rlpipe.parallel.mesh import destroy_distributed

    name = "rlpipe_fake_tpu"
    if name not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            name, lambda common, options: FakeProcessGroup._create_internal(common.group_rank, common.group_size),
            extended_api=True, devices=["cpu", "tpu"],
        )
    dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=ranks)
    try:
        yield
    finally:
        destroy_distributed()


def full_rows_batch(cfg, pad_id: int = 0):
    """The recipe's largest step: every sample a whole prompt and a whole completion, each group's prompt its own
    and every completion its own (rows of the same tokens would pack as one)."""
    from rlpipe.types import TrainBatch

    rows, group = cfg.samples_per_step, cfg.rollout.group_size
    prompt, completion = cfg.data.max_prompt_tokens, cfg.rollout.max_tokens
    return TrainBatch.from_sequences(
        [[1 + row // group] * prompt for row in range(rows)], [[1 + row] * completion for row in range(rows)],
        [[-1.0] * completion] * rows, [1.0 if row % 2 else -1.0 for row in range(rows)], pad_id=pad_id,
    )


def compile_recipe_step(cfg, generation: str, layers: int = 2) -> StepReport:
    """The recipe `cfg`'s learner step on fake `tpu` tensors, rank 0 of its learner ranks, through TorchTPU's
    backend up to the chip (see the module docstring for what runs and where it stops)."""
    from rlpipe.training.learner import Learner
    from rlpipe.plan import architecture_source
    from rlpipe.parallel.mesh import make_mesh
    from rlpipe.types import LossInputs
    from rlpipe.weightsync.form import weight_form
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    ranks = cfg.learner.ranks
    with tempfile.TemporaryDirectory(prefix="rlpipe-step-") as folder, fake_tpu(generation):
        model_path = str(cut_model_config(architecture_source(cfg.model.path), layers, Path(folder)))
        learner = Learner(
            model_path, model=cfg.model, learner=cfg.learner, train=cfg.train, algo=cfg.algo,
            samples_per_step=cfg.samples_per_step, temperature=cfg.rollout.temperature,
            max_tokens=cfg.rollout.max_tokens, seed=cfg.run.seed, rank=0, world_size=ranks,
            form=weight_form(cfg, model_path), weights_from=ShapeOnlyWeights,
        )
        engine = learner.engine
        strategy = engine.strategy

        def join_fake_group(master_addr: str, master_port: int) -> None:
            with unset_fake_temporarily():  # the mesh's rank layout is data, not a shape
                strategy.mesh = make_mesh(ranks, "tpu")

        with fake_process_group(ranks):
            strategy.join = join_fake_group
            learner.join_process_group("127.0.0.1", 0)
            step = engine.ready()
            with unset_fake_temporarily():  # the batch and its micro-batches are host data, as in a run
                batch = full_rows_batch(cfg)
                rows = batch.slice(0, len(batch) // learner.optimizer_steps_per_batch)
                inputs = LossInputs(
                    mask=rows.completion_mask, advantages=rows.advantages, rollout_logprobs=rows.rollout_logprobs,
                    total_tokens=rows.completion_mask.sum().float(), total_seqs=torch.tensor(float(len(rows))),
                    # A teacher's log-probs are a tensor like the rollout's: the compiled program is the same.
                    teacher_logprobs=rows.rollout_logprobs if cfg.algo.distill_teacher is not None else None,
                )
                shares = engine._micro_batch_shares(0, len(rows))
                host_micro_batches = engine.forward.micro_batches(rows, inputs, shares, 0)
            micro_batches = [strategy.place(micro) for micro in host_micro_batches]

            def forward_and_loss(micro_batches):
                return [engine._micro_loss(engine.model, micro)[0] for micro in micro_batches]

            forward = GraphReport()
            with torch.no_grad():
                compile_chipless(forward_and_loss, forward, micro_batches)
            update = GraphReport()
            grads = [torch.zeros_like(param) for param in step.params]
            lr = torch.tensor(cfg.train.lr, dtype=torch.float32, device="tpu")
            compile_chipless(step.clip_and_update, update, grads, lr)
    layout = getattr(host_micro_batches[0], "layout", None) if host_micro_batches else None
    return StepReport(
        layers=min(layers, json.loads(architecture_source(cfg.model.path).read_text())["num_hidden_layers"]),
        ranks=ranks, packed_width=None if layout is None else layout.width, micro_batches=len(micro_batches),
        forward=forward, update=update,
    )
