"""No unbounded wait in the driver, and faults a run survives: the deadline of every actor call (actors/calls.py), the
weight sync's retries and lost-engine handling (actors/sync_channel.py), a generation past its deadline (the engine
pool), an engine whose vLLM process died (actors/rollout.py), a write cut short by a BaseException, and a
shared-memory segment truncated under its reader. No Ray cluster: the Ray calls these wait on are stood in for."""

from __future__ import annotations

import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch

from rlpipe.actors import calls
from rlpipe.actors.calls import CallTimeout, WorkerLost, get_all, reason, settle
from rlpipe.actors.engine_pool import EnginePool, Generation, EngineShare
from rlpipe.actors.rollout import engine_failure
from rlpipe.actors.sync_channel import SyncChannel
from rlpipe.config import SyncConfig, load_config
from rlpipe.types import Prompt
from rlpipe.rollout.engine import RolloutEngine, WriteTimedOut
from rlpipe.weightsync import NonFiniteWeights, SyncError, make_transport
from rlpipe.weightsync.hostcopy import HostCopy, read_shared_weights
from tests.unit.test_receiver import PROBE, channel, expected_for  # noqa: F401 - channel is a fixture
from tests.unit.test_weightsync import _full_tensors


# ---------------------------------------------------------------- the deadline of a call


class _NeverDone:
    """Stands in for Ray's waiting: the refs given never finish."""

    def __init__(self):
        self.timeouts: list[float | None] = []

    def wait(self, refs, num_returns=1, timeout=None):
        self.timeouts.append(timeout)
        return [], list(refs)


def test_a_call_past_its_deadline_is_a_lost_worker_naming_the_role_the_call_and_the_setting(monkeypatch):
    never = _NeverDone()
    monkeypatch.setattr(calls.ray, "wait", never.wait)
    with pytest.raises(CallTimeout) as raised:
        get_all(["ref"], 3600.0, "a learner rank", "train_step", "learner.call_timeout_s")
    assert str(raised.value) == "a learner rank did not answer train_step within 3600 s (learner.call_timeout_s)"
    assert isinstance(raised.value, WorkerLost)  # `rlpipe train` prints it in one line; --auto-resume applies
    assert never.timeouts and all(t is not None and t <= 3600.0 for t in never.timeouts)
    again = pickle.loads(pickle.dumps(raised.value))  # raised inside an actor too
    assert str(again) == str(raised.value) and again.call == "train_step"


def test_without_a_deadline_get_all_waits_as_ray_does(monkeypatch):
    seen = []
    monkeypatch.setattr(calls.ray, "wait", lambda refs, num_returns, timeout: (seen.append(timeout), (refs[:1], refs[1:]))[1])
    monkeypatch.setattr(calls.ray, "get", lambda refs: refs)
    assert get_all([1, 2]) == [1, 2] and seen == [None, None]


def test_settled_calls_drop_their_errors(monkeypatch):
    got = []

    def get(ref):
        got.append(ref)
        raise SyncError("weight sync v2: a bucket arrived before begin_sync")

    monkeypatch.setattr(calls.ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(calls.ray, "get", get)
    settle(["a", "b"], 1.0)  # raises nothing
    assert got == ["a", "b"]


def test_the_reason_of_an_actors_error_is_its_own_first_line():
    inside = SyncError("weight sync v2: after writing, the probe differs\ndetails")
    err = ray.exceptions.RayTaskError("RolloutActor.commit", "Traceback ...", inside)
    assert reason(err) == "weight sync v2: after writing, the probe differs"
    assert reason(RuntimeError("plain\nmore")) == "plain"


# ---------------------------------------------------------------- the weight sync's retries


class _Call:
    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args):
        return self.answer


class _Engine:
    def __init__(self, held: int):
        self.held_version = _Call(held)
        self.alive = _Call(True)


class _Pool:
    def __init__(self, engines):
        self.engines = engines
        self.replaced: list[tuple[int, BaseException]] = []

    def replace(self, index, dead, error):
        self.replaced.append((index, error))
        self.engines[index] = _Engine(0)
        return True


