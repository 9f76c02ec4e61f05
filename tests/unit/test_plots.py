"""rlpipe.reporting.plots and `rlpipe plot`: the panels a run's metrics call for, titled and labelled, one run or several
overlaid; bad input stops in one line (exit 2) with nothing written."""

import json
import math

import numpy as np
import pytest

from rlpipe.cli import main
from rlpipe.reporting.plots import PlotError, figure, plot_history, plot_runs, read_run, smooth


def _record(step: int, kl: bool = True, two_rewards: bool = False) -> dict:
    """One step's record with the keys a real run writes (a tiny Qwen3, reasoning-gym verifier, algo.kl_beta=0.05)."""
    reward = 0.25 + 0.05 * step + (0.1 if step % 2 else -0.1)
    record = {
        "step": step, "staleness/max": 0.0, "staleness/mean": 0.0, "samples_trained": 8.0,
        "advantage/abs_mean": 0.889, "loss": -0.01 * step, "grad_norm": 3.4 - 0.1 * step, "lr": 0.001,
        "train_tokens": 96.0, "learner/samples_run": 8.0, "clip_fraction": 0.0, "entropy": 5.61 - 0.01 * step,
        "logprob_gap/mean_abs": 4.5e-07, "logprob_gap/max_abs": 1.43e-06, "logprob_gap/kl": 0.0,
        "sync/probe_max_abs": 1.9e-06, "sync/probe_mean_abs": 4.5e-07, "sync/bytes": 493312.0,
        "sync/transfer_s": 0.0078, "sync/write_s": 0.0218, "sync/policy_shift": 1.29, "reward/mean": reward,
        "reward/std": 0.3, "reward/unscored": 0.0, "accuracy": reward, "completion_len/mean": 12.0 - 0.5 * step,
        "completion_len/max": 12.0, "truncated_fraction": 1.0, "completion_tokens": 96.0,
        "reward/failures/verifier": 0.0, "reward/verifier": reward, "time/generate": 0.075, "time/reward": 0.003,
        "time/train": 0.033, "time/sync": 0.041, "time/step": 0.155, "time/outside_phases": 0.002,
        "time/driver_cpu": 0.012, "tokens_per_s/generate": 1275.7, "rollout/restarts": 0.0,
        "policy_version": float(step), "nonfinite_values": 0,
    }
    if kl:
        record["kl"] = 0.001 * step
    if two_rewards:
        record.update({"reward/length": 12.0, "reward/failures/length": 0.0, "reward/mean": reward + 0.12,
                       "accuracy": 0.5})
    return record


def _run_dir(tmp_path, name="run", steps=6, summary=(0.25, 0.5), **record_options):
    run_dir = tmp_path / name
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(_record(step, **record_options)) + "\n" for step in range(1, steps + 1))
    )
    if summary is not None:
        before, after = summary
        (run_dir / "summary.json").write_text(json.dumps({"eval_before": before, "eval_after": after}))
    return run_dir


def _panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


STEP_PANELS = ["Reward (mean over the step's samples)", "Accuracy", "Policy loss", "Gradient norm (before clipping)",
               "Response length", "Entropy (learner, per token)", "KL to the reference model (per token)",
               "Log-prob gap, learner vs rollout", "Step time by phase"]


def test_a_run_gets_one_titled_labelled_panel_per_metric(tmp_path):
    fig = figure([read_run(_run_dir(tmp_path))])
    assert [ax.get_title() for ax in fig.axes] == STEP_PANELS
    assert fig.get_suptitle() == "run: 6 steps"
    for ax in fig.axes:
        assert ax.get_xlabel() == "step" and ax.get_ylabel(), ax.get_title()
    panels = _panels(fig)
    reward = panels["Reward (mean over the step's samples)"]
    assert len(reward.lines) == 2  # per step, and its moving average
    assert len(reward.collections) == 1  # the +-1 std band
    np.testing.assert_allclose(reward.lines[0].get_xdata(), range(1, 7))
    # 0/1-style rewards: the sample accuracy is the mean reward and is not drawn twice; the held-out accuracy is.
    (held_out,) = panels["Accuracy"].lines
    np.testing.assert_allclose(held_out.get_xdata(), [0, 6])
    np.testing.assert_allclose(held_out.get_ydata(), [0.25, 0.5])
    assert len(panels["Response length"].lines) == 3  # mean, its average, max
    assert panels["Log-prob gap, learner vs rollout"].get_yscale() == "log"
    legend = [t.get_text() for t in panels["Step time by phase"].get_legend().get_texts()]
    assert legend == ["generate", "reward", "train", "sync", "driver, outside phases"]


