"""Training-state checkpoints: atomic publication, the latest pointer, pruning, clear errors, exact learner resume
(also onto a different number of ranks), and no broken `latest` whatever moment a save is killed at."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import signal

import pytest
import torch
import torch.multiprocessing as mp

from rlpipe.training import checkpoint
from rlpipe.training.checkpoint import CheckpointError
from rlpipe.cli import main
from rlpipe.config import load_config
from rlpipe.training.learner import Learner, combine_rank_metrics
from rlpipe.parallel.mesh import find_free_port
from tests.unit.test_learner_group import _batches, _config
from tests.weights import whole_weights


def _save(learner: Learner, run_dir, step: int, keep: int = 3, model_path=None):
    partial = checkpoint.begin_save(run_dir, step)
    learner.save_checkpoint(str(partial / checkpoint.LEARNER_STATE))
    config = {"model": {"path": model_path or learner.engine.model_path, "tokenizer": None}}
    return checkpoint.finish_save(partial, {"step": step, "config": config}, keep)


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in whole_weights(learner).items()}


def test_latest_moves_to_each_new_checkpoint_and_only_the_last_k_stay(tiny_qwen3, tmp_path):
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1))
    for step in (1, 2, 3, 4):
        final = _save(learner, tmp_path, step, keep=2)
        assert checkpoint.resolve(tmp_path) == final  # from the run directory
        assert checkpoint.resolve(tmp_path / "checkpoints") == final
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    assert checkpoint.resolve(tmp_path / "checkpoints" / "step_000003").name == "step_000003"
    assert checkpoint.read_trainer_state(final)["step"] == 4
    with pytest.raises(CheckpointError, match="step_000004 already exists; it is not overwritten"):
        _save(learner, tmp_path, 4)
    assert checkpoint.resolve(tmp_path) == final and not list((tmp_path / "checkpoints").glob(".partial-*"))


def test_bad_checkpoints_are_named_in_one_line(tiny_qwen3, tiny_llama, tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        checkpoint.resolve(tmp_path / "nowhere")
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1))
    final = _save(learner, tmp_path, 1)
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        checkpoint.resolve(broken)
    (final / checkpoint.TRAINER_STATE).write_text(json.dumps({"format": 99}))
    with pytest.raises(CheckpointError, match="format 99"):
        checkpoint.resolve(final)
    (final / checkpoint.TRAINER_STATE).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        checkpoint.resolve(final)
    # Another model (other shapes, other vocabulary): refused before anything is changed.
    other = Learner.from_config(tiny_llama, _config(tiny_llama, 1))
    before = _weights(other)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        other.load_checkpoint(str(final / checkpoint.LEARNER_STATE))
    for name, value in _weights(other).items():
        assert torch.equal(value, before[name]), name


def test_export_writes_the_checkpoint_weights_as_an_hf_folder_and_refuses_a_misfit(tiny_qwen3, tiny_llama, tmp_path):
    from rlpipe.models import load_model

    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1))
    learner.train_step(_batches()[0])
    final = _save(learner, tmp_path / "run", 1)
    out = checkpoint.export(tmp_path / "run", tmp_path / "hf")
    exported = load_model(out).state_dict()
    for name, value in _weights(learner).items():
        assert torch.equal(exported[name], value), name
    assert (out / "tokenizer.json").exists() or (out / "tokenizer_config.json").exists()
    with pytest.raises(CheckpointError, match="already exists; it is not overwritten"):
        checkpoint.export(final, out)
    misfit = _save(learner, tmp_path / "other", 1, model_path=tiny_llama)  # says it is the llama model
    with pytest.raises(CheckpointError, match=r"its weights do not fit .*tiny-llama"):
        checkpoint.export(misfit, tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


class _Payload:
    """Unpickled, it creates `marker`: what a foreign `.metadata` could do with any code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_planted_in_the_metadata_never_runs(tiny_qwen3, tmp_path, capsys):
    import pickle

    import torch.distributed.checkpoint as dcp

    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1))
    final = _save(learner, tmp_path / "run", 1)
    learner_state, marker = final / checkpoint.LEARNER_STATE, tmp_path / "payload-ran"
    (learner_state / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(BaseException):  # DCP's own reader unpickles it, and so runs it
        dcp.load(learner.engine.checkpoint_state(), checkpoint_id=str(learner_state), no_dist=True)
    assert marker.exists(), "the payload does not work: this test would prove nothing"
    marker.unlink()
    capsys.readouterr()

    refused = r"refusing to load \.metadata: it refers to io\.open, which the metadata of an rlpipe checkpoint never"
    before = _weights(learner)
    with pytest.raises(CheckpointError, match=refused):  # the learner's load (a resumed run's ranks)
        learner.load_checkpoint(str(learner_state))
    for name, value in _weights(learner).items():
        assert torch.equal(value, before[name]), name
    with pytest.raises(CheckpointError, match=refused):  # prepare()'s check of the shapes before Ray starts
        checkpoint.check_fits(final, {}, "this model")
    assert main(["export", str(final), str(tmp_path / "hf")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"rlpipe: checkpoint {learner_state}: ") and "io.open" in line
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_metadata_that_would_read_pickled_values_or_other_files_is_refused(tiny_qwen3, tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    # A non-tensor value is stored as a pickle that DCP loads with torch.load(weights_only=False).
    dcp.save({"model.w": torch.zeros(2), "count": 3}, checkpoint_id=str(tmp_path / "bytes"), no_dist=True)
    with pytest.raises(CheckpointError, match="refusing to load .metadata: it refers to .*BytesStorageMetadata"):
        checkpoint.load_tensors({"model.w": torch.zeros(2), "count": 0}, str(tmp_path / "bytes"), "this state")
    dcp.save({"model.w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "paths"), no_dist=True)
    metadata = checkpoint.read_metadata(tmp_path / "paths")
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (tmp_path / "paths" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="its storage entries name files outside the checkpoint"):
        checkpoint.load_tensors({"model.w": torch.zeros(2)}, str(tmp_path / "paths"), "this state")
    (tmp_path / "paths" / ".metadata").write_bytes(b"\x80\x04truncated")
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable"):
        checkpoint.model_shapes(tmp_path / "paths")


def test_an_interrupted_save_leaves_latest_alone_and_is_cleared_by_the_next(tiny_qwen3, tmp_path):
    learner = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1))
    first = _save(learner, tmp_path, 1)
    partial = checkpoint.begin_save(tmp_path, 2)
    learner.save_checkpoint(str(partial / checkpoint.LEARNER_STATE))  # ...and the process dies here
    assert checkpoint.resolve(tmp_path) == first
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        checkpoint.resolve(partial)
    second = _save(learner, tmp_path, 2)
    assert not partial.exists() and checkpoint.resolve(tmp_path) == second


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.heavy
def test_a_resumed_learner_continues_exactly(tiny_qwen3, tmp_path, graph):
    """Train 2 steps, save, resume in a fresh learner, train the 3rd: the same as 3 steps without a break. The
    eager step's checkpoint also resumes the compiled step (one format for both)."""
    batches = _batches()
    straight = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1))
    expected = [combine_rank_metrics([straight.train_step(b)]) for b in batches]
    first = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1))
    for batch in batches[:2]:
        first.train_step(batch)
    final = _save(first, tmp_path, 2)
    resumed = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1, graph=graph))
    resumed.load_checkpoint(str(final / checkpoint.LEARNER_STATE))
    assert resumed.engine.optimizer_steps_taken == 2 and resumed.policy_version == 2
    got = combine_rank_metrics([resumed.train_step(batches[2])])
    tolerance = 1e-4 if graph else 1e-6
    for key in ("loss", "lr", "grad_norm"):
        assert got[key] == pytest.approx(expected[2][key], rel=tolerance, abs=tolerance), key
    want = _weights(straight)
    for name, value in _weights(resumed).items():
        torch.testing.assert_close(value, want[name], rtol=tolerance, atol=tolerance, msg=name)


