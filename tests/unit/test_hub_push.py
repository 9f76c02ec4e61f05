"""`rlpipe export --push-to-hub ORG/NAME` and metrics.push_to_hub: the export's model card (Hub metadata header, the
recipe, the held-out figures) and the push through huggingface_hub, against a local stand-in of the Hub's HTTP API."""

from __future__ import annotations

import json

import pytest
import yaml

from rlpipe.cli import main
from rlpipe.config import ConfigError, load_config
from rlpipe.run.hub_push import model_card
from tests.hub_stand_in import HubStandIn


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants

    with HubStandIn() as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
        monkeypatch.setenv("HF_TOKEN", "hf_standin_token")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read when it was imported
        yield stand_in


def test_the_model_card_has_the_hub_header_the_recipe_and_the_held_out_figures():
    config = load_config(None, ["model.path=Qwen/Qwen3-0.6B", "run.name=arith", "train.steps=7"]).to_dict()
    card = model_card(config, {"eval_before": 0.25, "eval_after": 0.5})
    _, header, body = card.split("---\n", 2)
    assert yaml.safe_load(header) == {
        "base_model": "Qwen/Qwen3-0.6B", "library_name": "transformers",
        "tags": ["rlpipe", "grpo", "reinforcement-learning", "text-generation"],
    }
    assert "| before training | 0.2500 |" in body and "| after training | 0.5000 |" in body
    recipe = body.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(recipe) == config
    local = model_card({"model": {"path": "/nowhere/local-model"}}, None)
    assert "base_model" not in local.split("---\n")[1] and "| after training | not measured |" in local


def test_the_model_card_shows_the_sampled_figures_and_the_best_evaluation():
    config = load_config(None, ["train.steps=4", "eval.samples_per_prompt=4"]).to_dict()
    points = [{"step": 0, "accuracy": 0.25, "mean@4": 0.125, "pass@2": 0.2, "pass@4": 0.3},
              {"step": 2, "accuracy": 0.75, "mean@4": 0.5, "pass@2": 0.6, "pass@4": 0.7},
              {"step": 4, "accuracy": 0.5, "mean@4": 0.375, "pass@2": 0.5, "pass@4": 0.625}]
    card = model_card(config, {"eval_before": 0.25, "eval_after": 0.5, "eval": points,
                               "eval_best": {**points[1], "checkpoint": None}})
    table = card.split("## Held-out evaluation\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table == ["| | accuracy | mean@4 | pass@2 | pass@4 |", "|---|---|---|---|---|",
                     "| before training | 0.2500 | 0.1250 | 0.2000 | 0.3000 |",
                     "| after training | 0.5000 | 0.3750 | 0.5000 | 0.6250 |",
                     "| best (step 2) | 0.7500 | 0.5000 | 0.6000 | 0.7000 |"]
    # The last step's evaluation missing from the evaluations (a checkpoint's card): its greedy figure alone.
    card = model_card(config, {"eval_after": 0.5, "eval": points[:1], "eval_best": {**points[-1], "checkpoint": None}})
    assert "| after training | 0.5000 | not measured | not measured | not measured |" in card and "best" not in card


def test_export_pushes_the_folder_and_its_card_to_the_hub(hub, tiny_qwen3, tmp_path, capsys):
    from tests.unit.test_checkpoint import _save
    from tests.unit.test_learner_group import _config
    from rlpipe.training.learner import Learner

    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1))
    final = _save(learner, tmp_path / "run", 1)
    out = tmp_path / "hf"
    assert main(["export", str(final), str(out), "--push-to-hub", "my-org/tiny-grpo", "--private"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"pushed to {hub.url}/my-org/tiny-grpo/commit/{'0' * 40}"
    assert hub.created == [{"name": "tiny-grpo", "organization": "my-org", "visibility": "private", "type": "model"}]
    received = hub.files["my-org/tiny-grpo"]
    local = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    assert {"config.json", "model.safetensors", "README.md"} <= set(received)
    assert received == local  # every file, byte for byte
    assert "| before training | not measured |" in received["README.md"].decode()
    assert set(hub.tokens) == {"Bearer hf_standin_token"}


def test_a_push_that_cannot_happen_is_refused_before_the_export(hub, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token saved by a login either
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--push-to-hub", "org/name"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "rlpipe: --push-to-hub org/name: no Hugging Face token (set HF_TOKEN, or run `hf auth login`)"
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--push-to-hub", "no-org"]) == 2
    assert capsys.readouterr().err.strip() == "rlpipe: --push-to-hub: 'no-org' is not a Hub repository id ORG/NAME"
    assert not (tmp_path / "hf").exists() and not hub.created
    # A run asked to push refuses to start the same way.
    assert main(["train", f"run.output_dir={tmp_path / 'runs'}", "metrics.push_to_hub=org/name"]) == 2
    assert capsys.readouterr().err.strip() == (
        "rlpipe: config error: metrics.push_to_hub org/name: no Hugging Face token (set HF_TOKEN, or run `hf auth login`)"
    )
    assert not (tmp_path / "runs").exists()


def test_the_push_key_needs_a_repo_id_and_an_export():
    with pytest.raises(ConfigError, match=r"^metrics\.push_to_hub: 'a/b/c' is not a Hub repository id"):
        load_config(None, ["metrics.push_to_hub=a/b/c"])
    with pytest.raises(ConfigError, match=r"^metrics\.push_to_hub: needs metrics\.export=true"):
        load_config(None, ["metrics.push_to_hub=org/name", "metrics.export=false"])
    assert load_config(None, ["metrics.push_to_hub=org/name"]).metrics.push_private is False


def test_a_finished_run_writes_its_card_and_pushes_its_export(hub, tmp_path):
    """The end of a run (hub_push.after_run, which `rlpipe train` and `rlpipe.train` call with the summary)."""
    from rlpipe.run.hub_push import after_run

    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=done", "metrics.push_to_hub=org/done"])
    export = cfg.run_dir / "export"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    summary = {"eval_before": 0.1, "eval_after": 0.3, "export": str(export)}
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary))
    after_run(cfg, summary)
    assert summary["hub"].startswith(f"{hub.url}/org/done/commit/")
    assert json.loads((cfg.run_dir / "summary.json").read_text())["hub"] == summary["hub"]
    card = hub.files["org/done"]["README.md"].decode()
    assert card == (export / "README.md").read_text() and "| after training | 0.3000 |" in card
    assert hub.created == [{"name": "done", "organization": "org", "type": "model"}]  # the namespace's visibility
