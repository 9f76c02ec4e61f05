"""The learner's whole train step captured for TorchTPU's `tpu` compile backend on a host without a TPU.

Run as a script (`python -m tests.tpu_contract.step_capture VALUE[,VALUE] FAMILY=MODEL_PATH ...`) it prints one JSON
line per value and model: what Dynamo and TorchTPU's backend did with one GRPO optimizer step of rlpipe's learner
with TORCH_TPU_INTERNAL_MATERIALIZE_COLLECTIVE_TENSORS at that value. torch_tpu reads the flag once per process
(`env.get_bool_env_once`), so each value runs in a process of its own, forked after the imports (which read no
such flag): the step's first compile reads it there.

How the step gets there without a chip:
- The learner is rlpipe's own (`rlpipe.training.learner.Learner`, `learner.graph: true`, 2 ranks, this process rank 0). Its
  process group is torch's fake one (FakeStore + the "fake" backend: collectives are issued but carry no data),
  formed where the learner would form its real group, and the parameters are SimpleFSDP DTensors over a 2-rank mesh.
- Its compile backend is the tpu row's (`rlpipe.hardware.device.backend("tpu").compile_backend`), looked up by that name in
  Dynamo's registry, so TorchTPU's `TpuBackend` runs: its pre-grad passes, `aot_autograd` with its own settings,
  then its `SplitCompiler`, which cuts the graph at collectives and hands each piece to its `StaticCompiler`.
- `StaticCompiler.__call__` runs its FX passes on the piece and then calls `StaticCompiler._compile`, which lowers
  the piece to StableHLO and compiles it with PJRT for the chip. Only that last method is replaced here: it records
  the piece it was given and returns an artifact that refuses to run. The first time the step calls one, the step
  stops with `NoChip`; everything before it (capture, partitioning, passes) ran as on a TPU host.
The learner's tensors are CPU tensors; Dynamo traces them as fake tensors, and TorchTPU's backend only ever sees
those. Fake tensors on the `tpu` device itself (PrivateUse1 renamed, as the lane's `tpu_device_name` fixture does)
carry the forward but not the step: without a chip, `torch.autograd.grad` on them crashes the process (SIGSEGV in
the autograd engine's device thread, right after torch_tpu's `TpuDeviceGuardImpl::deviceCount` reports "PjRt backend
unavailable"), and the step differentiates with `autograd.grad` while Dynamo traces it.
"""

from __future__ import annotations

import json
import operator
import os
import sys
import traceback
from collections import Counter


class NoChip(RuntimeError):
    """A piece compiled for the chip was asked to run."""


def _collectives(graph_module) -> list[str]:
    """The collectives of an FX graph in order, by op name (wait_tensor is not one: it ends a collective)."""
    from torch_tpu._internal.distributed import collective_ops

    names = []
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and collective_ops.is_collective_op(node.target):
            packet = getattr(node.target, "overloadpacket", node.target)
            names.append(getattr(packet, "__name__", str(packet)))
    return names


# The packed row's width in every capture: no dimension of the tiny models, so an [.., W, W] value in the traced
# graphs can only be attention over the whole row (the mask, its scores).
PACKED_WIDTH = 48
# Model settings a capture can add by its family name's suffix.
VARIANTS = {"": [], "+splash": ["model.kernels.attention=pallas"]}