def _train_two_ranks_and_save(rank, model_path, port, directory, errors):
    try:
        torch.set_num_threads(1)
        learner = Learner.from_config(model_path, _config(model_path, 2), rank, 2)
        learner.join_process_group("127.0.0.1", port)
        for batch in _batches()[:2]:
            learner.train_step(batch)
        learner.save_checkpoint(directory)  # each rank writes its own rows
        torch.distributed.destroy_process_group()
    except Exception as err:  # surfaced by the test
        errors.put(repr(err))


@pytest.mark.heavy
def test_a_two_rank_checkpoint_resumes_on_one_rank(tiny_qwen3, tmp_path):
    directory = str(tmp_path / "learner")
    context = mp.get_context("spawn")
    errors = context.Queue()
    port = find_free_port()
    procs = [context.Process(target=_train_two_ranks_and_save, args=(r, tiny_qwen3, port, directory, errors)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=600)
    assert errors.empty(), errors.get()
    assert all(proc.exitcode == 0 for proc in procs)

    batches = _batches()
    straight = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1))
    expected = [combine_rank_metrics([straight.train_step(b)]) for b in batches][2]
    resumed = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1))
    resumed.load_checkpoint(directory)
    got = combine_rank_metrics([resumed.train_step(batches[2])])
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    want = _weights(straight)
    for name, value in _weights(resumed).items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5, msg=name)


# ------------------------------------------------------------------ killed while saving


class _Killer:
    """Counts the calls that make a save durable or visible, and SIGKILLs this process at call number `at`."""

    CALLS = ("fsync", "rename", "replace")

    def __init__(self, at: int | None):
        self.at, self.count = at, 0
        self.originals = {name: getattr(os, name) for name in self.CALLS}
        for name in self.CALLS:
            setattr(os, name, self._wrap(self.originals[name]))

    def _wrap(self, call):
        def wrapped(*args, **kwargs):
            self.count += 1
            if self.count == self.at:
                os.kill(os.getpid(), signal.SIGKILL)
            return call(*args, **kwargs)

        return wrapped


def _save_and_report(model_path, run_dir, at, counts):
    learner = Learner.from_config(model_path, load_config(None, [f"model.path={model_path}"]))
    killer = _Killer(at)
    _save(learner, run_dir, 2)
    counts.put(killer.count)


