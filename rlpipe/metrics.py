"""The one logging path: per-step metrics to JSONL and the configured trackers (rlpipe.trackers), a live line per
step, plots at the end."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from rlpipe.types import Group


def rollout_metrics(
    groups: list[Group], success_threshold: float, failures: dict[str, int] | None = None
) -> dict[str, float]:
    """Reward, accuracy and length statistics of a step's scored groups, and reward failures per function."""
    rewards = [r for g in groups for r in g.rewards]
    scored = np.array([r for r in rewards if r is not None], dtype=np.float64)
    lengths = np.array([len(c.token_ids) for g in groups for c in g.completions], dtype=np.float64)
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
    for name, count in (failures or {}).items():
        out[f"reward/failures/{name}"] = float(count)
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
    W&B, MLflow: rlpipe.trackers) and prints a line."""

    SHOWN = (
        ("reward/mean", "reward", "{:.3f}"),
        ("accuracy", "acc", "{:.2f}"),
        ("completion_len/mean", "len", "{:.0f}"),
        ("logprob_gap/mean_abs", "gap", "{:.1e}"),
        ("loss", "loss", "{:+.4f}"),
        ("time/step", "s", "{:.1f}"),
    )

    def __init__(self, run_dir: Path, total_steps: int, trackers: list = (), stream=None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self.stream = stream or sys.stdout  # looked up now: a default bound at import keeps a stdout since replaced
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
        self.stream.write(self.format_line(step, metrics) + "\n")
        self.stream.flush()

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
                f.write(json.dumps(record) + "\n")

    def format_line(self, step: int, metrics: dict[str, float]) -> str:
        elapsed = time.monotonic() - self.started
        eta = elapsed / max(1, len(self.history)) * max(0, self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}"]
        parts += [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in self.SHOWN if key in metrics]
        parts.append(f"eta {eta / 60:.1f}m")
        return " | ".join(parts)

    def reward_errors(self, errors: dict[str, str]) -> None:
        """Print each reward function's first error once; its failure count is in every step's metrics."""
        for name, message in errors.items():
            if name not in self._reported:
                self.note(f"reward function {name} failed on some samples (first error): {message}")
                self._reported.add(name)

    def note(self, message: str) -> None:
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def plot_curves(history: list[dict], out_png: Path, keys=("reward/mean", "accuracy")) -> Path | None:
    """A PNG with one panel per metric against the step; None when there is nothing to plot."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5))
    for ax, key in zip(np.atleast_1d(axes), keys):
        points = [(h["step"], h[key]) for h in history if key in h and h[key] is not None]
        if points:
            ax.plot(*zip(*points), marker="o")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