def test_panels_without_their_metrics_are_left_out(tmp_path):
    # No KL (algo.kl_beta 0), no summary.json (the run stopped early), 0/1 rewards: no KL or accuracy panel.
    run_dir = _run_dir(tmp_path, summary=None, kl=False)
    fig = figure([read_run(run_dir)])
    assert [ax.get_title() for ax in fig.axes] == [t for t in STEP_PANELS if not t.startswith(("KL", "Accuracy"))]
    # A step the learner skipped (every sample filtered) has no learner metrics: the panels stay, with a gap.
    records = [_record(1), {"step": 2, "reward/mean": 0.0, "reward/std": 0.0, "accuracy": 0.0}, _record(3)]
    (tmp_path / "sparse").mkdir()
    (tmp_path / "sparse" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loss = _panels(figure([read_run(tmp_path / "sparse")]))["Policy loss"]
    np.testing.assert_allclose(loss.lines[0].get_xdata(), [1, 3])


def test_a_null_value_is_a_gap_and_only_reward_left_is_still_a_figure(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": null}\n{"step": 2, "reward/mean": 0.5}\n')
    fig = figure([read_run(tmp_path)])
    assert [ax.get_title() for ax in fig.axes] == [STEP_PANELS[0]]
    raw, smoothed = fig.axes[0].lines
    assert math.isnan(raw.get_ydata()[0]) and raw.get_ydata()[1] == 0.5


def test_several_reward_functions_get_a_panel_and_the_sample_accuracy_is_drawn(tmp_path):
    fig = figure([read_run(_run_dir(tmp_path, two_rewards=True))])
    panels = _panels(fig)
    functions = panels["Reward by function (unweighted)"]
    assert sorted(line.get_label() for line in functions.lines) == ["run: reward/length", "run: reward/verifier"]
    assert [t.get_text() for t in functions.get_legend().get_texts()] == ["verifier (EMA 0.6)", "length (EMA 0.6)"]
    # accuracy now differs from the mean reward: held-out before/after, and the samples' accuracy with its average
    assert len(panels["Accuracy"].lines) == 3


def test_smoothing_is_a_debiased_moving_average_that_skips_missing_steps():
    np.testing.assert_allclose(smooth(np.array([2.0, 2.0, 2.0])), [2.0, 2.0, 2.0])  # no pull towards 0
    w = 0.6
    values = smooth(np.array([np.nan, 1.0, np.nan, 3.0]), w)
    assert math.isnan(values[0])
    expected = ((1 - w) * 1.0 * w + (1 - w) * 3.0) / (1 - w**2)
    np.testing.assert_allclose(values[1:], [1.0, 1.0, expected])
    np.testing.assert_allclose(smooth(np.array([1.0, 5.0]), 0.0), [1.0, 5.0])


def test_runs_overlaid_one_colour_each_named_in_the_legend(tmp_path):
    first = _run_dir(tmp_path / "a", name="baseline")
    second = _run_dir(tmp_path / "b", name="bigger-lr", steps=4, kl=False)
    fig = figure([read_run(first), read_run(second)])
    assert fig.get_suptitle() == "baseline vs bigger-lr"
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["baseline", "bigger-lr"]
    panels = _panels(fig)
    reward = panels["Reward (mean over the step's samples)"]
    assert [line.get_label() for line in reward.lines] == [
        "baseline: reward/mean", "baseline: reward/mean (EMA 0.6)",
        "bigger-lr: reward/mean", "bigger-lr: reward/mean (EMA 0.6)",
    ]
    assert reward.lines[0].get_color() != reward.lines[2].get_color()
    kl = panels["KL to the reference model (per token)"]  # only the run that logged it
    assert [line.get_label() for line in kl.lines] == ["baseline: kl", "baseline: kl (EMA 0.6)"]
    times = panels["Mean step time by phase"]  # stacks do not overlay: mean seconds per phase, a bar per run
    assert times.get_xlabel() == "phase" and len(times.patches) == 2 * 5
    assert [t.get_text() for t in times.get_xticklabels()] == ["generate", "reward", "train", "sync", "driver"]


def test_runs_with_the_same_folder_name_are_told_apart(tmp_path):
    first, second = _run_dir(tmp_path / "a"), _run_dir(tmp_path / "b")
    out = plot_runs([first, second], tmp_path / "cmp.png")
    assert out.read_bytes().startswith(b"\x89PNG")
    fig = figure([read_run(first, "a/run"), read_run(second, "b/run")])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a/run", "b/run"]


def test_the_end_of_a_run_writes_curves_png_from_its_history(tmp_path):
    history = [_record(step) for step in range(1, 4)]
    out = plot_history(history, tmp_path / "curves.png", "smollm2", eval_before=0.1, eval_after=0.3)
    assert out == tmp_path / "curves.png" and out.read_bytes().startswith(b"\x89PNG")
    assert plot_history([], tmp_path / "none.png", "empty") is None
    assert not (tmp_path / "none.png").exists()


def test_rlpipe_plot_writes_the_run_dirs_curves(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert capsys.readouterr().out.strip() == f"curves written to {run_dir / 'curves.png'}"
    other = _run_dir(tmp_path, name="other", kl=False)
    out = tmp_path / "compare.svg"
    assert main(["plot", str(run_dir), str(other), "-o", str(out), "--smooth", "0"]) == 0
    assert out.read_text().lstrip().startswith("<?xml")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def _bad(tmp_path, case):
    good = _run_dir(tmp_path, name="good")
    if case == "missing":
        return [str(tmp_path / "nope")], "nope: no such directory"
    if case == "no-metrics":
        (tmp_path / "empty-dir").mkdir()
        return [str(tmp_path / "empty-dir")], "empty-dir: no metrics.jsonl"
    if case == "empty":
        (tmp_path / "e").mkdir()
        (tmp_path / "e" / "metrics.jsonl").write_text("")
        return [str(tmp_path / "e")], "metrics.jsonl: empty"
    if case == "corrupt":
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / "metrics.jsonl").write_text(json.dumps(_record(1)) + '\n{"step": 2, "loss"\n')
        return [str(tmp_path / "c")], "metrics.jsonl: line 2 is not JSON"
    if case == "not-a-record":
        (tmp_path / "n").mkdir()
        (tmp_path / "n" / "metrics.jsonl").write_text('[1, 2]\n')
        return [str(tmp_path / "n")], "metrics.jsonl: line 1 is not a step record"
    if case == "bad-summary":
        (good / "summary.json").write_text("{")
        return [str(good)], "summary.json: not JSON"
    if case == "nothing-to-plot":
        (tmp_path / "s").mkdir()
        (tmp_path / "s" / "metrics.jsonl").write_text('{"step": 1, "lr": 0.1}\n')
        return [str(tmp_path / "s")], "holds none of the metrics the plots draw"
    if case == "two-runs-without-o":
        return [str(good), str(good)], "comparing 2 runs: name the image to write with -o"
    if case == "second-run-missing":
        return [str(good), str(tmp_path / "gone"), "-o", str(tmp_path / "cmp.png")], "gone: no such directory"
    if case == "output-folder-missing":
        return [str(good), "-o", str(tmp_path / "no" / "x.png")], "does not exist"
    if case == "output-format":
        return [str(good), "-o", str(tmp_path / "x.txt")], "not an image file name"
    if case == "smoothing":
        return [str(good), "--smooth", "1.5"], "--smooth: the EMA weight must be in [0, 1)"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing", "no-metrics", "empty", "corrupt", "not-a-record", "bad-summary",
                                  "nothing-to-plot", "two-runs-without-o", "second-run-missing",
                                  "output-folder-missing", "output-format", "smoothing"])
def test_bad_input_stops_in_one_line_and_writes_nothing(tmp_path, capsys, case):
    argv, expected = _bad(tmp_path, case)
    before = sorted(p for p in tmp_path.rglob("*"))
    assert main(["plot", *argv]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("rlpipe: plot: ") and expected in line, line
    assert captured.out == ""
    assert sorted(p for p in tmp_path.rglob("*")) == before  # no curves.png, no output, no temporary


def test_plot_error_is_a_value_error_with_one_line():
    with pytest.raises(PlotError, match="name at least one run directory"):
        plot_runs([])