def _channel(retries: int, engines: int = 2) -> tuple[SyncChannel, list[str]]:
    notes: list[str] = []
    sync = SyncChannel.__new__(SyncChannel)
    sync.cfg, sync.pool, sync.note = SyncConfig(retries=retries), _Pool([_Engine(0) for _ in range(engines)]), notes.append
    sync.probe_by_decoding, sync.routes, sync.learners = False, SimpleNamespace(shared_host=False), []
    sync._wait = lambda refs, role, call, timeout_s=None: list(refs)  # held_version answers
    sync._learners_alive = lambda: True
    sync._join = lambda index: None
    sync.retries, sync.waits = 0, []
    sync.sleep = sync.waits.append  # the back-off, recorded instead of waited
    return sync, notes


def _refused(version: int) -> ray.exceptions.RayTaskError:
    return ray.exceptions.RayTaskError("RolloutActor.commit", "Traceback ...", SyncError(
        f"weight sync v{version}: after writing, the engine's probe logprobs differ from the learner's by 0.3"))


def test_a_failed_sync_is_tried_again_then_stops_the_run_as_a_lost_worker():
    sync, notes = _channel(retries=2)
    attempts = []

    def fail(version, tokens, expected, rehearsal, targets):
        attempts.append(list(targets))
        raise _refused(version)

    sync._transfer_to, sync.lost_engines = fail, lambda indexes: []
    with pytest.raises(WorkerLost) as raised:
        sync._transfer(3, PROBE)
    assert len(attempts) == 3  # the first and sync.retries more
    assert str(raised.value) == ("weight sync v3 failed 3 times (sync.retries=2), the last time: weight sync v3: "
                                 "after writing, the engine's probe logprobs differ from the learner's by 0.3")
    assert notes == [f"weight sync v3 failed (weight sync v3: after writing, the engine's probe logprobs differ from "
                     f"the learner's by 0.3); trying again in {wait:g} s ({n} of 2)" for n, wait in ((1, 1), (2, 2))]
    assert "\n" not in str(raised.value)
    assert sync.retries == 2


def test_a_failed_syncs_retries_back_off_exponentially_up_to_the_cap_and_are_counted():
    sync, notes = _channel(retries=5)
    sync.cfg = SyncConfig(retries=5, retry_backoff_s=0.5, retry_backoff_max_s=3.0)

    def fail(version, tokens, expected, rehearsal, targets):
        raise _refused(version)

    sync._transfer_to, sync.lost_engines = fail, lambda indexes: []
    with pytest.raises(WorkerLost):
        sync._transfer(2, PROBE)
    assert sync.waits == [0.5, 1.0, 2.0, 3.0, 3.0] and sync.retries == 5
    assert calls.backoff_s(1, 0.0, 30.0) == 0.0  # sync.retry_backoff_s: 0 retries at once


def test_a_replaced_engine_counts_as_a_retry_without_a_back_off():
    sync, notes = _channel(retries=0)
    replaced = []
    sync.pool.replace = lambda index, engine, err: replaced.append(index) or True
    attempts = []

    def lose_engine_once(version, tokens, expected, rehearsal, targets):
        attempts.append(list(targets))
        if len(attempts) == 1:
            raise ray.exceptions.RayActorError()
        return {"sync/bytes": 1.0}, [{"probe": []}], expected

    sync._transfer_to, sync.lost_engines = lose_engine_once, lambda indexes: [1] if len(attempts) == 1 else []
    sync._transfer(1, PROBE, rehearsal=True)
    assert replaced == [1] and sync.retries == 1 and sync.waits == []


def test_a_retried_sync_succeeds_and_only_engines_without_the_version_are_sent_it_again():
    sync, notes = _channel(retries=2)
    attempts = []

    def once_then_ok(version, tokens, expected, rehearsal, targets):
        attempts.append(list(targets))
        if len(attempts) == 1:
            sync.pool.engines[0] = _Engine(version)  # engine 0 committed; engine 1 refused
            raise _refused(version)
        return {"sync/bytes": 1.0}, [{"probe": []}], expected

    sync._transfer_to, sync.lost_engines = once_then_ok, lambda indexes: []
    metrics, _ = sync._transfer(4, PROBE)
    assert metrics == {"sync/bytes": 1.0} and attempts == [[0, 1], [1]] and len(notes) == 1


