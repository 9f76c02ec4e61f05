"""The learner's whole train step (forward, loss, autograd.grad, clipping, FunctionalAdamW, SimpleFSDP's
collectives) captured for TorchTPU's `tpu` compile backend on a fake 2-rank process group, dense and MoE Qwen3, and
run through TorchTPU's own backend up to the chip: its aot_autograd, its split compiler and its per-piece FX passes
(tests/tpu_contract/step_capture.py says how, and where it stops). Checked on CPU only: nothing here runs on a TPU.

TORCH_TPU_INTERNAL_MATERIALIZE_COLLECTIVE_TENSORS decides whether TorchTPU's split compiler cuts the compiled step at
every collective (torch_tpu/_internal/compile/split_compiler.py, `SplitCompiler.__call__`, default true). torch_tpu
reads it once per process, so each value runs in a process of its own that sets it explicitly (the lane's environment
otherwise gets "false" from vllm-torchtpu's sitecustomize.py): one child process, forked once per value after its
imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A family's "+splash" variant runs attention through the Pallas kernel (model.kernels.attention=pallas).
FAMILIES = ("qwen3", "qwen3_moe", "qwen3+splash", "qwen3_moe+splash")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    from rlpipe.bench.tiny_model import build_tiny_model

    folder = tmp_path_factory.mktemp("capture-models")
    models = {family: build_tiny_model(folder / family, family) for family in FAMILIES if "+" not in family}
    return {family: models[family.partition("+")[0]] for family in FAMILIES}


@pytest.fixture(scope="module")
def captures(tiny_models) -> dict[str, dict[str, dict]]:
    """flag value ("true" | "false") -> model family -> what the capture recorded."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = [f"{family}={path}" for family, path in tiny_models.items()]
    done = subprocess.run(
        [sys.executable, "-m", "tests.tpu_contract.step_capture", "true,false", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
    )
    lines = [line[len("CAPTURE "):] for line in done.stdout.splitlines() if line.startswith("CAPTURE ")]
    assert done.returncode == 0 and len(lines) == 2 * len(FAMILIES), done.stdout[-2000:] + done.stderr[-6000:]
    out: dict[str, dict[str, dict]] = {"true": {}, "false": {}}
    for record in map(json.loads, lines):
        out[record["flag"]][record["family"]] = record
    assert all(set(by_family) == set(FAMILIES) for by_family in out.values()), lines
    return out


@pytest.mark.parametrize("flag", ["true", "false"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_whole_step_is_one_graph_handed_once_to_torch_tpus_backend(captures, family, flag):
    record = captures[flag][family]
    assert record["dynamo_graphs"] == 1 and record["graph_breaks"] == 0
    assert record["tpu_backend_calls"] == 1
    # autograd.grad is traced inside the step, so AOT autograd sees a graph without a backward of its own: one
    # forward compilation holds forward, backward and the optimizer.
    assert record["aot_compiles"] == ["forward"]
    # Everything up to the chip ran; the first piece the step launched was the first thing that needed one.
    assert record["stopped_at_chip"]


@pytest.mark.parametrize("flag", ["true", "false"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_captured_step_holds_simple_fsdps_collectives(captures, family, flag):
    (split,) = captures[flag][family]["splits"]
    assert split["materialize_collectives"] is (flag == "true")
    collectives = split["collectives"]
    # Every parameter read is an all-gather (the tied embedding is read twice) whose backward is a reduce-scatter;
    # the global gradient norm of the sharded gradients is one all-reduce.
    assert collectives["all_gather_into_tensor"] >= captures[flag][family]["trainable_parameters"]
    assert collectives["reduce_scatter_tensor"] == collectives["all_gather_into_tensor"]
    assert collectives["all_reduce"] == 1
    assert set(collectives) == {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"}


@pytest.mark.parametrize("family", FAMILIES)
def test_with_the_flag_off_the_step_is_one_piece_holding_every_collective(captures, family):
    record = captures["false"][family]
    (split,) = record["splits"]
    (piece,) = record["pieces"]
    assert split["pieces"] == 1
    assert len(piece["collectives"]) == split["collective_count"]
    # aot_autograd(keep_inference_input_mutations=False): the in-place AdamW update comes back as outputs, at least
    # the new parameters, both moments of each and the step count.
    assert piece["outputs"] >= 3 * record["trainable_parameters"] + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_with_the_flag_on_every_collective_is_a_piece_of_its_own(captures, family):
    record = captures["true"][family]
    (split,) = record["splits"]
    pieces = record["pieces"]
    # The partitioner's pieces are the ones that went on to StaticCompiler.
    assert split["pieces"] == len(pieces)
    with_collective = [piece for piece in pieces if piece["collectives"]]
    compute = [piece for piece in pieces if not piece["collectives"]]
    assert all(len(piece["collectives"]) == 1 for piece in with_collective)
    assert len(with_collective) == split["collective_count"]
    # Compute runs between collectives; back-to-back collectives leave no compute piece between them.
    assert 1 <= len(compute) <= split["collective_count"] + 1
    # The same graph, cut: the collectives come in the same order as in the single piece of the flag-off step.
    in_order = [piece["collectives"][0] for piece in with_collective]
    assert in_order == captures["false"][family]["pieces"][0]["collectives"]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_the_packed_row_reaches_attention_without_a_row_by_row_tensor_through_the_kernel(captures, family):
    """The step's packed row (48 wide): torch's attention takes it under a [W, W] mask, and its scores and their
    gradients are [.., W, W] values of the traced step, while the Pallas kernel takes the row's document ids and no
    value of the step is [.., W, W]: the packed attention path on TPU forms no s x s tensor."""
    assert captures["false"][family]["row_squares"] > 0
    splash = captures["false"][f"{family}+splash"]
    assert splash["row_squares"] == 0
    assert splash["dynamo_graphs"] == 1 and splash["graph_breaks"] == 0 and splash["stopped_at_chip"]