def capture(model_path: str, overrides: list[str]) -> dict:
    """One GRPO optimizer step of a 2-rank graph learner on `model_path`, compiled by TorchTPU's backend up to the
    chip. Returns what happened: `dynamo_graphs` and `graph_breaks` (the step's own counts), `tpu_backend_calls`,
    `aot_compiles` (forward or backward, one per graph AOT autograd handed on), `splits` (per split: the flag's value,
    the collectives of the graph it was given and how many pieces it made), `pieces` (per piece lowered: its
    collectives, its op count, its inputs and outputs), `row_squares` (values of the forward and backward graphs
    shaped [.., W, W] over the packed row's width W), `trainable_parameters`, and `stopped_at_chip`."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch_tpu._internal.compile import _backend, compiler, split_compiler
    from torch_tpu._internal.compile.torch_tpu_compiled_executable import CompiledArtifact

    from rlpipe.config import load_config
    from rlpipe.hardware.device import backend
    from rlpipe.training.learner import Learner
    from rlpipe.parallel.mesh import make_mesh
    from rlpipe.types import TrainBatch

    record: dict = {
        "dynamo_graphs": 0, "tpu_backend_calls": 0, "aot_compiles": [], "splits": [], "pieces": [], "row_squares": 0
    }

    # What each stage receives, recorded on the way through (every original is still called, except _compile).
    tpu_backend = _backend.TpuBackend.__call__
    split_graph = split_compiler.SplitCompiler._compile_graph
    lower = compiler.StaticCompiler._compile

    def backend_call(self, graph_module, example_inputs, **kwargs):
        record["tpu_backend_calls"] += 1
        return tpu_backend(self, graph_module, example_inputs, **kwargs)

    def split_call(self, graph_module, example_inputs, is_fwd=True, materialize_collectives=True, **kwargs):
        record["aot_compiles"].append("forward" if is_fwd else "backward")
        collectives = _collectives(graph_module)
        record["row_squares"] += sum(
            1
            for node in graph_module.graph.nodes
            if isinstance(value := node.meta.get("val"), torch.Tensor)
            and value.dim() >= 2
            and value.shape[-2:] == (PACKED_WIDTH, PACKED_WIDTH)
        )
        executable = split_graph(
            self, graph_module, example_inputs, is_fwd, materialize_collectives=materialize_collectives, **kwargs
        )
        record["splits"].append(
            {
                "materialize_collectives": materialize_collectives,
                "collectives": dict(Counter(collectives)),
                "collective_count": len(collectives),
                "pieces": len(executable.compiled_executables),
            }
        )
        return executable

    class ChiplessArtifact(CompiledArtifact):
        def __call__(self, *args, **kwargs):
            raise NoChip("this piece was compiled up to the chip and cannot run without one")

        def __reduce__(self):
            raise NoChip("a piece compiled up to the chip has nothing to save")

    def lower_for_chip(self, graph_module, example_inputs, is_fwd=True, *args, **kwargs):
        collectives = _collectives(graph_module)
        compute = sum(
            1 for node in graph_module.graph.nodes if node.op == "call_function" and node.target is not operator.getitem
        )
        (output,) = graph_module.graph.find_nodes(op="output")
        returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
        record["pieces"].append(
            {"collectives": collectives, "ops": compute, "inputs": len(example_inputs), "outputs": len(returned)}
        )
        return ChiplessArtifact()

    _backend.TpuBackend.__call__ = backend_call
    split_compiler.SplitCompiler._compile_graph = split_call
    compiler.StaticCompiler._compile = lower_for_chip

    cfg = load_config(
        None,
        [
            f"model.path={model_path}",
            "learner.graph=true",
            "learner.ranks=2",
            "learner.length_buckets=[16]",
            "data.max_prompt_tokens=8",
            "rollout.max_tokens=8",
            "rollout.group_size=2",
            "train.prompts_per_step=2",
            "train.micro_batch_size=2",
            f"learner.packed_buckets=[{PACKED_WIDTH}]",
            *overrides,
        ],
    )
    learner = Learner.from_config(model_path, cfg, rank=0, world_size=2)
    engine = learner.engine
    # The tpu row of the backend table decides the compile backend; the tensors stay on the CPU (no chip here).
    engine.backend = backend("tpu")
    strategy = engine.strategy

    def join_fake_group(master_addr: str, master_port: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        strategy.mesh = make_mesh(2, "cpu")

    strategy.join = join_fake_group
    learner.join_process_group("127.0.0.1", 0)
    step = engine.step_fn

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (5,), generator=generator).tolist() for _ in range(4)]
    completions = [torch.randint(3, 300, (6,), generator=generator).tolist() for _ in range(4)]
    logprobs = [[-5.0] * 6 for _ in range(4)]
    batch = TrainBatch.from_sequences(prompts, completions, logprobs, [1.0, -1.0, 0.5, -0.5], pad_id=0)

    stopped = None
    try:
        learner.train_step(batch)
    except NoChip as err:
        stopped = str(err)
    finally:
        _backend.TpuBackend.__call__ = tpu_backend
        split_compiler.SplitCompiler._compile_graph = split_graph
        compiler.StaticCompiler._compile = lower
        dist.destroy_process_group()
    record["trainable_parameters"] = len(step.params)
    record["dynamo_graphs"] = step.compiles
    record["graph_breaks"] = step.graph_breaks
    record["stopped_at_chip"] = stopped is not None
    return record


FLAG = "TORCH_TPU_INTERNAL_MATERIALIZE_COLLECTIVE_TENSORS"


def capture_all(flag: str, models: list[str]) -> None:
    os.environ[FLAG] = flag
    for item in models:
        family, model_path = item.split("=", 1)
        variant = next(suffix for suffix in sorted(VARIANTS, key=len, reverse=True) if family.endswith(suffix))
        result = capture(model_path, VARIANTS[variant])
        print("CAPTURE " + json.dumps({"flag": flag, "family": family, **result}), flush=True)


def main(argv: list[str]) -> int:
    flags, models = argv[0].split(","), argv[1:]
    # What capture() imports, paid once for every value's process.
    import torch_tpu._internal.compile.split_compiler  # noqa: F401
    import rlpipe.training.learner  # noqa: F401
    from torch.testing._internal.distributed import fake_pg  # noqa: F401

    failed = 0
    for flag in flags:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                capture_all(flag, models)
            except BaseException:  # noqa: BLE001 (reported, then this fork ends)
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