def test_diverged_weights_stop_the_sync_at_once_naming_the_tensor():
    sync, notes = _channel(retries=2)
    attempts = []
    diverged = NonFiniteWeights("weight sync v3: model.norm.weight holds NaN or inf (element 5 of learner rank 0's "
                                "rows); the training step that produced version 3 diverged, so its weights are not sent")

    def send_fails(version, tokens, expected, rehearsal, targets):
        attempts.append(list(targets))
        raise ray.exceptions.RayTaskError("LearnerActor.send_weights", "Traceback ...", diverged)

    sync._transfer_to, sync.lost_engines = send_fails, lambda indexes: []
    with pytest.raises(NonFiniteWeights) as raised:
        sync._transfer(3, PROBE)
    assert len(attempts) == 1 and notes == []  # the same weights would fail again: no retry
    assert str(raised.value) == str(diverged) and not isinstance(raised.value, WorkerLost)  # no auto-resume either


def test_a_failure_after_every_engine_took_the_version_stops_in_one_line_rather_than_retrying_nothing():
    sync, notes = _channel(retries=2)

    def commits_then_fails(version, tokens, expected, rehearsal, targets):
        for index in targets:
            sync.pool.engines[index] = _Engine(version)
        raise CallTimeout("a learner rank", "release_weights", 300, "sync.timeout_s")

    sync._transfer_to, sync.lost_engines = commits_then_fails, lambda indexes: []
    with pytest.raises(WorkerLost) as raised:
        sync._transfer(5, PROBE)
    assert str(raised.value) == ("weight sync v5 failed after every engine took it: a learner rank did not answer "
                                 "release_weights within 300 s (sync.timeout_s)")


def test_an_engine_that_stops_answering_mid_sync_is_replaced_and_sent_the_version_without_using_a_retry():
    sync, notes = _channel(retries=0)
    attempts = []
    hung = CallTimeout("a rollout engine", "commit (write and probe)", 900, "sync.timeout_s")

    def hang_once(version, tokens, expected, rehearsal, targets):
        attempts.append(list(targets))
        if len(attempts) == 1:
            sync.pool.engines[0] = _Engine(version)
            raise hung
        return {}, [{"probe": []}], expected

    sync._transfer_to = hang_once
    sync.lost_engines = lambda indexes: [1]  # engine 1 did not answer the liveness check
    sync._transfer(2, PROBE)
    assert sync.pool.replaced == [(1, hung)] and attempts == [[0, 1], [1]] and notes == []


def test_the_liveness_check_counts_dead_silent_and_unusable_engines_as_lost(monkeypatch):
    sync, _ = _channel(retries=0, engines=4)
    answers = {"ok": True, "unusable": False}

    def get(ref, timeout):
        if ref == "dead":
            raise ray.exceptions.RayActorError()
        if ref == "silent":
            raise ray.exceptions.GetTimeoutError()
        return answers[ref]

    for engine, answer in zip(sync.pool.engines, ["ok", "dead", "silent", "unusable"]):
        engine.alive = _Call(answer)
    monkeypatch.setattr("rlpipe.actors.sync_channel.ray.get", get)
    assert sync.lost_engines([0, 1, 2, 3]) == [1, 2, 3]


# ---------------------------------------------------------------- a generation past its deadline


def test_a_generation_past_its_deadline_replaces_the_engine_and_its_prompts_come_back_empty(monkeypatch):
    cfg = load_config(None, ["rollout.num_engines=2", "rollout.generate_timeout_s=5"])
    pool = EnginePool.__new__(EnginePool)
    pool.cfg, pool.engines = cfg, ["engine-0", "engine-1"]
    replaced = []
    pool.replace = lambda index, dead, error: replaced.append((index, dead, error)) or True
    prompts = [Prompt(i, f"q{i}", [1, 2], {}) for i in range(4)]

    def get(future, timeout):
        if future == "hung":
            raise ray.exceptions.GetTimeoutError()
        return [["done"], ["done"]]

    monkeypatch.setattr("rlpipe.actors.engine_pool.ray.get", get)
    generation = Generation(prompts, 2, {}, [EngineShare(0, "engine-0", range(0, 2), "fine"),
                                             EngineShare(1, "engine-1", range(2, 4), "hung")])
    completions, again = pool.collect(generation)
    assert completions == [["done"], ["done"], [], []] and again == [1]  # engine 1's prompts are generated again
    (index, dead, error), = replaced
    assert (index, dead) == (1, "engine-1") and isinstance(error, CallTimeout)
    assert str(error) == "rollout engine 1 did not answer generate within 5 s (rollout.generate_timeout_s)"


