"""rlpipe.train from a user's own script, as a notebook would call it: a reward function defined in `__main__` and one
in a module beside the recipe (no PYTHONPATH for it) score a real one-step run, whose export is pushed to a local
stand-in of the Hugging Face Hub (metrics.push_to_hub)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.hub_stand_in import HubStandIn
from tests.integration.conftest import ROOT

pytestmark = pytest.mark.integration

SCRIPT = """
import json, sys
import rlpipe

CALLS = sys.argv[2]  # a global of __main__: carried with the function, by value

def in_main(completions, **kwargs):
    with open(CALLS, "a") as out:
        out.write(f"{len(completions)}\\n")
    return [float(len(c) % 2) for c in completions]

if __name__ == "__main__":
    summary = rlpipe.train(
        sys.argv[1], reward_funcs=[in_main, "beside_recipe:constant"], reward_weights=[1.0, 0.5],
        **{"train.steps": 1, "metrics.push_to_hub": "org/tiny-api"}, metrics={"plot": False},
    )
    print(json.dumps(summary))
"""


def test_a_script_trains_with_its_own_reward_functions_and_pushes_the_export(tmp_path, tiny_qwen3):
    user = tmp_path / "user"  # the user's folder: recipe, reward module, script; nothing of it on any path
    user.mkdir()
    (user / "beside_recipe.py").write_text("def constant(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    (user / "recipe.yaml").write_text(textwrap.dedent(f"""
        run: {{output_dir: {tmp_path / 'runs'}, name: api}}
        model: {{path: {tiny_qwen3}}}
        rollout: {{group_size: 4, max_tokens: 12, max_model_len: 128}}
        data: {{max_prompt_tokens: 112, eval_size: 4}}
        train: {{prompts_per_step: 2, micro_batch_size: 4}}
        ray: {{num_cpus: 6}}
        metrics: {{loggers: [jsonl]}}
    """))
    (user / "script.py").write_text(SCRIPT)
    calls = tmp_path / "calls.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH")}
    with HubStandIn() as hub:
        done = subprocess.run(
            [sys.executable, str(user / "script.py"), str(user / "recipe.yaml"), str(calls)], cwd=tmp_path,
            env={**env, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_standin"},
            capture_output=True, text=True, timeout=600,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["eval_before"] is not None and summary["eval_after"] is not None
    # Called by the reward worker's child for the step's 8 samples and both held-out evaluations.
    assert sum(int(n) for n in calls.read_text().split()) >= 8
    record = json.loads((tmp_path / "runs" / "api" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 <= record["reward/in_main"] <= 1 and record["reward/constant"] == 1.0
    assert summary["hub"].startswith(f"{hub.url}/org/tiny-api/commit/")
    export = tmp_path / "runs" / "api" / "export"
    received = hub.files["org/tiny-api"]
    assert received == {p.name: p.read_bytes() for p in export.iterdir() if p.is_file()}
    card = received["README.md"].decode()
    assert "in_main (passed by value)" in card and f"| after training | {summary['eval_after']:.4f} |" in card
