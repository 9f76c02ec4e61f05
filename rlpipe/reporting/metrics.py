"""The one logging path: per-step metrics to JSONL and the configured trackers (rlpipe.reporting.trackers), a line per step
on the terminal with a live indicator during long phases (the plots drawn from these records are rlpipe.reporting.plots)."""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from rlpipe.reporting.logs import PROGRESS_LOGGER
from rlpipe.types import Group


def rollout_metrics(
    groups: list[Group],
    success_threshold: float,
    failures: dict[str, int] | None = None,
    timeouts: dict[str, int] | None = None,
) -> dict[str, float]:
    """Reward, accuracy and length statistics of a step's scored groups, and reward failures and timeouts per
    function."""
    rewards = [r for g in groups for r in g.rewards]
    scored = np.array([r for r in rewards if r is not None], dtype=np.float64)
    # The model's tokens: an episode's tool tokens were not generated.
    lengths = np.array([c.model_tokens for g in groups for c in g.completions], dtype=np.float64)
    truncated = [c.finish_reason == "length" for g in groups for c in g.completions]
    out = {
        "reward/mean": float(scored.mean()) if scored.size else math.nan,
        "reward/std": float(scored.std()) if scored.size else math.nan,
        "reward/unscored": float(len(rewards) - scored.size),
        "accuracy": float((scored >= success_threshold).sum() / max(1, len(rewards))),
        "completion_len/mean": float(lengths.mean()) if lengths.size else 0.0,
        "completion_len/max": float(lengths.max()) if lengths.size else 0.0,
        "truncated_fraction": float(np.mean(truncated)) if truncated else 0.0,
        "completion_tokens": float(lengths.sum()),
    }
    episodes = [c for g in groups for c in g.completions if c.mask is not None]
    if episodes:  # multi-turn episodes with tools (rlpipe/tools.py)
        out["turns/mean"] = float(np.mean([c.turns for c in episodes]))
        out["tool_call_rate"] = float(np.mean([c.tool_calls > 0 for c in episodes]))  # episodes that called a tool
        out["tool_calls"] = float(sum(c.tool_calls for c in episodes))
        out["tool_errors"] = float(sum(c.tool_errors for c in episodes))
        out["episodes_truncated"] = float(sum(c.finish_reason == "length" for c in episodes))
    for name, count in (failures or {}).items():
        out[f"reward/failures/{name}"] = float(count)
    for name, count in (timeouts or {}).items():
        out[f"reward/timeouts/{name}"] = float(count)
    for name in groups[0].reward_parts if groups else ():
        values = [v for g in groups for v in g.reward_parts[name] if v is not None]
        out[f"reward/{name}"] = float(np.mean(values)) if values else math.nan
    return out


def staleness_metrics(groups: list[Group], learner_version: int) -> dict[str, float]:
    """How many policy versions the learner is ahead of the policy that sampled each completion."""
    lags = [learner_version - c.policy_version for g in groups for c in g.completions]
    return {"staleness/max": float(max(lags, default=0)), "staleness/mean": float(np.mean(lags)) if lags else 0.0}


NONFINITE_KEY = "nonfinite_values"


def strict_json_record(record: dict) -> dict:
    """`record` as strict JSON can hold it: NaN and ±inf become null (json.dumps would write NaN/Infinity, which strict
    JSON readers refuse), and `nonfinite_values` counts them, so a null still reads as a value that was not finite."""
    nonfinite = [key for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)]
    return {**record, **dict.fromkeys(nonfinite), NONFINITE_KEY: record.get(NONFINITE_KEY, 0) + len(nonfinite)}