def test_an_engine_that_can_no_longer_serve_is_replaced_and_other_errors_are_raised(monkeypatch):
    cfg = load_config(None, ["rollout.num_engines=2"])
    pool = EnginePool.__new__(EnginePool)
    pool.cfg, pool.engines = cfg, ["engine-0", "engine-1"]
    replaced = []
    pool.replace = lambda index, dead, error: replaced.append(index) or True
    prompts = [Prompt(i, f"q{i}", [1, 2], {}) for i in range(2)]
    failures = {
        "unusable": ray.exceptions.RayTaskError("RolloutActor.generate", "Traceback ...", SyncError(
            "weight sync v2: the write broke off (KeyboardInterrupt)")),
        "bug": ray.exceptions.RayTaskError("RolloutActor.generate", "Traceback ...", ValueError("a bug")),
    }

    def get(future, timeout):
        if future in failures:
            raise failures[future]
        return [["done"]]

    monkeypatch.setattr("rlpipe.actors.engine_pool.ray.get", get)
    generation = Generation(prompts, 2, {}, [EngineShare(0, "engine-0", range(0, 1), "fine"),
                                             EngineShare(1, "engine-1", range(1, 2), "unusable")])
    assert pool.collect(generation) == ([["done"], []], [1]) and replaced == [1]
    generation.shares[1] = EngineShare(1, "engine-1", range(1, 2), "bug")
    with pytest.raises(ray.exceptions.RayTaskError):  # not an engine's loss: the step fails as before
        pool.collect(generation)


def test_a_write_vllm_gave_up_on_leaves_the_engine_to_be_replaced():
    # vLLM's executor answers calls in order: after its own timeout nothing more may go through it, a rollback's
    # write included, so the timeout is a BaseException the receiver marks the engine unusable for.
    engine = RolloutEngine.__new__(RolloutEngine)
    engine.sync_cfg, engine.cfg = SyncConfig(timeout_s=7), SimpleNamespace()

    def collective_rpc(method, timeout, args):
        assert timeout == 7
        raise Exception("Call to collective_rpc method failed: RPC call to rlpipe_load_weights timed out.")

    engine.llm = SimpleNamespace(collective_rpc=collective_rpc)
    with pytest.raises(WriteTimedOut, match="within sync.timeout_s 7 s"):
        engine._load_weights([], True)


# ---------------------------------------------------------------- an engine whose vLLM process died


def _llm(client) -> SimpleNamespace:
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))


def test_an_engine_whose_vllm_process_or_worker_died_is_noticed():
    # vLLM 0.32's client of an engine-core process (MPClient) and its in-process client (InprocClient).
    process = SimpleNamespace(resources=SimpleNamespace(engine_dead=False))
    assert engine_failure(_llm(process)) is None
    process.resources.engine_dead = True
    assert engine_failure(_llm(process)) == "its vLLM engine process died"
    executor = SimpleNamespace(is_failed=False)
    in_process = SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor))
    assert engine_failure(_llm(in_process)) is None
    executor.is_failed = True
    assert engine_failure(_llm(in_process)) == "a vLLM worker process died"


# ---------------------------------------------------------------- a write cut short, a truncated segment


class _Interrupted(BaseException):
    """What a write may be cut short by that is no Exception (KeyboardInterrupt, SystemExit, a thread's exit)."""


def test_a_write_cut_short_by_a_base_exception_leaves_the_engine_unusable(channel):  # noqa: F811
    shapes, engine, receiver, send = channel
    receiving = receiver()
    send(receiving, 1, _full_tensors(shapes, seed=1))

    def interrupted(weights):
        raise _Interrupted()

    receiving._write = interrupted
    with pytest.raises(_Interrupted):
        receiving.commit(1, PROBE, expected_for(engine.initial))
    assert receiving.unusable == "weight sync v1: the write broke off (_Interrupted)"
    assert receiving.policy_version == 0
    receiving.close()


def test_a_rollback_whose_write_fails_leaves_the_engine_unusable(channel):  # noqa: F811
    shapes, engine, receiver, send = channel
    receiving = receiver()
    send(receiving, 1, _full_tensors(shapes, seed=1))
    writes = []

    def every_write_fails(weights):
        writes.append(weights)
        raise RuntimeError("a worker refused the tensors")

    receiving._write = every_write_fails
    with pytest.raises(SyncError) as raised:
        receiving.commit(1, PROBE, expected_for(engine.initial))
    assert len(writes) == 2  # the new version, then the previous one back
    assert receiving.unusable == str(raised.value)
    assert "writing version 0 back failed too (RuntimeError: a worker refused the tensors)" in receiving.unusable
    receiving.close()