@pytest.mark.heavy
def test_killing_a_save_at_any_point_leaves_a_loadable_latest(tiny_qwen3, tmp_path):
    learner = Learner.from_config(tiny_qwen3, load_config(None, [f"model.path={tiny_qwen3}"]))
    pristine, run_dir = tmp_path / "pristine", tmp_path / "run"
    _save(learner, pristine, 1)
    context = multiprocessing.get_context("fork")  # no re-import per kill: the points are many
    counts = context.Queue()
    dry = context.Process(target=_save_and_report, args=(tiny_qwen3, tmp_path / "dry", None, counts))
    dry.start()
    dry.join()
    total = counts.get()
    assert total >= 10  # every file, directory and pointer write is a point to die at
    outcomes = set()
    for at in range(1, total + 1):
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.copytree(pristine, run_dir)  # one complete checkpoint (step 1), then a save of step 2 is killed
        proc = context.Process(target=_save_and_report, args=(tiny_qwen3, run_dir, at, counts))
        proc.start()
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, at
        latest = checkpoint.resolve(run_dir)  # raises if `latest` is missing or points at anything incomplete
        learner.load_checkpoint(str(latest / checkpoint.LEARNER_STATE))
        outcomes.add(latest.name)
    assert outcomes == {"step_000001", "step_000002"}  # killed before and after the pointer moved


# ------------------------------------------------------------------ a full disk


class _DiskFull:
    """Makes the call number `at` among those that allocate or publish (fsync, rename, replace, mkdir) fail with
    ENOSPC, as a full disk does; fsync is where delayed allocation reports it."""

    CALLS = ("fsync", "rename", "replace", "mkdir")

    def __init__(self, monkeypatch, at: int | None):
        self.at, self.count = at, 0
        for name in self.CALLS:
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name)))

    def _wrap(self, call):
        def wrapped(*args, **kwargs):
            if call.__name__ == "mkdir" and os.path.isdir(args[0]):
                return call(*args, **kwargs)  # `mkdir(exist_ok=True)` of a directory that exists takes no space
            self.count += 1
            if self.count == self.at:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return call(*args, **kwargs)

        return wrapped


def _save_step_2(learner: Learner, run_dir) -> None:
    config = {"model": {"path": learner.engine.model_path, "tokenizer": None}}
    checkpoint.save(run_dir, 2, learner.save_checkpoint, lambda _: {"step": 2, "config": config}, keep=3)


@pytest.mark.heavy
def test_a_disk_full_at_any_point_of_a_save_keeps_nothing_of_it_and_names_the_cause(tiny_qwen3, tmp_path):
    learner = Learner.from_config(tiny_qwen3, load_config(None, [f"model.path={tiny_qwen3}"]))
    pristine, run_dir = tmp_path / "pristine", tmp_path / "run"
    _save(learner, pristine, 1)
    shutil.copytree(pristine, tmp_path / "dry")
    with pytest.MonkeyPatch.context() as patch:
        dry = _DiskFull(patch, at=None)
        _save_step_2(learner, tmp_path / "dry")
    assert dry.count >= 8
    for at in range(1, dry.count + 1):
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.copytree(pristine, run_dir)
        before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
        with pytest.MonkeyPatch.context() as patch, pytest.raises(CheckpointError) as raised:
            _DiskFull(patch, at)
            _save_step_2(learner, run_dir)
        message = str(raised.value)
        assert "\n" not in message and "No space left on device" in message, (at, message)
        assert "checkpoint step_000002 could not be written" in message and message.endswith("still step_000001")
        # Nothing of the failed save is left (no partial directory, no temporary pointer), `latest` is untouched.
        assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before, at
        learner.load_checkpoint(str(checkpoint.resolve(run_dir) / checkpoint.LEARNER_STATE))
    _save_step_2(learner, run_dir)  # space again: the same save goes through
    assert checkpoint.resolve(run_dir).name == "step_000002"


def test_a_worker_lost_during_a_save_is_raised_as_it_is_after_the_same_clean_up(tiny_qwen3, tmp_path):
    """A learner rank dying while it writes is the run's failure, not the save's: `--auto-resume` must see it as a
    lost worker (a CheckpointError would stop the run for good), and the half-written save must still be gone."""
    from rlpipe.actors.calls import WorkerLost

    learner = Learner.from_config(tiny_qwen3, load_config(None, [f"model.path={tiny_qwen3}"]))
    run_dir = tmp_path / "run"
    _save(learner, run_dir, 1)
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))

    def rank_dies_midway(directory: str) -> None:
        learner.save_checkpoint(directory)
        raise WorkerLost("a learner rank died while writing a checkpoint")

    with pytest.raises(WorkerLost, match="died while writing"):
        checkpoint.save(run_dir, 2, rank_dies_midway, lambda _: {"step": 2}, keep=3, passthrough=(WorkerLost,))
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
    with pytest.raises(CheckpointError, match="could not be written.*still step_000001"):  # without it: the save's
        checkpoint.save(run_dir, 2, rank_dies_midway, lambda _: {"step": 2}, keep=3)
