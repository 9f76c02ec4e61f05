"""Workers killed for real (SIGKILL) in a running pool: rollout engines at three points of a step, and the vLLM
process of an engine running in a child process in the middle of a weight write; a learner rank under
`rlpipe train --auto-resume`, then the driver itself, resumed by `rlpipe train --resume`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlpipe.config import load_config

pytestmark = pytest.mark.integration

GROUP_SIZE = 2
TRANSPORT = [f"sync.transport={os.environ['RLPIPE_TEST_TRANSPORT']}"] if os.environ.get("RLPIPE_TEST_TRANSPORT") else []


def _pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()))


def _kill_while_generating(pid: int) -> None:
    """SIGKILL the engine process once it runs a generate call: Ray titles a worker process after the method it
    is running."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"RolloutActor.generate" in f.read():
                os.kill(pid, signal.SIGKILL)
                return
        time.sleep(0.002)
    raise AssertionError(f"engine process {pid} never started generating")


def _prompts(first_id: int, count: int = 6):
    from rlpipe.types import Prompt

    return [Prompt(first_id + i, f"q{i}", [5 + i, 9, 11 + i, 4], {}) for i in range(count)]


def _check_groups(groups, prompts, version: int | None = None):
    """Every prompt came back once, in order, with a whole group of completions."""
    assert [g.prompt.sample_id for g in groups] == [p.sample_id for p in prompts]
    for group in groups:
        assert len(group.completions) == GROUP_SIZE
        if version is not None:
            assert {c.policy_version for c in group.completions} == {version}


def _train_and_sync(roles, groups):
    from rlpipe.types import TrainBatch

    samples = [(g.prompt.token_ids, c) for g in groups for c in g.completions]
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    batch = TrainBatch.from_sequences([p for p, _ in samples], [c.token_ids for _, c in samples],
                                      [c.logprobs for _, c in samples], advantages, pad_id=0)
    roles.train(batch)
    return roles.sync_weights(probe=groups[0])


def _engine_matches_learner(roles, index: int) -> None:
    import ray
    import torch

    tokens = roles.sync.probe_tokens
    learner = ray.get(roles.learners[0].probe_reference.remote(tokens, False))
    engine = ray.get(roles.pool.engines[index].__ray_call__.remote(lambda actor, t: actor.engine.sequence_logprobs(t),
                                                                   tokens))
    torch.testing.assert_close(torch.tensor(engine[1:]), torch.tensor(learner[1:]), atol=1e-5, rtol=0)


def test_a_killed_rollout_engine_is_replaced_and_only_its_prompts_are_generated_again(tiny_qwen3, ray_cluster):
    """Engine 1 of 2 is killed (1) while generating, (2) idle between steps, (3) while generating ahead during
    training (asynchronous mode), so that the weight sync meets it dead first. Each time a new engine takes its
    place with the current weights, and every prompt comes back exactly once."""
    import ray

    from rlpipe.actors.cluster import start_ray
    from rlpipe.actors.roles import Roles

    start_ray(load_config(None, ["ray.num_cpus=4"]))
    cfg = load_config(None, [
        f"model.path={tiny_qwen3}", "rollout.num_engines=2", f"rollout.group_size={GROUP_SIZE}",
        "rollout.max_tokens=48", "rollout.max_model_len=128", "data.max_prompt_tokens=64", "train.prompts_per_step=6", "train.micro_batch_size=4",
        "train.lr=1e-3", "sync.probe_tolerance=1e-5", "sync.bucket_mb=0.05", "rollout.max_restarts=3",
        *TRANSPORT,
    ])
    notes: list[str] = []
    roles = Roles(cfg, tiny_qwen3, note=notes.append)
    try:
        # (1) Killed mid-generation: its three prompts are generated again, the other engine's kept.
        prompts = _prompts(100)
        first_pid = _pid(roles.pool.engines[1])  # asked first: the actor answers calls one at a time
        generation = roles.start_generation(prompts, GROUP_SIZE)
        _kill_while_generating(first_pid)
        groups = roles.finish_generation(generation)
        _check_groups(groups, prompts, version=0)
        assert roles.engine_restarts == [0, 1]
        assert _pid(roles.pool.engines[1]) != first_pid
        assert "rollout engine 1 died" in notes[-1]
        _train_and_sync(roles, groups)
        assert roles.policy_version == 1

        # (2) Killed while idle, after version 1 was synced: the next step finds it dead when seeding, and the new
        # engine receives version 1 before it generates anything.
        os.kill(_pid(roles.pool.engines[1]), signal.SIGKILL)
        time.sleep(1.0)
        roles.seed(2)
        assert roles.engine_restarts == [0, 2]
        assert ray.get(roles.pool.engines[1].held_version.remote()) == 1
        _engine_matches_learner(roles, 1)
        prompts = _prompts(200)
        groups = roles.finish_generation(roles.start_generation(prompts, GROUP_SIZE))
        _check_groups(groups, prompts, version=1)

        # (3) Asynchronous mode: the next step generates while this one trains; the engine is killed meanwhile. The
        # sync finds it dead, replaces it and hands version 2 to the new engine; then its prompts come again.
        ahead_prompts, pid = _prompts(300), _pid(roles.pool.engines[1])
        ahead = roles.start_generation(ahead_prompts, GROUP_SIZE)
        _kill_while_generating(pid)
        metrics = _train_and_sync(roles, groups)
        assert roles.engine_restarts == [0, 3] and roles.policy_version == 2
        assert metrics["sync/probe_max_abs"] < 1e-5
        assert ray.get(roles.pool.engines[1].held_version.remote()) == 2
        ahead_groups = roles.finish_generation(ahead)
        _check_groups(ahead_groups, ahead_prompts)
        versions = [{c.policy_version for c in g.completions} for g in ahead_groups]
        assert versions[3:] == [{2}] * 3  # engine 1's share: generated again, by the new engine, with version 2
        assert all(v <= {1, 2} for v in versions[:3])  # engine 0's share: kept (or, if a sync aborted it, redone)
        _engine_matches_learner(roles, 1)
        _engine_matches_learner(roles, 0)

        # A fourth death is one more than rollout.max_restarts: the step stops, naming the limit.
        from rlpipe.actors.calls import WorkerLost

        pid = _pid(roles.pool.engines[1])
        generation = roles.start_generation(_prompts(400), GROUP_SIZE)
        _kill_while_generating(pid)
        with pytest.raises(WorkerLost, match=r"rollout engine 1 died more than rollout.max_restarts=3 times"):
            roles.finish_generation(generation)
    finally:
        roles.shutdown()