def test_a_segment_truncated_under_the_receiver_is_an_error_not_sigbus():
    sender, receiver = make_transport("shm"), make_transport("shm")
    try:
        buffer = sender.allocate(1 << 16, bucket=0, version=1)
        buffer[:] = 7
        handle, _ = sender.send(buffer)
        with receiver.receive(handle, 0, buffer.nbytes) as view:
            assert int(view[-1]) == 7
        os.truncate(os.path.join("/dev/shm", handle.name), 4096)
        with pytest.raises(SyncError, match="holds 4096 bytes, 65536 expected"):
            with receiver.receive(handle, 0, buffer.nbytes) as view:
                np.asarray(view).sum()
    finally:
        receiver.close()
        sender.close()


def test_a_host_copy_truncated_under_a_worker_is_an_error_not_sigbus(tmp_path):
    host = HostCopy(directory=str(tmp_path))
    weights = {"a.weight": torch.ones(64, 64), "b.weight": torch.ones(256, 64)}
    with host.publish(weights) as shared:
        with read_shared_weights(shared) as tensors:
            name, first = next(tensors)
            assert name == "a.weight" and float(first.sum()) == 64 * 64
            os.truncate(shared.tensors[1].path, 4096)  # b.weight lies past the new end
            with pytest.raises(SyncError, match="b.weight lies past the end"):
                next(tensors)
    host.close()


# ---------------------------------------------------------------- what `rlpipe train` shows


def test_a_sync_that_keeps_failing_ends_rlpipe_train_in_one_line_and_auto_resume_restarts_the_run(
    tmp_path, monkeypatch, capsys
):
    import rlpipe.run.controller
    from rlpipe.cli import main

    failed = WorkerLost("weight sync v7 failed 3 times (sync.retries=2), the last time: weight sync v7: the probe "
                        "differs")
    hung = CallTimeout("a learner rank", "train_step", 3600, "learner.call_timeout_s")
    outcomes: list = []

    def train(cfg, resume, progress=None):
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(rlpipe.run.controller, "train", train)
    args = ["train", f"run.output_dir={tmp_path}", "train.max_auto_resumes=2"]
    outcomes[:] = [failed]
    assert main(args) == 1
    # No traceback, nothing after the one line; the stand-in run stopped before preparing its directory.
    assert capsys.readouterr().err.splitlines() == [f"rlpipe: {failed}; stopped before the run started"]
    outcomes[:] = [failed, hung, {"done": True}]
    assert main([*args, "--auto-resume"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "weight sync v7 failed" in lines[0] and "did not answer train_step" in lines[1]
    assert all("restarting from the beginning (no checkpoint yet)" in line for line in lines)


def test_the_replayed_probe_is_cut_to_the_engines_context():
    """An episode whose prompt (its tools' schemas) filled the context ended with nothing sampled; the sync replays
    what fits in the context with one token to generate, not a sequence vLLM would refuse."""
    from rlpipe.types import Completion, Group
    from rlpipe.weightsync.receiver import CommitResult

    sync, _ = _channel(retries=0)
    sync.max_model_len, sync.version, sent = 10, 0, []

    def transfer(version, tokens, **_):
        sent.append(list(tokens))
        probe = [0.0] + [-1.0] * (len(tokens) - 1)
        return {}, [CommitResult(probe_max_abs=0.0, probe_mean_abs=0.0, write_s=0.0, probe_s=0.0, bytes=0, probe=probe)]

    sync._transfer = transfer
    prompt = Prompt(0, "q", [1, 2])
    filled = Completion([], [], "", "length", 0, mask=[], prompt_ids=list(range(12)))
    sync.push(Group(prompt, [filled]))
    assert sent == [list(range(9))] and sync.version == 1
    short = Completion([7, 8], [-1.0, -1.5], "", "stop", 1)
    metrics = sync.push(Group(prompt, [short]))
    assert sent[-1] == [1, 2, 7, 8] and metrics["sync/policy_shift"] == 0.5
