"""The shipped TPU recipes in the TPU environment (Python 3.12, the `tpu` extra's transformers): they load, pass
`rlpipe plan`, and ask for what vLLM on TorchTPU computes in."""

from __future__ import annotations

from pathlib import Path

import inspect

import pytest

# Imported at collection, outside any test's captured output: torch_tpu's logging keeps the stream it first sees.
from vllm_torchtpu.platforms.tpu_platform import TpuPlatform

from rlpipe.cli import main
from rlpipe.config import load_config

REPO = Path(__file__).resolve().parents[2]
TPU_RECIPES = sorted(path.name for path in (REPO / "configs").glob("*.yaml") if path.name != "default.yaml")


@pytest.mark.parametrize("recipe", TPU_RECIPES)
def test_a_tpu_recipe_loads_plans_and_rolls_out_in_bfloat16(recipe):
    cfg = load_config(REPO / "configs" / recipe)
    assert cfg.learner.device == "tpu" and cfg.placement.learner.tpu and cfg.placement.rollout.tpu
    assert main(["plan", str(REPO / "configs" / recipe)]) == 0
    # vllm-torchtpu turns a float32 or float16 model dtype into bfloat16 when it checks the engine's config, so a
    # recipe asking for another rollout dtype would be silently changed (and the probe tolerance chosen for it wrong).
    assert "bfloat16" in inspect.getsource(TpuPlatform.check_and_update_config)
    assert cfg.rollout.dtype == "bfloat16"
