"""rlpipe.run.evaluation: pass@k against brute force, mean@k, when a run evaluates, the best point; the `eval` config
section; the held-out figures in a step's line and in the curves; `rlpipe eval`'s bad input and an export's
evaluation."""

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlpipe.run import evaluation
from rlpipe.cli import main
from rlpipe.config import ConfigError, load_config
from rlpipe.reporting.metrics import MetricsLogger
from rlpipe.reporting.plots import figure, plot_history, read_run
from rlpipe.types import Completion, Group, Prompt


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_is_the_unbiased_estimator(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert evaluation.pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    assert evaluation.pass_at_k(n, 0, 1) == 0.0 and evaluation.pass_at_k(n, n, 1) == 1.0
    with pytest.raises(ValueError):
        evaluation.pass_at_k(n, n + 1, 1)
    with pytest.raises(ValueError):
        evaluation.pass_at_k(n, 0, n + 1)


def test_sampled_figures_average_over_prompts():
    assert evaluation.pass_ks(1) == [] and evaluation.pass_ks(2) == [2] and evaluation.pass_ks(4) == [2, 4]
    assert evaluation.pass_ks(6) == [2, 4, 6] and evaluation.pass_ks(8) == [2, 4, 8]
    figures = evaluation.sampled_figures([0, 1, 4, 2], 4)
    assert set(figures) == {"mean@4", "pass@2", "pass@4"}
    assert figures["mean@4"] == pytest.approx(7 / 16)
    assert figures["pass@4"] == pytest.approx(3 / 4)  # with k = n: the share of prompts with a correct sample
    expected = sum(_brute_force_pass_at_k(4, c, 2) for c in (0, 1, 4, 2)) / 4
    assert figures["pass@2"] == pytest.approx(expected)


def _cfg(*overrides):
    return load_config(None, ["train.steps=10", *overrides])


def test_a_run_evaluates_every_eval_every_steps_and_after_the_last():
    assert [s for s in range(1, 11) if evaluation.due(s, _cfg())] == [10]
    assert [s for s in range(1, 11) if evaluation.due(s, _cfg("eval.every=4"))] == [4, 8, 10]


def test_the_eval_section_checks_its_keys():
    cfg = _cfg("eval.samples_per_prompt=4", "eval.temperature=0.7")
    assert cfg.eval.sampled and cfg.eval.temperature == 0.7
    assert not _cfg("eval.samples_per_prompt=1").eval.sampled and _cfg().eval.every == 0
    for override, message in (("eval.every=-1", "eval.every: must be >= 0"),
                              ("eval.samples_per_prompt=-2", "eval.samples_per_prompt: must be >= 0"),
                              ("eval.temperature=0", "eval.temperature: must be above 0")):
        with pytest.raises(ConfigError, match=message):
            _cfg(override)


class _Roles:
    """Engines that answer prompt i's j-th sample with reward 1 when j < i (greedy: when i is odd); records the
    seeds and sampling asked for."""

    def __init__(self):
        self.calls, self.seeds = [], []

    def generate(self, prompts, n, **sampling):
        self.calls.append((n, sampling))
        return [Group(p, [Completion([1], [0.0], "x", "stop", 0) for _ in range(n)]) for p in prompts]

    def seed(self, step):
        self.seeds.append(step)

    def score(self, groups, state=None):
        for i, group in enumerate(groups):
            greedy = len(group.completions) == 1
            group.rewards = [float(i % 2) if greedy else float(j < i) for j in range(len(group.completions))]
        return {}, {}


class _PromptSet:
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def prompts(self, indexes):
        return [Prompt(i, f"q{i}", [1, 2]) for i in indexes]


def test_evaluate_reports_greedy_accuracy_mean_and_pass_at_k_and_seeds_only_the_sampled_part():
    roles = _Roles()
    cfg = _cfg("eval.samples_per_prompt=4", "rollout.temperature=0.9")
    point = evaluation.evaluate(roles, _PromptSet(4), cfg, step=6)
    assert roles.calls == [(1, {"temperature": 0.0}), (4, {"temperature": 0.9})]
    assert roles.seeds == [evaluation.EVAL_SEED_STEP + 6]  # never a training step's seed
    correct = [0, 1, 2, 3]
    assert point == {"step": 6, "accuracy": 0.5, **evaluation.sampled_figures(correct, 4)}
    assert evaluation.metrics(point) == {"eval/accuracy": 0.5, "eval/mean@4": point["mean@4"],
                                         "eval/pass@2": point["pass@2"], "eval/pass@4": 0.75}
    assert evaluation.describe(point) == "0.50 (greedy); mean@4 0.38, pass@2 0.58, pass@4 0.75"
    greedy_only = _Roles()
    assert evaluation.evaluate(greedy_only, _PromptSet(4), _cfg("eval.temperature=0.5"), 0) == {"step": 0, "accuracy": 0.5}
    assert greedy_only.seeds == [] and len(greedy_only.calls) == 1
    assert evaluation.evaluate(greedy_only, _PromptSet(0), cfg, 0) is None


def test_with_tools_the_held_out_figures_count_the_greedy_episodes_that_called_one():
    class _ToolRoles(_Roles):
        def generate(self, prompts, n, **sampling):
            groups = super().generate(prompts, n, **sampling)
            for i, group in enumerate(groups):
                for completion in group.completions:
                    completion.mask, completion.tool_calls = [1], int(i < 3)
            return groups

    point = evaluation.evaluate(_ToolRoles(), _PromptSet(4), _cfg(), step=2)
    assert point == {"step": 2, "accuracy": 0.5, "tool_call_rate": 0.75}
    assert evaluation.metrics(point)["eval/tool_call_rate"] == 0.75
    assert evaluation.describe(point) == "0.50 (greedy, tool calls in 0.75)"
    assert "tool_call_rate" not in evaluation.evaluate(_Roles(), _PromptSet(4), _cfg(), step=2)


def test_the_best_point_is_the_highest_greedy_accuracy_then_mean_then_the_earliest():
    points = [{"step": 0, "accuracy": 0.2, "mean@4": 0.1}, {"step": 4, "accuracy": 0.6, "mean@4": 0.3},
              {"step": 8, "accuracy": 0.6, "mean@4": 0.5}, {"step": 10, "accuracy": 0.6, "mean@4": 0.5}]
    assert evaluation.best(points)["step"] == 8
    assert evaluation.best([]) is None


def test_a_steps_line_shows_its_held_out_figures(tmp_path):
    log = MetricsLogger(tmp_path, 10, stream=open(tmp_path / "out.txt", "w"))
    line = log.format_line(4, {"reward/mean": 0.5, "eval/accuracy": 0.25, "eval/mean@4": 0.375, "eval/pass@4": 0.5})
    assert "held-out 0.25 | mean@4 0.38 | pass@4 0.50" in line
    assert "held-out" not in log.format_line(3, {"reward/mean": 0.5})


def test_the_curves_draw_every_evaluation_with_mean_and_pass_at_k(tmp_path):
    history = [{"step": s, "reward/mean": 0.1 * s, "accuracy": 0.5} for s in range(1, 5)]
    for record in history[1::2]:
        record.update({"eval/accuracy": 0.1 * record["step"], "eval/mean@4": 0.05, "eval/pass@2": 0.2,
                       "eval/pass@4": 0.3})
    points = [{"step": 0, "accuracy": 0.1, "mean@4": 0.0, "pass@2": 0.1, "pass@4": 0.2},
              *[{"step": r["step"], **{k[5:]: v for k, v in r.items() if k.startswith("eval/")}} for r in history[1::2]]]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    for source in ("records", "summary"):
        if source == "summary":
            (run_dir / "summary.json").write_text(json.dumps({"eval_before": 0.1, "eval_after": 0.4, "eval": points}))
        accuracy = {ax.get_title(): ax for ax in figure([read_run(run_dir)]).axes}["Accuracy"]
        lines = {line.get_label().split(": ", 1)[1]: line for line in accuracy.lines}
        steps = [2, 4] if source == "records" else [0, 2, 4]  # the summary also holds the one before training
        assert list(lines["held-out accuracy"].get_xdata()) == steps
        assert list(lines["held-out mean@4"].get_xdata()) == steps
        assert list(lines["held-out pass@4"].get_ydata())[-1] == 0.3 and "held-out pass@2" not in lines
    assert plot_history(history, tmp_path / "curves.png", "run", 0.1, 0.4, eval_points=points).is_file()


def test_rlpipe_eval_refuses_a_bad_path_before_anything_starts(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == f"rlpipe: eval: {tmp_path / 'missing'}: no such file or directory"
    assert main(["eval", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rlpipe: eval: {tmp_path}: not a Hugging Face folder (no config.json), nor a run or "
                          "checkpoint directory") and "\n" not in err
    (tmp_path / "config.json").write_text("{}")
    assert main(["eval", str(tmp_path), "eval.every=-1"]) == 2
    assert capsys.readouterr().err.strip().startswith("rlpipe: config error: eval.every: must be >= 0")
    assert main(["eval", str(tmp_path), "--out", str(tmp_path / "no" / "eval.json")]) == 2
    assert capsys.readouterr().err.strip() == f"rlpipe: config error: --out: folder {tmp_path / 'no'} does not exist"
    assert not (tmp_path / "eval.json").exists()


def test_rlpipe_eval_of_an_export_evaluates_that_folder_with_the_recipe_as_before_training(tmp_path, tiny_qwen3,
                                                                                          monkeypatch, capsys):
    """An HF folder (an export) is evaluated as it is, with the recipe's data and rewards, as step 0 (an export does
    not record its step); the engines' part is rlpipe.run.evaluation.evaluate, which the integration run drives."""
    from rlpipe.run import saved_weights

    started = {}

    def on_engines(cfg, model_path, tokenizer_path, columns, eval_set, step, state, logs):
        started.update(cfg=cfg, model_path=model_path, prompts=len(eval_set), step=step)
        return {"step": step, "accuracy": 0.25, "mean@4": 0.5, "pass@2": 0.625, "pass@4": 0.75}

    monkeypatch.setattr(saved_weights, "evaluate_on_engines", on_engines)
    out = tmp_path / "figures.json"
    assert main(["eval", tiny_qwen3, "data.size=16", "data.eval_size=4", "eval.samples_per_prompt=4",
                 "--out", str(out)]) == 0
    assert started["model_path"] == str(Path(tiny_qwen3).resolve()) == started["cfg"].model.path
    assert (started["step"], started["prompts"], started["cfg"].eval.samples_per_prompt) == (0, 4, 4)
    written = json.loads(out.read_text())
    assert written == {"path": tiny_qwen3, "weights": tiny_qwen3, "step": 0, "prompts": 4, "accuracy": 0.25,
                       "mean@4": 0.5, "pass@2": 0.625, "pass@4": 0.75}
    assert capsys.readouterr().out.strip() == (f"held-out accuracy of {tiny_qwen3} (step 0, 4 prompts): 0.25 (greedy); "
                                               f"mean@4 0.50, pass@2 0.62, pass@4 0.75; written to {out}")


def test_eval_points_of_a_summary_are_read_leniently(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"eval": [{"step": 0, "accuracy": None}, "x", {"step": 1}]}))
    assert read_run(run_dir).eval_points is None


def test_the_summary_keeps_the_best_evaluation_and_the_checkpoint_kept_at_its_step(tmp_path):
    from rlpipe.run.controller import summarize_evaluations

    notes = []
    run = SimpleNamespace(dir=tmp_path, log=SimpleNamespace(note=notes.append))
    points = [{"step": 0, "accuracy": 0.25}, {"step": 2, "accuracy": 0.75}, {"step": 4, "accuracy": 0.5}]
    summary = {"eval_before": 0.25, "eval": points}
    summarize_evaluations(run, summary, last_step=4)
    assert summary["eval_after"] == 0.5
    assert summary["eval_best"] == {"step": 2, "accuracy": 0.75, "checkpoint": None}  # step 2's was not kept
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    summarize_evaluations(run, summary, last_step=4)
    assert summary["eval_best"]["checkpoint"] == str(tmp_path / "checkpoints" / "step_000002")
    assert notes[-1] == ("held-out accuracy after training: 0.5 (before: 0.25); best at step 2: 0.75 (greedy), "
                         f"checkpoint {tmp_path / 'checkpoints' / 'step_000002'}")
    empty = {"eval_before": None, "eval": []}
    summarize_evaluations(run, empty, last_step=4)
    assert empty["eval_after"] is None and empty["eval_best"] is None
