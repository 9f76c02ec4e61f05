"""What `rlpipe train` prints: rlpipe's own lines on the terminal, every process's INFO in <run_dir>/logs/run.log, and
an engine's error still on the terminal. Each run is the CLI in a process of its own, as a user runs it."""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RLPIPE_LINES = ("... ", "roles: ", "weight sync (", "held-out accuracy", "step ", "checkpoint saved", "done in ")


def logging_reward(prompts, completions, **_):
    """`length`, logging an INFO and an ERROR record as a library in a worker would."""
    library = logging.getLogger("vllm.rlpipe_test")
    library.info("INFO-MARKER from a reward worker")
    library.error("ERROR-MARKER from a reward worker")
    return [float(len(completion)) for completion in completions]


def _overrides(tmp_path, model_path, *overrides) -> list[str]:
    return [f"run.output_dir={tmp_path / 'runs'}", f"model.path={model_path}", "rollout.group_size=4",
            "rollout.max_tokens=12", "rollout.max_model_len=128", "data.max_prompt_tokens=112", "data.size=32",
            "data.eval_size=4", "train.steps=2", "train.prompts_per_step=2", "train.micro_batch_size=4",
            "ray.num_cpus=4", "metrics.export=false", *overrides]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _train(tmp_path, model_path, *overrides) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlpipe.cli", "train", *_overrides(tmp_path, model_path, *overrides)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=ENV,
    )


