"""Training curves from a run's metrics.jsonl, drawn with matplotlib: what `rlpipe train` writes as
<run_dir>/curves.png at the end of a run, and what `rlpipe plot RUN_DIR [RUN_DIR ...]` draws again for any run, or
for several overlaid (one colour a run, named in the figure's legend).

One panel per thing a practitioner reads, each drawn only when a run logged its metrics (KL only with
algo.kl_beta > 0, the log-prob gap only once the learner ran tokens, ...):

- reward: the mean over the step's samples, a band of +-1 standard deviation over them, and the smoothed mean;
- reward by function, when the run has more than one reward function (each function's unweighted mean);
- accuracy: the greedy held-out accuracy at every evaluation (before training at step 0, every `eval.every` steps,
  after the last), and with `eval.samples_per_prompt` = k > 1 the held-out mean@k and pass@k, from summary.json's
  evaluations (else the steps' eval/* metrics); the step's sample accuracy too, unless it equals the mean reward at
  every step (0/1 rewards);
- policy loss; gradient norm (before clipping); response length (mean and max, tokens); entropy per token;
  KL to the reference model; the learner-vs-rollout log-prob gap on the sampled tokens (mean and max |difference|);
- step time split by phase (generate, reward, train, sync, the driver outside them): stacked over steps for one
  run; for several, each run's mean seconds a step per phase, side by side.

Smoothing: a per-step value is drawn thin, and over it an exponential moving average over steps, debiased as
TensorBoard's is (s_t = w s_(t-1) + (1 - w) x_t, divided by 1 - w^t, so the first steps are not pulled towards 0).
w = 0.6 by default (`rlpipe plot --smooth W`; 0 draws the raw values only): over a 10-step run a step's weight halves
about every 1.4 steps. Steps without a value (a mean over no scored sample is logged as null) are skipped.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SMOOTHING = 0.6
PHASES = (  # metrics key, legend label
    ("time/generate", "generate"),
    ("time/reward", "reward"),
    ("time/train", "train"),
    ("time/sync", "sync"),
    ("time/outside_phases", "driver, outside phases"),
)
# reward/<name> keys that are not a reward function's mean
_REWARD_STATS = {"reward/mean", "reward/std", "reward/unscored"}


class PlotError(ValueError):
    """Input that cannot be plotted; the message is one line naming the file or option at fault."""


@dataclass
class RunCurves:
    """One run's step records (metrics.jsonl, in step order), its held-out accuracy before/after training and its
    held-out evaluations ({"step", "accuracy", "mean@k", "pass@j"}: summary.json's "eval")."""

    name: str
    records: list[dict]
    eval_before: float | None = None
    eval_after: float | None = None
    eval_points: list[dict] | None = None

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """Steps and values of `key` over the records that have it (null as NaN)."""
        rows = [(r["step"], _number(r[key])) for r in self.records if key in r]
        steps = np.array([s for s, _ in rows], dtype=np.float64)
        return steps, np.array([v for _, v in rows], dtype=np.float64)

    def has(self, key: str) -> bool:
        """Whether some step logged a finite value of `key`."""
        return bool(np.isfinite(self.series(key)[1]).any())

    @property
    def last_step(self) -> int:
        return self.records[-1]["step"]

    def reward_functions(self) -> list[str]:
        keys = dict.fromkeys(k for r in self.records for k in r)
        return [k for k in keys if k.startswith("reward/") and k not in _REWARD_STATS and "/failures/" not in k]


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def smooth(values: np.ndarray, weight: float = SMOOTHING) -> np.ndarray:
    """Debiased exponential moving average over steps (see the module's docstring); NaN steps are skipped (they
    keep the average so far)."""
    out = np.full(len(values), np.nan)
    total, seen = 0.0, 0
    for i, value in enumerate(values):
        if np.isfinite(value):
            total = weight * total + (1 - weight) * value
            seen += 1
        if seen:
            out[i] = total / (1 - weight**seen)
    return out


# ---------------------------------------------------------------- reading runs


def read_run(run_dir: str | Path, name: str | None = None) -> RunCurves:
    """A run directory's metrics.jsonl (and the held-out accuracy in its summary.json, when the run got that far).
    Raises PlotError naming what is missing or malformed."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise PlotError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir}: not a directory (give a run directory, the one holding metrics.jsonl)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (not a run directory, or no step of the run has finished)")
    records = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise PlotError(f"{path}: line {number} is not JSON ({err.msg})") from None
        if not isinstance(record, dict) or isinstance(record.get("step"), bool) or not isinstance(record.get("step"), int):
            raise PlotError(f"{path}: line {number} is not a step record (an object with an integer step)")
        records.append(record)
    if not records:
        raise PlotError(f"{path}: empty (no step of the run has finished)")
    curves = RunCurves(name or run_dir.resolve().name, _by_step(records))
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        try:
            summary = json.loads(_read_text(summary_path))
        except json.JSONDecodeError as err:
            raise PlotError(f"{summary_path}: not JSON ({err.msg})") from None
        if not isinstance(summary, dict):
            raise PlotError(f"{summary_path}: not a JSON object")
        curves.eval_before = _held_out(summary.get("eval_before"))
        curves.eval_after = _held_out(summary.get("eval_after"))
        curves.eval_points = _eval_points(summary.get("eval"))
    return curves


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise PlotError(f"{path}: not text (a metrics file is UTF-8 JSON lines)") from None
    except OSError as err:
        raise PlotError(f"{path}: cannot read ({err.strerror})") from None


def _held_out(value) -> float | None:
    value = _number(value)
    return value if math.isfinite(value) else None


def _eval_points(points) -> list[dict] | None:
    """summary.json's evaluations, those with a step and a finite greedy accuracy; None when it holds none."""
    if not isinstance(points, list):
        return None
    kept = [{name: _number(value) for name, value in point.items()} for point in points if isinstance(point, dict)
            and isinstance(point.get("step"), int) and _held_out(point.get("accuracy")) is not None]
    return [{**point, "step": int(point["step"])} for point in kept] or None


def _by_step(records: list[dict]) -> list[dict]:
    """Records in step order, the last one logged for a step kept."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def run_names(run_dirs: list[str | Path]) -> list[str]:
    """Each run's folder name, with its parent's where two runs share a name (and the whole path where that is not
    enough)."""
    paths = [Path(d).resolve() for d in run_dirs]
    for depth in (1, 2):
        names = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]


# ---------------------------------------------------------------- the figure


def figure(runs: list[RunCurves], smoothing: float = SMOOTHING):
    """The matplotlib Figure of `runs` (one, or several overlaid); PlotError when none of them logged a metric
    any panel draws."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = [panel for panel in _PANELS if any(panel.wanted(run) for run in runs)]
    if not panels:
        raise PlotError(f"{', '.join(r.name for r in runs)}: metrics.jsonl holds none of the metrics the plots draw")
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig = Figure(figsize=(5.4 * columns, 3.8 * rows + 0.6), layout="constrained")
    grid = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in grid[len(panels):]:
        ax.remove()
    for ax, panel in zip(grid, panels):
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        panel.draw(ax, runs, smoothing)
    if len(runs) == 1:
        run = runs[0]
        fig.suptitle(f"{run.name}: {len(run.records)} steps")
    else:
        fig.suptitle(" vs ".join(run.name for run in runs))
        from matplotlib.lines import Line2D

        fig.legend(
            handles=[Line2D([], [], color=_color(i), lw=2, label=run.name) for i, run in enumerate(runs)],
            loc="outside lower center", ncols=min(len(runs), 4), title="runs",
        )
    return fig


def _color(index: int) -> str:
    return f"C{index % 10}"


def _style_legend(ax, styles: list[tuple[str, dict]]) -> None:
    """A legend of what each line style means (runs are told apart by colour, in the figure's legend)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color="0.6", alpha=kw["alpha"], label=label) if kw.get("patch") else
               Line2D([], [], color="0.35", label=label, **kw) for label, kw in styles]
    ax.legend(handles=handles, fontsize="small")


RAW = {"lw": 0.8, "alpha": 0.45, "marker": "o", "markersize": 2.5}
SMOOTH = {"lw": 2.0}


def _raw_and_smoothed(ax, run: RunCurves, key: str, color: str, smoothing: float, style: dict | None = None) -> bool:
    """The per-step values of `key`, thin, with their moving average over them (left out when smoothing is 0)."""
    steps, values = run.series(key)
    if not np.isfinite(values).any():
        return False
    extra = style or {}
    if smoothing > 0:
        ax.plot(steps, values, color=color, label=f"{run.name}: {key}", **{**RAW, **extra})
        ax.plot(steps, smooth(values, smoothing), color=color, label=f"{run.name}: {key} (EMA {smoothing:g})",
                **{**SMOOTH, **extra})
    else:
        ax.plot(steps, values, color=color, label=f"{run.name}: {key}", **{**SMOOTH, "marker": "o", "markersize": 3,
                                                                           **extra})
    return True


def _series_legend(ax, smoothing: float, extra: list[tuple[str, dict]] = ()) -> None:
    styles = [("per step", RAW), (f"EMA {smoothing:g}", SMOOTH)] if smoothing > 0 else []
    if styles or extra:
        _style_legend(ax, [*styles, *extra])


def _has(*keys: str):
    return lambda run: any(run.has(key) for key in keys)


@dataclass
class _Panel:
    title: str
    ylabel: str
    wanted: object  # run -> whether the run has something this panel draws
    draw: object  # (ax, runs, smoothing) -> None; may set its own title and axis labels
    xlabel: str = "step"


def _single(key: str):
    def draw(ax, runs, smoothing):
        for i, run in enumerate(runs):
            _raw_and_smoothed(ax, run, key, _color(i), smoothing)
        _series_legend(ax, smoothing)

    return draw


def _reward(ax, runs, smoothing):
    band = False
    for i, run in enumerate(runs):
        steps, mean = run.series("reward/mean")
        if run.has("reward/std"):
            std = np.array([_number(r.get("reward/std")) for r in run.records if "reward/mean" in r])
            ax.fill_between(steps, mean - std, mean + std, color=_color(i), alpha=0.15, lw=0)
            band = True
        _raw_and_smoothed(ax, run, "reward/mean", _color(i), smoothing)
    extra = [("+-1 std over samples", {"patch": True, "alpha": 0.3})] if band else []
    _series_legend(ax, smoothing, extra)


DASHES = ("-", "--", ":", "-.")


def _reward_functions(ax, runs, smoothing):
    names = list(dict.fromkeys(k for run in runs if len(run.reward_functions()) > 1 for k in run.reward_functions()))
    for i, run in enumerate(runs):
        for key in run.reward_functions() if len(run.reward_functions()) > 1 else ():
            steps, values = run.series(key)
            shown = smooth(values, smoothing) if smoothing > 0 else values
            ax.plot(steps, shown, color=_color(i), ls=DASHES[names.index(key) % len(DASHES)], lw=1.6,
                    label=f"{run.name}: {key}")
    suffix = f" (EMA {smoothing:g})" if smoothing > 0 else ""
    _style_legend(ax, [(key.removeprefix("reward/") + suffix, {"ls": DASHES[j % len(DASHES)]})
                       for j, key in enumerate(names)])


def _held_out_points(run: RunCurves) -> list[dict]:
    """The run's held-out evaluations in step order: summary.json's, else the steps' eval/* metrics with the
    accuracy before (step 0) and after training (the last step) where those are known."""
    if run.eval_points:
        return sorted(run.eval_points, key=lambda point: point["step"])
    points = {r["step"]: {"step": r["step"], **{k[5:]: _number(v) for k, v in r.items() if k.startswith("eval/")}}
              for r in run.records if _held_out(r.get("eval/accuracy")) is not None}
    for step, value in ((0, run.eval_before), (run.last_step, run.eval_after)):
        if value is not None and step not in points:
            points[step] = {"step": step, "accuracy": value}
    return [points[step] for step in sorted(points)]


def _sample_accuracy_differs(run: RunCurves) -> bool:
    """False when the step's sample accuracy is the mean reward at every step (0/1 rewards): drawn once is enough."""
    if not run.has("accuracy"):
        return False
    _, accuracy = run.series("accuracy")
    rewards = np.array([_number(r.get("reward/mean")) for r in run.records if "accuracy" in r])
    return not np.allclose(accuracy, rewards, equal_nan=True)


SAMPLED_STYLES = {"mean": {"ls": "-.", "marker": "^"}, "pass": {"ls": (0, (1, 1)), "marker": "v"}}


def _accuracy(ax, runs, smoothing):
    held, samples, sampled = False, False, {}
    for i, run in enumerate(runs):
        points = _held_out_points(run)
        if points:
            steps = [point["step"] for point in points]
            ax.plot(steps, [point["accuracy"] for point in points], color=_color(i), ls="--", marker="s",
                    markersize=7, lw=1.2, label=f"{run.name}: held-out accuracy")
            for point, when in ((points[0], "before"), (points[-1], "after")) if len(points) > 1 else ():
                right = when == "after"  # written to the left of the last step, inside the axes
                ax.annotate(f"{when} {point['accuracy']:.2f}", (point["step"], point["accuracy"]),
                            textcoords="offset points", xytext=(-6 if right else 6, 6), ha="right" if right else "left",
                            fontsize="small", color=_color(i))
            # mean@k and the largest pass@j, where the evaluation sampled k completions per prompt
            for kind in SAMPLED_STYLES:
                names = sorted({name for point in points for name in point if name.startswith(f"{kind}@")},
                               key=lambda name: int(name.split("@")[1]))
                if names:
                    name = names[-1]
                    shown = [(point["step"], point[name]) for point in points if name in point]
                    ax.plot(*zip(*shown), color=_color(i), lw=1.2, markersize=5, label=f"{run.name}: held-out {name}",
                            **SAMPLED_STYLES[kind])
                    sampled[kind] = name
            held = True
        if _sample_accuracy_differs(run):
            samples |= _raw_and_smoothed(ax, run, "accuracy", _color(i), smoothing, {"ls": ":"})
    ax.set_ylim(-0.05, 1.1)
    styles = [("held-out, greedy", {"ls": "--", "marker": "s"})] if held else []
    styles += [(f"held-out, {name} sampled", SAMPLED_STYLES[kind]) for kind, name in sampled.items()]
    if samples:
        styles.append(("step's samples" + (f" (EMA {smoothing:g})" if smoothing > 0 else ""), {"ls": ":"}))
    _style_legend(ax, styles)


def _mean_and_max(mean_key: str, max_key: str, log: bool = False):
    def draw(ax, runs, smoothing):
        positive = True
        for i, run in enumerate(runs):
            _raw_and_smoothed(ax, run, mean_key, _color(i), smoothing)
            steps, values = run.series(max_key)
            if np.isfinite(values).any():
                ax.plot(steps, values, color=_color(i), ls="--", lw=1.2, label=f"{run.name}: {max_key}")
            finite = np.concatenate([run.series(mean_key)[1], values])
            positive &= bool((finite[np.isfinite(finite)] > 0).all())
        if log and positive:  # a gap of exactly 0 (the same kernels both sides) cannot sit on a log axis
            ax.set_yscale("log")
        _series_legend(ax, smoothing, [("max over the step", {"ls": "--"})])

    return draw


def _step_time(ax, runs, smoothing):
    if len(runs) == 1:
        (run,) = runs
        present = [(key, label) for key, label in PHASES if run.has(key)]
        steps = np.array([r["step"] for r in run.records], dtype=np.float64)
        stacked = [np.nan_to_num(np.array([_number(r.get(key)) for r in run.records])) for key, _ in present]
        ax.stackplot(steps, *stacked, labels=[label for _, label in present], alpha=0.85)
        ax.legend(fontsize="small", loc="upper right")
        return
    present = [(key, label) for key, label in PHASES if any(run.has(key) for run in runs)]
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        means = [np.nanmean(run.series(key)[1]) if run.has(key) else 0.0 for key, _ in present]
        ax.bar(np.arange(len(present)) + (i - (len(runs) - 1) / 2) * width, means, width, color=_color(i),
               label=run.name)
    ax.set_xticks(np.arange(len(present)), [label.split(",")[0] for _, label in present])
    ax.set_title("Mean step time by phase")
    ax.set_xlabel("phase")
    ax.set_ylabel("seconds a step")


def _wants_functions(run: RunCurves) -> bool:
    return len(run.reward_functions()) > 1 and any(run.has(key) for key in run.reward_functions())


def _wants_accuracy(run: RunCurves) -> bool:
    return bool(_held_out_points(run)) or _sample_accuracy_differs(run)


_PANELS = [
    _Panel("Reward (mean over the step's samples)", "reward", _has("reward/mean"), _reward),
    _Panel("Reward by function (unweighted)", "reward", _wants_functions, _reward_functions),
    _Panel("Accuracy", "share correct", _wants_accuracy, _accuracy),
    _Panel("Policy loss", "loss", _has("loss"), _single("loss")),
    _Panel("Gradient norm (before clipping)", "L2 norm", _has("grad_norm"), _single("grad_norm")),
    _Panel("Response length", "tokens", _has("completion_len/mean"),
           _mean_and_max("completion_len/mean", "completion_len/max")),
    _Panel("Entropy (learner, per token)", "nats", _has("entropy"), _single("entropy")),
    _Panel("KL to the reference model (per token)", "nats", _has("kl"), _single("kl")),
    _Panel("Log-prob gap, learner vs rollout", "|learner - rollout| log-prob", _has("logprob_gap/mean_abs"),
           _mean_and_max("logprob_gap/mean_abs", "logprob_gap/max_abs", log=True)),
    _Panel("Step time by phase", "seconds", _has(*(key for key, _ in PHASES)), _step_time),
]


# ---------------------------------------------------------------- writing


def save(fig, out: str | Path) -> Path:
    """Write `fig` to `out` (its format from the suffix) through a temporary file, so a failed write leaves no
    half image behind."""
    out = Path(out)
    fmt = out.suffix.lstrip(".").lower()
    temporary = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(temporary, format=fmt, dpi=100)
        temporary.replace(out)
    except OSError as err:
        temporary.unlink(missing_ok=True)
        raise PlotError(f"{out}: cannot write ({err.strerror})") from None
    return out


def check_output(out: str | Path) -> Path:
    """`out` names a new or replaceable image file, in a format matplotlib writes, in a folder that exists."""
    from matplotlib.backend_bases import FigureCanvasBase

    out = Path(out)
    formats = FigureCanvasBase.get_supported_filetypes()
    fmt = out.suffix.lstrip(".").lower()
    if out.is_dir():
        raise PlotError(f"{out}: is a directory (name the image file to write)")
    if fmt not in formats:
        raise PlotError(f"{out}: not an image file name matplotlib writes (use a suffix such as .png, .svg or .pdf)")
    if not out.parent.is_dir():
        raise PlotError(f"{out}: folder {out.parent} does not exist")
    return out


def plot_history(history: list[dict], out_png: str | Path, name: str, eval_before: float | None = None,
                 eval_after: float | None = None, smoothing: float = SMOOTHING,
                 eval_points: list[dict] | None = None) -> Path | None:
    """The end of `rlpipe train`: the run's curves from its in-memory history (the records metrics.jsonl holds) and
    its held-out evaluations (summary.json's "eval"); None when there is nothing to plot (no step ran)."""
    run = RunCurves(name, _by_step(history), _held_out(eval_before), _held_out(eval_after), _eval_points(eval_points))
    if not run.records:
        return None
    try:
        fig = figure([run], smoothing)
    except PlotError:
        return None
    return save(fig, out_png)


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None, smoothing: float = SMOOTHING) -> Path:
    """`rlpipe plot`: the curves of one run (to RUN_DIR/curves.png unless `out` says otherwise) or of several
    overlaid (to `out`, which is then required). Every input is checked before anything is written; PlotError
    names the first problem."""
    if not run_dirs:
        raise PlotError("name at least one run directory")
    if not 0 <= smoothing < 1:
        raise PlotError(f"--smooth: the EMA weight must be in [0, 1), got {smoothing:g}")
    if out is None and len(run_dirs) > 1:
        raise PlotError(f"comparing {len(run_dirs)} runs: name the image to write with -o (e.g. -o compare.png)")
    runs = [read_run(d, name) for d, name in zip(run_dirs, run_names(run_dirs))]
    out = check_output(Path(run_dirs[0]) / "curves.png" if out is None else out)
    return save(figure(runs, smoothing), out)