class MetricsLogger:
    """Writes every step's metrics to metrics.jsonl in the run directory, hands them to each tracker (TensorBoard,
    W&B, MLflow: rlpipe.reporting.trackers) and prints a line."""

    SHOWN = (
        ("reward/mean", "reward", "{:.3f}"),
        ("accuracy", "acc", "{:.2f}"),
        ("completion_len/mean", "len", "{:.0f}"),
        ("turns/mean", "turns", "{:.1f}"),
        ("tool_call_rate", "tools", "{:.2f}"),
        ("tool_errors", "tool_err", "{:.0f}"),
        ("logprob_gap/mean_abs", "gap", "{:.1e}"),
        ("loss", "loss", "{:+.4f}"),
        ("time/step", "s", "{:.1f}"),
        ("eval/accuracy", "held-out", "{:.2f}"),
    )

    def __init__(self, run_dir: Path, total_steps: int, trackers: list = (), stream=None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self.stream = sys.stdout if stream is None else stream
        self.status = LiveStatus(self.stream)
        self.history: list[dict] = []
        self._reported: set[str] = set()
        self.trackers = list(trackers)
        self.started = time.monotonic()

    def restore(self, history: list[dict]) -> None:
        """Continue a resumed run: the checkpoint's metrics become the history and metrics.jsonl (steps the
        interrupted run logged after its checkpoint are dropped; they will be run again)."""
        self.history = [strict_json_record(record) for record in history]
        temporary = self.path.with_name(".metrics.jsonl.tmp")
        temporary.write_text("".join(json.dumps(record, allow_nan=False) + "\n" for record in self.history))
        temporary.replace(self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = strict_json_record({"step": step, **metrics})
        self.history.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        for tracker in self.trackers:
            tracker.log(step, metrics)
        self._print(self.format_line(step, metrics))

    def log_samples(self, step: int, groups: list[Group], count: int = 2) -> None:
        """A few groups' completions and rewards per step in samples.jsonl: what the numbers are about."""
        with (self.run_dir / "samples.jsonl").open("a") as f:
            for group in groups[:count]:
                record = {
                    "step": step,
                    "sample_id": group.prompt.sample_id,
                    "prompt": group.prompt.question,
                    "completions": [c.text for c in group.completions],
                    "completion_tokens": [len(c.token_ids) for c in group.completions],
                    "finish_reasons": [c.finish_reason for c in group.completions],
                    "rewards": group.rewards,
                    "reward_parts": group.reward_parts,
                }
                if group.reward_extras:  # dict returns' other keys, log_extra's columns
                    record["reward_extras"] = group.reward_extras
                if any(c.messages is not None for c in group.completions):  # multi-turn episodes
                    record["conversations"] = [c.messages for c in group.completions]
                    record["turns"] = [c.turns for c in group.completions]
                    record["tool_calls"] = [c.tool_calls for c in group.completions]
                    record["tool_errors"] = [c.tool_errors for c in group.completions]
                f.write(json.dumps(record, default=repr) + "\n")  # a function's extras may be any object

    def format_line(self, step: int, metrics: dict[str, float]) -> str:
        elapsed = time.monotonic() - self.started
        eta = elapsed / max(1, len(self.history)) * max(0, self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}"]
        parts += [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in self.SHOWN if key in metrics]
        sampled = [key for key in metrics if key.startswith(("eval/mean@", "eval/pass@"))]  # the held-out mean@k, pass@k
        parts += [f"{key.removeprefix('eval/')} {metrics[key]:.2f}" for key in sampled]
        parts.append(f"eta {eta / 60:.1f}m")
        return " | ".join(parts)

    def final_line(self, elapsed_s: float, log_file: str | Path) -> str:
        """The run's last line: how long it took, the step reward at the first and last step, where things are."""
        rewards = [record["reward/mean"] for record in self.history if record.get("reward/mean") is not None]
        trend = f"; step reward {rewards[0]:.3f} at the first step, {rewards[-1]:.3f} at the last" if rewards else ""
        return f"done in {elapsed_s / 60:.1f} min{trend}; outputs in {self.run_dir}, full log in {log_file}"

    def reward_errors(self, errors: dict[str, str]) -> None:
        """Print each reward function's first error once; its failure count is in every step's metrics."""
        for name, message in errors.items():
            if name not in self._reported:
                self.note(f"reward function {name} failed on some samples (first error): {message}")
                self._reported.add(name)

    def note(self, message: str) -> None:
        self._print(message)

    def activity(self, label: str):
        """`with log.activity("step 3/10: generating"):` shows that the phase is under way while it lasts."""
        return self.status.phase(label)

    def _print(self, line: str) -> None:
        """A line on the terminal, copied to the run's log file (rlpipe.reporting.logs)."""
        self.status.write(line + "\n")
        logging.getLogger(PROGRESS_LOGGER).info(line)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def roles_summary(cfg, placement: dict[str, list[str]], log_file: str | Path) -> str:
    """The start-up line: what each role runs and where (`placement`: the node id of every actor, per role)."""

    def count(number: int, what: str) -> str:
        return f"{number} {what}{'' if number == 1 else 's'}"

    learner, rollout = cfg.learner, cfg.rollout
    engine = "vLLM" if rollout.model_impl == "vllm" else "vLLM with rlpipe's model"
    tensor_parallel = f", tensor-parallel {rollout.tensor_parallel}" if rollout.tensor_parallel > 1 else ""
    mode = "graph" if learner.graph else "eager"
    roles = (
        f"learner {count(len(placement['learner']), 'rank')} ({learner.device}, {mode}, {cfg.model.dtype}), rollout {count(len(placement['rollout']), 'engine')} ({engine}, {rollout.dtype}"
        f"{tensor_parallel}), reward {count(len(placement['reward']), 'worker')}"
    )
    nodes = {node for ids in placement.values() for node in ids}
    if len(nodes) <= 1:
        where = "on one node"
    else:
        where = f"on {count(len(nodes), 'node')} (" + "; ".join(
            f"{role}: {', '.join(sorted({node[:8] for node in ids}))}" for role, ids in placement.items()
        ) + ")"
    return f"roles: {roles}; {where}. Full log: {log_file}"


class LiveStatus:
    """A live indicator for phases that may take minutes (the first generation, a compile, an evaluation).

    On a terminal: a status line — a spinner, the phase, its seconds so far — shown once the phase has lasted
    `delay_s`, redrawn every `tick_s` and erased when the phase ends; any other output meanwhile (a note, a warning
    forwarded from an actor) erases it first, so lines never run into it. Elsewhere (a pipe, a log file): a line
    `... <phase> (N s)` every `every_s` seconds while the phase lasts. One phase at a time."""

    SPINNER = "|/-\\"

    def __init__(
        self, stream, tty: bool | None = None, delay_s: float = 1.0, tick_s: float = 0.25, every_s: float = 30.0
    ):
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)()) if tty is None else tty
        self.delay_s, self.tick_s, self.every_s = delay_s, tick_s, every_s
        self._lock = threading.RLock()
        self._shown = False  # the status line is on the terminal now

    @contextmanager
    def phase(self, label: str):
        started = time.monotonic()
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(label, started, stop), name="rlpipe-status", daemon=True)
        swapped = self._swap_std_streams() if self.tty else None
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            with self._lock:
                self._erase()
            if swapped:
                sys.stdout, sys.stderr = swapped

    def write(self, text: str) -> None:
        with self._lock:
            self._erase()
            self.stream.write(text)
            self.stream.flush()

    def _run(self, label: str, started: float, stop: threading.Event) -> None:
        turn, next_line = 0, self.every_s
        while not stop.wait(self.tick_s if self.tty else min(self.tick_s * 4, self.every_s)):
            elapsed = time.monotonic() - started
            with self._lock:
                if stop.is_set():
                    return
                if self.tty and elapsed >= self.delay_s:
                    self._erase()
                    line = f"{self.SPINNER[turn % len(self.SPINNER)]} {label} ({elapsed:.0f} s)"
                    self.stream.write(line[: shutil.get_terminal_size().columns - 1])  # one row: erasable
                    self.stream.flush()
                    self._shown, turn = True, turn + 1
                elif not self.tty and elapsed >= next_line:
                    self.stream.write(f"... {label} ({elapsed:.0f} s)\n")
                    self.stream.flush()
                    next_line += self.every_s

    def _erase(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self._shown = False

    def _swap_std_streams(self):
        """Route sys.stdout and sys.stderr (where Ray prints what actors write, and rlpipe.reporting.logs' console handler
        writes) through this status, so that their lines erase the status line first."""
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _ErasingStream(sys.stdout, self), _ErasingStream(sys.stderr, self)
        return saved


class _ErasingStream:
    """A text stream that erases the live status line before it writes (LiveStatus)."""

    def __init__(self, stream, status: LiveStatus):
        self._stream, self._status = stream, status

    def write(self, text: str) -> int:
        with self._status._lock:
            if text:
                self._status._erase()
            return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)