def _vllm_process(actor_pid: int) -> int:
    """The pid of the engine-core process vLLM started under the actor (`rollout.in_process: false`)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == actor_pid and b"EngineCore" in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
    raise AssertionError(f"no vLLM engine-core process under the engine actor {actor_pid}")


def _shm_files_of(pid: int) -> set[str]:
    """The /dev/shm files (not unlinked yet) that process `pid` and its descendants map, and the weight-sync and
    engine files named after it (rlpipe-<pid>-..., rlpipe-engine-<pid>)."""
    table = {}
    for entry in Path("/proc").iterdir():
        try:
            table[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
    tree, todo = set(), [pid]
    while todo:
        tree.add(current := todo.pop())
        todo += [child for child, parent in table.items() if parent == current]
    files = set()
    for process in tree:
        try:
            maps = Path(f"/proc/{process}/maps").read_text()
        except OSError:
            continue
        files |= {line.split(None, 5)[5] for line in maps.splitlines()
                  if "/dev/shm/" in line and not line.endswith("(deleted)")}
    return files | {str(path) for path in Path("/dev/shm").glob(f"rlpipe-*{pid}*")
                    if path.name.startswith((f"rlpipe-{pid}-", f"rlpipe-engine-{pid}"))}


def _kill_when_committing(actor_pid: int, victim: int, killed: list[bool]) -> None:
    """SIGKILL `victim` once the engine actor runs its commit (the write, then the probe)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if b"RolloutActor.commit" in Path(f"/proc/{actor_pid}/cmdline").read_bytes():
            os.kill(victim, signal.SIGKILL)
            killed.append(True)
            return
        time.sleep(0.002)


def test_an_engine_whose_vllm_process_dies_mid_write_is_replaced_and_the_sync_completes(tiny_qwen3, ray_cluster):
    """An engine in a child process (`rollout.in_process: false`, how tensor-parallel engines run): its vLLM process
    is killed while the engine writes a version. The engine's actor notices and exits instead of waiting on vLLM
    forever; the sync replaces the engine, hands it the version, and the step goes on."""
    import ray

    from rlpipe.actors.cluster import start_ray
    from rlpipe.actors.roles import Roles

    start_ray(load_config(None, ["ray.num_cpus=4"]))
    cfg = load_config(None, [
        f"model.path={tiny_qwen3}", "rollout.in_process=false", f"rollout.group_size={GROUP_SIZE}",
        "rollout.max_tokens=16", "rollout.max_model_len=128", "data.max_prompt_tokens=64",
        "train.prompts_per_step=2", "train.micro_batch_size=4", "train.lr=1e-3", "sync.probe_tolerance=1e-5",
        *TRANSPORT,
    ])
    notes: list[str] = []
    roles = Roles(cfg, tiny_qwen3, note=notes.append)
    try:
        prompts = _prompts(500, count=2)
        groups = roles.generate(prompts, GROUP_SIZE)
        actor_pid = _pid(roles.pool.engines[0])
        shared = set().union(*(_shm_files_of(_pid(engine)) for engine in roles.pool.engines))
        assert any("/psm_" in path for path in shared), f"the engine maps no vLLM segment: {sorted(shared)}"
        killed: list[bool] = []
        killer = threading.Thread(target=_kill_when_committing,
                                  args=(actor_pid, _vllm_process(actor_pid), killed), daemon=True)
        killer.start()
        metrics = _train_and_sync(roles, groups)
        killer.join(timeout=5)
        assert killed, "the engine never started writing"
        assert roles.engine_restarts == [1] and roles.policy_version == 1
        assert "rollout engine 0 died" in notes[-1]
        assert metrics["sync/probe_max_abs"] < 1e-5
        assert ray.get(roles.pool.engines[0].held_version.remote()) == 1
        _engine_matches_learner(roles, 0)
        prompts = _prompts(600, count=2)
        _check_groups(roles.generate(prompts, GROUP_SIZE), prompts, version=1)
        shared |= _shm_files_of(_pid(roles.pool.engines[0]))  # the engine started in the dead one's place
    finally:
        roles.shutdown()
    # The dead engine's vLLM files went when its replacement started (its record names them); the others', and the
    # replacement's, when the roles shut down: /dev/shm holds none of them.
    assert not [path for path in shared if Path(path).exists()]


