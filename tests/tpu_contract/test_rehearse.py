"""`rlpipe rehearse` on every shipped TPU recipe (rlpipe/tpu/rehearse.py): each check passes, and what the learner-step
check compiled is the recipe's own step on fake `tpu` tensors — one graph through TorchTPU's backend up to the chip,
the recipe's kernels in it at its widths, SimpleFSDP's collectives — while the backward's kernels compile for the
recipe's chip through JAX's compile-only topology. Checked on CPU only: nothing here runs on a TPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlpipe.config.loading import find_recipe, load_config
from rlpipe.hardware.device import tpu_slice
from rlpipe.plan import learner_sequence
from rlpipe.tpu.rehearse import COMPILE_CHIPS

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(
    path.stem for path in (REPO / "configs").glob("*.yaml")
    if ((yaml.safe_load(path.read_text()).get("placement") or {}).get("learner") or {}).get("tpu")
)
# One recipe again with every kernel rlpipe has for TPU: RMSNorm and the fused log-prob through TorchTPU's bridge too.
ALL_KERNELS = "qwen3-0.6b-gsm8k-v6e+model.kernels.rmsnorm=pallas+model.kernels.logprob=pallas"
REHEARSED = [*RECIPES, ALL_KERNELS]
LAYERS = 2


def _config(name: str):
    recipe, *overrides = name.split("+")
    return load_config(find_recipe(f"configs/{recipe}.yaml"), overrides)


@pytest.fixture(scope="module")
def rehearsals(tmp_path_factory) -> dict[str, dict[str, dict]]:
    """recipe -> check name -> the check, from one process that rehearses them all."""
    out = tmp_path_factory.mktemp("rehearse") / "checks.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "tests.tpu_contract.rehearse_recipes", str(out), *REHEARSED],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return {name: {check["what"]: check for check in checks} for name, checks in json.loads(out.read_text()).items()}


def test_the_shipped_tpu_recipes_are_all_rehearsed():
    assert len(RECIPES) >= 6 and "qwen3-30b-a3b-v6e" in RECIPES and "llama3-70b-v5p" in RECIPES


@pytest.mark.parametrize("name", REHEARSED)
def test_every_check_of_a_shipped_recipe_passes_in_a_real_starts_order(rehearsals, name):
    checks = rehearsals[name]
    failed = {what: check["why"] for what, check in checks.items() if check["passed"] is False}
    assert not failed
    order = [what for what in checks if not what.startswith("plan: ")]
    assert order == ["environments: learner ranks", "environments: engines", "engines", "learner step", "kernels"]
    assert list(checks)[0].startswith("plan: ") and any(what.endswith("host /dev/shm") for what in checks)


@pytest.mark.parametrize("name", REHEARSED)
def test_the_recipes_step_compiles_whole_on_tpu_tensors_with_its_kernels(rehearsals, name):
    cfg = _config(name)
    step = rehearsals[name]["learner step"]["details"]
    forward, update = step["forward"], step["update"]
    assert (forward["dynamo_graphs"], forward["graph_breaks"], forward["stopped_at_chip"]) == (1, 0, True)
    assert (update["dynamo_graphs"], update["graph_breaks"], update["stopped_at_chip"]) == (1, 0, True)
    assert step["layers"] == LAYERS and step["ranks"] == cfg.learner.ranks
    # The packed row is as wide as the recipe's whole pass: its rows x the bucket of its longest sequence.
    rows, seq = learner_sequence(cfg)
    assert step["packed_width"] == rows * seq
    kernels = {}
    for piece in forward["pieces"]:
        for op, count in piece["kernels"].items():
            kernels[op] = kernels.get(op, 0) + count
    # The packed splash attention with its segment ids, one a layer, and nothing of rlpipe's host-side ops.
    assert kernels.get("rlpipe_tpu::attention_forward") == LAYERS
    hf_moe = cfg.model.path.endswith("A3B")
    assert kernels.get("tpu::_ragged_dot", 0) == (2 * LAYERS if hf_moe else 0)  # gate+up, then down, per layer
    if cfg.model.kernels.rmsnorm == "pallas":  # two a layer, the final norm, q and k norms
        assert kernels.get("rlpipe_tpu::rmsnorm_forward", 0) >= 2 * LAYERS + 1
    if cfg.model.kernels.logprob == "pallas":
        assert kernels.get("rlpipe_tpu::logprob_forward") == 1
    assert not any(op.startswith("rlpipe::") for piece in forward["pieces"] for op in piece["kernels"])
    # SimpleFSDP: every parameter gathered in the forward (with the collectives inside the one program, as a learner
    # rank sets TorchTPU up), and one all-reduce for the global gradient norm in the update.
    (piece,) = forward["pieces"]
    assert piece["collectives"] and set(piece["collectives"]) == {"all_gather_into_tensor"}
    assert [c for p in update["pieces"] for c in p["collectives"]] == ["all_reduce"]


@pytest.mark.parametrize("name", REHEARSED)
def test_the_steps_kernels_compile_forward_and_backward_for_the_recipes_chip(rehearsals, name):
    cfg = _config(name)
    compiled = rehearsals[name]["kernels"]["details"]["compiled"]
    assert {"splash packed fwd", "splash packed bwd"} <= set(compiled)  # the packed case the step runs
    assert ("ragged_dot bwd" in compiled) == cfg.model.path.endswith("A3B")
    assert ("logprob bwd" in compiled) == (cfg.model.kernels.logprob == "pallas")
    generation = tpu_slice(cfg.placement.learner.tpu, cfg.placement.learner.topology).generation
    assert rehearsals[name]["kernels"]["details"]["chip"] == COMPILE_CHIPS[generation]


def test_without_a_chip_the_backward_stops_in_torchs_autograd_engine():
    """Where the step on fake `tpu` tensors stops, and why it compiles forward and update apart: autograd.grad asks
    TorchTPU's device guard for a device count it cannot give without a chip, and the process dies (SIGSEGV). When a
    TorchTPU release lets this pass, the rehearsal can compile the step with its backward in one graph."""
    from rlpipe.tpu.step import AUTOGRAD_GRAD_REPRODUCTION

    done = subprocess.run([sys.executable, "-c", AUTOGRAD_GRAD_REPRODUCTION], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TPU_SKIP_MDS_QUERY": "1"})
    assert done.returncode == -11, (done.returncode, done.stderr[-2000:])
    assert "PjRt backend unavailable" in done.stderr
