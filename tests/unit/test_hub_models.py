"""`model.path` as a Hugging Face Hub id: resolved through huggingface_hub's cache before anything starts (offline
here: HF_HUB_OFFLINE=1, a cache laid out as huggingface_hub lays it out), one line with the `hf download` command
when the model is not cached, and the resolved folder recorded by checkpoints for resume and export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlpipe.training import checkpoint
from rlpipe.training.checkpoint import CheckpointError
from rlpipe.cli import main
from rlpipe.config import ConfigError, load_config
from rlpipe.models.builtin import resolve_model_path
from rlpipe.models.hub import parse_hub_id

REPO_ID = "tiny-org/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROWS = [{"question": f"Calculate {a} + {b}.", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]


def lay_out_hub_cache(cache: Path, repo_id: str, commit: str, model: Path, tag: str | None = None) -> Path:
    """`model`'s files as huggingface_hub's cache holds a download of `repo_id` at `commit` (the `main` branch, and
    `tag`): file contents under blobs/, the snapshot's files linking to them, refs/<branch> naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for number, file in enumerate(sorted(p for p in model.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"{number:040x}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    for ref in ["main", *([tag] if tag else [])]:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, tiny_qwen3, monkeypatch) -> Path:
    """An offline Hugging Face cache holding REPO_ID; returns the snapshot folder."""
    cache = tmp_path / "hf-cache"
    snapshot = lay_out_hub_cache(cache, REPO_ID, COMMIT, Path(tiny_qwen3), tag="v1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


@pytest.fixture(autouse=True)
def tripwire(monkeypatch):
    """A run that gets through every check stops here instead of starting Ray."""
    import rlpipe.actors.cluster

    def start_ray(cfg):
        raise AssertionError("start_ray reached")

    monkeypatch.setattr(rlpipe.actors.cluster, "start_ray", start_ray)


def test_what_reads_as_a_hub_id():
    assert parse_hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert parse_hub_id("Qwen/Qwen3-0.6B@v2.1") == ("Qwen/Qwen3-0.6B", "v2.1")
    assert parse_hub_id(f"Qwen/Qwen3-0.6B@{COMMIT}") == ("Qwen/Qwen3-0.6B", COMMIT)
    for local in ["/models/Qwen3-8B", "./Qwen/Qwen3", "~/models/x", "runs/x/export/model", "Qwen3-0.6B", "a/b c",
                  "Qwen/Qwen3@", "Qwen/--bad", ""]:
        assert parse_hub_id(local) is None, local


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache, tiny_qwen3):
    assert resolve_model_path(REPO_ID) == str(hub_cache)
    assert resolve_model_path(f"{REPO_ID}@v1") == str(hub_cache)  # a tag the cache knows
    assert resolve_model_path(f"{REPO_ID}@{COMMIT}") == str(hub_cache)
    assert resolve_model_path(tiny_qwen3) == tiny_qwen3  # a folder stays a folder
    with pytest.raises(ConfigError) as err:
        resolve_model_path(f"{REPO_ID}@v2")
    assert str(err.value) == (
        f"model.path: {REPO_ID}@v2 is not a folder here, nor in the Hugging Face cache with HF_HUB_OFFLINE=1; "
        f"fetch it first: hf download {REPO_ID} --revision v2"
    )



def test_a_snapshot_links_into_its_own_repositorys_blobs_only(hub_cache, tiny_qwen3):
    """The cache's snapshot -> ../../blobs/<hash> links are the folder's own files; one into another repository's
    blobs (or anywhere else outside the snapshot) is refused, naming the file."""
    from rlpipe.models.checks import ModelFileError
    from rlpipe.models.hf import check_weights

    check_weights(hub_cache)  # every file a link into its blobs
    other = lay_out_hub_cache(hub_cache.parents[2], "other-org/other-model", COMMIT, Path(tiny_qwen3))
    template = hub_cache / "chat_template.jinja"
    borrowed = (other / "chat_template.jinja").resolve()
    template.unlink()
    template.symlink_to(Path("..", "..", "..", "models--other-org--other-model", "blobs", borrowed.name))
    with pytest.raises(ModelFileError) as err:
        check_weights(hub_cache)
    assert str(err.value) == f"{template}: links to {borrowed}, outside the model folder; put the file itself there"

def _run_args(tmp_path: Path, model: str) -> list[str]:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return [f"model.path={model}", f"run.output_dir={tmp_path / 'runs'}", "run.name=hub", "data.source=file",
            f"data.path={data}", "data.eval_size=0", "reward.functions=[{name: format_tags}]",
            "metrics.loggers=[jsonl]", "train.steps=2", f"train.prompts_per_step={len(ROWS)}"]


