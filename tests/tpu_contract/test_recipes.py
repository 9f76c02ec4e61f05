"""The shipped TPU recipes in the TPU environment (Python 3.12, the `tpu` extra's transformers): they load and pass
`rlpipe plan`. Loading refuses a TPU rollout in any dtype but bfloat16, the only one vLLM on TorchTPU computes in;
the engine settings go through vLLM-TorchTPU's own config validation in `rlpipe rehearse`'s engines check
(test_rehearse.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

# Imported at collection, outside any test's captured output: torch_tpu's logging keeps the stream it first sees.
from vllm_torchtpu.platforms.tpu_platform import TpuPlatform  # noqa: F401

from rlpipe.cli import main
from rlpipe.config import load_config

REPO = Path(__file__).resolve().parents[2]
# Every shipped recipe whose learner runs on TPU chips (the others, e.g. default.yaml, are CPU recipes).
TPU_RECIPES = sorted(
    path.name for path in (REPO / "configs").glob("*.yaml")
    if (yaml.safe_load(path.read_text()).get("learner") or {}).get("device") == "tpu"
)


@pytest.mark.parametrize("recipe", TPU_RECIPES)
def test_a_tpu_recipe_loads_and_plans(recipe):
    cfg = load_config(REPO / "configs" / recipe)
    assert cfg.learner.device == "tpu" and cfg.placement.learner.tpu and cfg.placement.rollout.tpu
    assert main(["plan", str(REPO / "configs" / recipe)]) == 0