def _latest_step(run_dir) -> int:
    from rlpipe.training import checkpoint

    try:
        return checkpoint.read_trainer_state(checkpoint.resolve(run_dir))["step"]
    except checkpoint.CheckpointError:  # nothing saved yet
        return 0


def _wait_for_checkpoint(driver: subprocess.Popen, run_dir, step: int, stderr, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while _latest_step(run_dir) < step:
        assert driver.poll() is None, (f"the driver ended (exit {driver.returncode}) before checkpoint {step}:\n"
                                       + stderr.read_text()[-3000:])
        assert time.monotonic() < deadline, f"no checkpoint of step {step} within {timeout_s:g} s"
        time.sleep(0.2)


def test_a_killed_learner_rank_is_auto_resumed_and_a_killed_driver_is_resumed(tmp_path, tiny_qwen3):
    """One run, two kills (SIGKILL). A learner rank dies after checkpoint 1: the step stops at once and
    `--auto-resume` starts the run again from that checkpoint, in the same driver. Then the driver itself dies
    after checkpoint 3: `rlpipe train --resume` continues. Every step is logged once, none lost or repeated."""
    run_dir = tmp_path / "runs" / "killed"
    steps = 5
    command = [
        sys.executable, "-m", "rlpipe.cli", "train",
        f"run.output_dir={tmp_path / 'runs'}", "run.name=killed", f"model.path={tiny_qwen3}",
        "learner.ranks=2", "learner.collective_timeout_s=600", "rollout.group_size=4", "rollout.max_tokens=12",
        "rollout.max_model_len=128", "data.max_prompt_tokens=112", "data.size=32", "data.eval_size=0",
        f"train.steps={steps}", "train.prompts_per_step=2", "train.micro_batch_size=4", "train.checkpoint_every=1",
        "ray.num_cpus=4", "metrics.tensorboard=false", "metrics.plot=false", "metrics.export=false",
        "sync.transport=shm",  # both ranks write into rank 0's segments; the killed processes' must not outlive them
    ]
    stderr = tmp_path / "driver.stderr"
    # Its own session, so the Ray processes it started can be cleaned up after the kill (a killed driver cannot).
    with open(stderr, "w") as err:
        driver = subprocess.Popen([*command, "--auto-resume"], start_new_session=True, stdout=subprocess.DEVNULL,
                                  stderr=err)
    try:
        _wait_for_checkpoint(driver, run_dir, 1, stderr)
        # Ray names an actor's process after its class; this run's cluster is the only one on the machine.
        ranks = subprocess.run(["pgrep", "-f", "ray::LearnerActor"], capture_output=True, text=True).stdout.split()
        assert ranks, "no learner rank process found"
        os.kill(int(ranks[-1]), signal.SIGKILL)
        _wait_for_checkpoint(driver, run_dir, 3, stderr)
        os.kill(driver.pid, signal.SIGKILL)  # the driver alone, wherever it is in step 4 (or saving it)
        driver.wait(timeout=30)
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    restarts = [line for line in stderr.read_text().splitlines() if "auto-resume 1 of 3" in line]
    assert len(restarts) == 1 and "restarting from step_00000" in restarts[0], stderr.read_text()[-3000:]
    assert "died" in restarts[0]  # where the run noticed it: a training step or a weight sync
    killed_at = _latest_step(run_dir)
    assert 3 <= killed_at < steps  # a checkpoint interrupted mid-write is never the one "latest" names
    # The kill may cut the last line short; the checkpointed steps' lines were written before their checkpoint.
    kept = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:killed_at]]

    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=600,
                             start_new_session=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # every step once
    assert records[:killed_at] == kept  # continued, not restarted: the checkpointed steps' records (timings too)
    assert [r["policy_version"] for r in records] == list(range(1, steps + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sync_check"]["sync/probe_max_abs"] < 1e-4
    assert not _orphaned_segments()  # the killed run's were removed by the resumed one, which freed its own


def _orphaned_segments() -> list[str]:
    """rlpipe's shared-memory files whose creating process is gone: weight-sync segments (rlpipe-<pid>-...) and
    engines' records of vLLM's files (rlpipe-engine-<pid>)."""
    orphans = []
    for name in os.listdir("/dev/shm"):
        pid = name.removeprefix("rlpipe-").removeprefix("engine-").split("-")[0]
        if name.startswith("rlpipe-") and pid.isdigit():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                orphans.append(name)
    return orphans