def test_the_terminal_shows_rlpipes_lines_and_the_log_file_the_rest(tmp_path, tiny_qwen3):
    # vLLM's reload (what MoE and quantized engines always use) logs warnings known to be harmless: hidden here.
    done = _train(tmp_path, tiny_qwen3, "run.name=quiet", "sync.engine_write=reload",
                  f"reward.functions=[{{name: '{__name__}:logging_reward'}}]")
    assert done.returncode == 0, done.stderr[-3000:]
    out, err = done.stdout.splitlines(), done.stderr
    # stdout: rlpipe's lines only — the start-up summary, a line per step, the notes and the final line.
    assert all(line.startswith(RLPIPE_LINES) for line in out), done.stdout
    assert [line.split(" |")[0] for line in out if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    roles = next(line for line in out if line.startswith("roles: "))
    assert "learner 1 rank" in roles and "rollout 1 engine" in roles and "reward 1 worker" in roles
    log_file = tmp_path / "runs" / "quiet" / "logs" / "run.log"
    assert out[-1].startswith("done in ") and out[-1].endswith(f"full log in {log_file}")
    # stderr: no INFO from vLLM, Ray or transformers, none of the known-harmless warnings; a library's error does show.
    assert not re.search(r"\bINFO\b", err), err
    for harmless in ("Failed to load weights", "Enforce eager set", "Token authentication is enabled",
                     "torch.distributed.reduce_op", "assuming the intent is to save in a single process",
                     "Loading safetensors checkpoint shards"):
        assert harmless not in err, harmless
    assert "ERROR vllm.rlpipe_test: ERROR-MARKER from a reward worker" in err
    # The log file: every process's INFO, the harmless warnings, and rlpipe's own lines.
    log = log_file.read_text()
    for line in ("driver INFO ray._private.worker: Started a local Ray instance.",
                 "rollout-0 INFO vllm.v1.engine.core: Initializing a V1 LLM engine",
                 "rollout-0 WARNING vllm.model_executor.model_loader.reload.layerwise: RotaryEmbedding: Failed to load",
                 "reward-0 INFO vllm.rlpipe_test: INFO-MARKER from a reward worker",
                 "driver INFO rlpipe.progress: step 2/2 |"):
        assert line in log, line


def test_an_engine_that_fails_to_start_says_why_on_the_terminal(tmp_path, tiny_qwen3):
    # vLLM refuses a context longer than the model's positions (512) when it builds the engine.
    done = _train(tmp_path, tiny_qwen3, "run.name=refused", "rollout.max_model_len=1024")
    assert done.returncode == 1
    assert "User-specified max_model_len (1024) is greater than the derived max_model_len" in done.stderr
    assert "rlpipe: the roles did not start; `rlpipe train --verbose` shows every process's log" in done.stderr


def _process_table() -> dict[int, tuple[int, str]]:
    """Every process on the machine: its id -> (its parent's id, its start time, which tells a reused id apart)."""
    table = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else None
        except OSError:  # ended meanwhile
            continue
        if stat is not None:
            fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
            table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def _descendants(pid: int) -> dict[int, str]:
    """The processes `pid` started and theirs (Ray's services, the actors, their children): id -> start time."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = {}, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found[child] = table[child][1]
        todo += children.get(child, [])
    return found


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:  # the process ended meanwhile
        return ""


def _shared_memory_of(processes: dict[int, str]) -> set[str]:
    """The /dev/shm files `processes` map (those already unlinked aside) and the weight-sync segments named after
    one of them."""
    mapped = {line.split(None, 5)[5] for pid in processes for line in _read(f"/proc/{pid}/maps").splitlines()
              if "/dev/shm/" in line and not line.endswith("(deleted)")}
    named = {str(path) for path in Path("/dev/shm").glob("rlpipe-*")
             if path.name.split("-")[1].isdigit() and int(path.name.split("-")[1]) in processes}
    return mapped | named


def _still_running(processes: dict[int, str], timeout_s: float) -> list[str]:
    """The command lines of `processes` still running after up to `timeout_s` (Ray's services end after the driver)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid, (_, started) in _process_table().items() if processes.get(pid) == started]
        if not left or time.monotonic() > deadline:
            return [_read(f"/proc/{pid}/cmdline").replace("\0", " ") for pid in left]
        time.sleep(0.5)


def test_sigterm_stops_a_run_in_one_line_that_says_how_to_resume_and_leaves_nothing_running(tmp_path, tiny_qwen3):
    """SIGTERM (`kill`, a job scheduler) ends `rlpipe train` the way Ctrl-C does: exit status 143, no traceback on
    the terminal (it is in run.log), one line naming the step reached, the last checkpoint, the steps lost and the
    command that resumes; the run's cluster, engines, reward workers and shared memory are gone."""
    from rlpipe.run.progress import steps_in_words

    overrides = _overrides(tmp_path, tiny_qwen3, "run.name=stopped", "train.steps=200", "train.checkpoint_every=2")
    run_dir = tmp_path / "runs" / "stopped"
    latest = run_dir / "checkpoints" / "latest"
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        driver = subprocess.Popen([sys.executable, "-m", "rlpipe.cli", "train", *overrides], stdout=stdout,
                                  stderr=stderr, cwd=tmp_path, env=ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not latest.is_file() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert latest.is_file(), f"no checkpoint (exit {driver.poll()}):\n{(tmp_path / 'stderr').read_text()[-3000:]}"
        processes = _descendants(driver.pid)
        shared = _shared_memory_of(processes)
        assert shared, "the run maps no shared memory of its own: nothing below checks that it is freed"
        cluster_folder = re.search(r"/session_[\w.-]+", " ".join(_read(f"/proc/{pid}/cmdline") for pid in processes))
        assert cluster_folder, "no process of the run names the Ray cluster's folder"
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    err = (tmp_path / "stderr").read_text()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("rlpipe:")]
    assert len(lines) == 1, err
    stopped = re.fullmatch(r"rlpipe: terminated \(SIGTERM\); stopped after step (\d+) of 200; last checkpoint: step "
                           r"(\d+) \((.+?)\): (.+); resume: (.+)", lines[0])
    assert stopped, lines[0]
    reached, saved, path, lost, command = stopped.groups()
    reached, saved = int(reached), int(saved)
    assert reached == len((run_dir / "metrics.jsonl").read_text().splitlines())  # the steps the run logged
    name = latest.read_text().strip()
    assert (saved, path) == (int(name.removeprefix("step_")), str(run_dir / "checkpoints" / name))
    assert lost == ("no step is lost" if reached == saved else f"{steps_in_words(saved + 1, reached)} "
                    f"{'is' if reached == saved + 1 else 'are'} lost")
    assert command == shlex.join(["rlpipe", "train", *overrides, "--resume"])
    assert "Traceback" in (run_dir / "logs" / "run.log").read_text()  # the details are kept
    # Nothing of the run is left: its processes (Ray's services, the actors, the reward sandboxes' children), any
    # process of its cluster started since, its shared memory.
    assert not _still_running(processes, timeout_s=60)
    of_cluster = [pid for pid in _process_table() if cluster_folder.group(0) in _read(f"/proc/{pid}/cmdline")]
    assert not of_cluster, [_read(f"/proc/{pid}/cmdline") for pid in of_cluster]
    assert not [path for path in shared if Path(path).exists()]