@pytest.mark.parametrize("model", ["nobody/no-such-model", "nobody/no-such-model@v3"])
def test_an_uncached_hub_id_offline_is_one_line_with_the_download_command(model, hub_cache, tmp_path, capsys):
    status = main(["train", *_run_args(tmp_path, model)])
    revision = " --revision v3" if model.endswith("@v3") else ""
    assert status == 2
    assert capsys.readouterr().err == (
        f"rlpipe: config error: model.path: {model} is not a folder here, nor in the Hugging Face cache with "
        f"HF_HUB_OFFLINE=1; fetch it first: hf download nobody/no-such-model{revision}\n"
    )
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_a_path_that_is_neither_keeps_the_folder_error(hub_cache, tmp_path, capsys):
    missing = tmp_path / "no-such-folder"
    assert main(["train", *_run_args(tmp_path, str(missing))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.path:" in err and f"{missing} is not a Hugging Face model folder" in err


def _save_step_1(run, cfg) -> Path:
    """A real step-1 checkpoint of `run` (the learner's state as a learner rank writes it), as the driver saves."""
    from rlpipe.training.learner import Learner

    learner = Learner.from_config(run.model_path, cfg)
    return checkpoint.save(
        run.dir, 1, lambda directory: learner.save_checkpoint(directory),
        lambda _: {"step": 1, "policy_version": 1, "sampler": run.sampler.state_dict(), "rng": checkpoint.rng_state(),
                   "learner_rng": [], "config": cfg.to_dict(), "model_path": run.model_path,
                   "tokenizer_path": run.tokenizer_path, "metrics": [], "summary": {"eval_before": None}},
        keep=2,
    )


def test_a_run_resumes_and_exports_from_a_hub_id(hub_cache, tmp_path, monkeypatch):
    from rlpipe.run.controller import prepare
    from rlpipe.models import load_model

    cfg = load_config(None, _run_args(tmp_path, REPO_ID))
    run = prepare(cfg)
    run.log.close()
    assert run.model_path == str(hub_cache)  # every role gets the snapshot folder, not the id
    saved = _save_step_1(run, cfg)
    assert checkpoint.read_trainer_state(saved)["model_path"] == str(hub_cache)

    resumed = prepare(load_config(None, _run_args(tmp_path, REPO_ID)), resume="latest")
    resumed.log.close()
    assert resumed.first_step == 2 and resumed.model_path == str(hub_cache)
    assert resumed.resume["learner"] == str(saved / checkpoint.LEARNER_STATE)

    # Export reads the folder the checkpoint records, even with the cache gone from the environment ...
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    out = checkpoint.export(saved, tmp_path / "export")
    assert set(load_model(out).state_dict()) == set(load_model(hub_cache).state_dict())
    # ... and, where that folder is gone too, resolves model.path again: one line naming the command.
    shutil.rmtree(hub_cache.parent.parent)
    with pytest.raises(CheckpointError, match=rf"model.path: {REPO_ID} .*fetch it first: hf download {REPO_ID}$"):
        checkpoint.export(saved, tmp_path / "export2")


def test_online_a_cached_model_is_used_when_the_hub_cannot_be_reached(hub_cache, monkeypatch):
    """Online mode with the Hub unreachable (its endpoint a closed port on this machine): the cached snapshot
    serves, and an uncached model is one line saying why, with the command."""
    import socket

    from huggingface_hub import constants

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    assert resolve_model_path(REPO_ID) == str(hub_cache)
    with pytest.raises(ConfigError) as err:
        resolve_model_path("nobody/no-such-model")
    assert str(err.value).startswith("model.path: nobody/no-such-model is not a folder here, nor in the Hugging Face "
                                     "cache and the Hub cannot be reached (")
    assert str(err.value).endswith("); fetch it first: hf download nobody/no-such-model")


def test_the_plan_reads_a_cached_hub_models_config_and_never_downloads(hub_cache, tmp_path, monkeypatch):
    from rlpipe.plan import MODELS_DIR, architecture_source

    assert architecture_source(REPO_ID) == hub_cache / "config.json"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # even online, the plan looks in the cache only
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert architecture_source("Qwen/Qwen3-8B@main") == MODELS_DIR / "Qwen3-8B.json"  # not cached: the shipped one
    assert not (tmp_path / "empty-cache").exists()
