"""rlpipe.cli in-process: `config show`, `train --help` (the values it would run with), `--version`, exit code 2 with one line naming the key, no run dir on error."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlpipe.cli import DEFAULT_RECIPE, main

REPO = Path(__file__).resolve().parents[2]


def _one_error_line(capsys, *keys: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    (line,) = lines
    assert line.startswith("rlpipe: config error:")
    for key in keys:
        assert key in line
    assert captured.out == ""
    return line


def test_default_recipe_is_the_repository_one():
    assert DEFAULT_RECIPE == REPO / "configs" / "default.yaml"
    assert DEFAULT_RECIPE.is_file()


def test_config_show_prints_the_default_recipe(capsys):
    assert main(["config", "show"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["run"]["name"] == "smollm2-arithmetic"
    recipe = yaml.safe_load(DEFAULT_RECIPE.read_text())
    assert shown["rollout"]["max_model_len"] == recipe["rollout"]["max_model_len"]
    assert shown["train"]["steps"] == recipe["train"]["steps"]
    assert shown["reward"]["functions"] == [
        {"name": "rlpipe.rewards.reasoning_gym:verifier", "weight": 1.0, "kwargs": {}, "group": False}
    ]


def test_config_show_first_positional_may_be_an_override(capsys):
    assert main(["config", "show", "train.steps=3", "rollout.temperature=0.5"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["steps"] == 3
    assert shown["rollout"]["temperature"] == 0.5
    assert shown["run"]["name"] == "smollm2-arithmetic"  # still on top of the default recipe


def test_config_show_with_a_recipe_and_overrides(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: mine}\ntrain: {steps: 5}\n")
    assert main(["config", "show", str(recipe), "train.steps=4"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["run"]["name"] == "mine"  # the given recipe replaces the default one
    assert shown["train"]["steps"] == 4


def test_train_help_lists_config_keys_with_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.strip().startswith("train.micro_batch_size"))
    assert "[default: 8]" in line
    assert "algo.clip_high" in out and "ray.address" in out and "reward.functions" in out


def _help(capsys, argv) -> dict[str, str]:
    """`rlpipe ... --help`: the header line of the config keys, and each key's line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = captured.out.splitlines()
    header = next(line for line in lines if line.startswith("config keys"))
    keys = {line.split()[0]: line for line in lines[lines.index(header) + 1:]}
    return {"header": header, **keys}


def test_train_help_shows_the_values_a_bare_train_runs_with(capsys):
    # The default recipe's values, not the dataclass defaults (run.name grpo, train.steps 12, temperature 1.0).
    recipe = yaml.safe_load(DEFAULT_RECIPE.read_text())
    shown = _help(capsys, ["train", "--help"])
    assert "configs/default.yaml" in shown["header"]
    assert shown["run.name"].endswith(f"[default: {recipe['run']['name']}]")
    assert shown["train.steps"].endswith(f"[default: {recipe['train']['steps']}]")
    assert shown["rollout.temperature"].endswith(f"[default: {recipe['rollout']['temperature']}]")
    assert shown["train.grad_clip"].endswith("[default: 1.0]")  # a key the recipe leaves to the built-in default


@pytest.mark.parametrize("command", [["train"], ["config", "show"], ["plan"]])
def test_help_shows_the_recipe_and_overrides_given(tmp_path, capsys, command):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: mine}\ntrain: {steps: 5}\n")
    shown = _help(capsys, [*command, str(recipe), "rollout.group_size=4", "-h"])
    assert f"{recipe} with the overrides given" in shown["header"]
    assert shown["run.name"].endswith("[default: mine]")
    assert shown["train.steps"].endswith("[default: 5]")
    assert shown["rollout.group_size"].endswith("[default: 4]")
    assert shown["rollout.temperature"].endswith("[default: 1.0]")  # the given recipe replaces the default one
    shown = _help(capsys, [*command, "train.steps=7", "--he"])  # an override alone: on top of the default recipe
    assert shown["train.steps"].endswith("[default: 7]") and shown["run.name"].endswith("[default: smollm2-arithmetic]")


def test_help_for_a_command_line_that_does_not_resolve_says_so(capsys):
    shown = _help(capsys, ["train", "train.stepz=3", "--help"])
    assert shown["header"].startswith("config keys, with the values of the built-in defaults, not those of "
                                      "configs/default.yaml with the overrides given (train.stepz: unknown key")
    assert shown["train.steps"].endswith("[default: 12]")


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"rlpipe {metadata.version('rlpipe')}\n"


@pytest.mark.parametrize(
    "argv, key",
    [
        (["config", "show", "train.stepz=3"], "train.stepz"),
        (["config", "show", "train.steps=abc"], "train.steps"),
        (["train", "algo.loss_agg=foo"], "algo.loss_agg"),
        (["train", "rollout.group_size=1"], "rollout.group_size"),
        (["train", "learner.device=tpu", "learner.graph=true", "model.kernels.experts=torch"], "model.kernels.experts"),
    ],
)
def test_bad_override_exits_2_with_one_line(capsys, argv, key):
    assert main(argv) == 2
    assert _one_error_line(capsys).startswith(f"rlpipe: config error: {key}")


def test_missing_recipe_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert main(["config", "show", str(missing)]) == 2
    _one_error_line(capsys, str(missing))


def test_train_with_a_bad_reward_path_creates_no_run_dir(tmp_path, capsys, tiny_qwen3):
    output_dir = tmp_path / "runs"
    output_dir.mkdir()
    code = main(
        [
            "train",
            f"model.path={tiny_qwen3}",
            f"run.output_dir={output_dir}",
            "reward.functions=[{name: 'no_such_module:fn'}]",
        ]
    )
    assert code == 2
    _one_error_line(capsys, "no_such_module:fn")
    assert list(output_dir.iterdir()) == []


def test_train_with_a_missing_model_creates_no_run_dir(tmp_path, capsys):
    output_dir = tmp_path / "runs"
    output_dir.mkdir()
    assert main(["train", "model.path=/nonexistent", f"run.output_dir={output_dir}"]) == 2
    _one_error_line(capsys, "model.path", "/nonexistent")
    assert list(output_dir.iterdir()) == []


def test_module_entry_point_runs(tmp_path):
    # From another directory, so the default recipe is found relative to the package, not the cwd.
    result = subprocess.run(
        [sys.executable, "-m", "rlpipe.cli", "config", "show", "train.steps=3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["train"]["steps"] == 3


def test_console_script_is_installed(tmp_path):
    script = Path(sys.executable).parent / "rlpipe"
    assert script.is_file(), "`pip install -e .` installs the rlpipe console script next to the interpreter"
    result = subprocess.run(
        [str(script), "config", "show", "train.stepz=3"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.startswith("rlpipe: config error: train.stepz")


def test_a_checkpoint_that_is_not_there_stops_train_and_export_in_one_line(capsys, tmp_path, tiny_qwen3):
    missing = tmp_path / "no-such-checkpoint"
    run_args = [f"model.path={tiny_qwen3}", f"run.output_dir={tmp_path / 'runs'}", "data.size=16", "data.eval_size=2"]
    for argv in (["train", *run_args, "--resume", str(missing)], ["export", str(missing), str(tmp_path / "out")]):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.err.splitlines() == [f"rlpipe: checkpoint {missing}: no such file or directory"], argv
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize(
    "argv",
    [
        ["RECIPE", "train.steps=3", "--resume", "latest", "rollout.group_size=4"],
        ["RECIPE", "--resume", "latest", "train.steps=3", "rollout.group_size=4"],
        ["RECIPE", "train.steps=3", "rollout.group_size=4", "--resume"],
        ["RECIPE", "--resume", "train.steps=3", "rollout.group_size=4"],  # the bare flag, then overrides
        ["--resume", "latest", "RECIPE", "train.steps=3", "rollout.group_size=4"],
    ],
)
def test_train_takes_overrides_before_and_after_resume(argv, tmp_path, monkeypatch):
    import rlpipe.cli

    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: mine}\ntrain: {steps: 5}\n")
    calls = []
    monkeypatch.setattr(rlpipe.cli, "train_with_restarts",
                        lambda cfg, resume, auto, progress: calls.append((cfg, resume)))
    assert main(["train", *[str(recipe) if a == "RECIPE" else a for a in argv]]) == 0
    ((cfg, resume),) = calls
    assert (cfg.run.name, cfg.train.steps, cfg.rollout.group_size, resume) == ("mine", 3, 4, "latest")


def test_rehearse_refuses_in_one_line_where_the_tpu_extra_is_missing(capsys):
    """This environment is the CPU stack (no torch_tpu, vllm_torchtpu, libtpu): `rlpipe rehearse` says what is missing
    and how to get it, before it checks anything."""
    assert main(["rehearse", "configs/qwen3-8b-v6e.yaml"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("rlpipe: rehearse needs the tpu extra") and "torch_tpu" in line and "rlpipe[tpu]" in line
    assert captured.out == ""


def test_rehearse_refuses_a_recipe_that_trains_on_no_tpu(capsys, monkeypatch):
    """A recipe without a TPU learner has nothing to rehearse (the package check is what this host lacks, so it is
    taken as passed here)."""
    from rlpipe.tpu import rehearse

    monkeypatch.setattr(rehearse, "missing_tpu_packages", lambda: [])
    assert main(["rehearse"]) == 2
    _one_error_line(capsys, "placement.learner.tpu", "names no TPU slice")


def _stopping_run(error: BaseException, steps: int, saved_at: int | None = None, resumed_from: str | None = None):
    """Stands in for train_with_restarts: records `steps` steps (a checkpoint at `saved_at`) as the controller would,
    then stops with `error`."""
    from rlpipe.run.progress import RunProgress
    from rlpipe.training.checkpoint import CHECKPOINTS, step_name

    def run(cfg, resume, auto_resume, progress=None):
        progress = RunProgress() if progress is None else progress
        start = int(Path(resume).name.removeprefix("step_")) if resumed_from else 0
        progress.begin(cfg.run_dir, cfg.train.steps, Path(resume) if resumed_from else None, start)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / "metrics.jsonl").write_text("")
        for step in range(start + 1, start + steps + 1):
            progress.step = step
            if step == saved_at:
                progress.saved(cfg.run_dir / CHECKPOINTS / step_name(step), step)
        raise error

    return run


def _train_until_it_stops(argv: list[str]) -> int:
    """`main(argv)`; a KeyboardInterrupt that escapes it fails the test instead of ending pytest."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped `rlpipe train`")


def _stop_cases():
    from rlpipe.actors.calls import WorkerLost
    from rlpipe.rewards import RewardFailure
    from rlpipe.weightsync import NonFiniteWeights

    return [
        (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)", "resume"),
        (WorkerLost("learner rank 0 died"), 1, "learner rank 0 died", "resume"),
        (RewardFailure("reward function f failed on more than 50% of the samples"), 1,
         "reward function f failed on more than 50% of the samples", "resume once the function is fixed"),
        (NonFiniteWeights("weights hold NaN"), 1, "weights hold NaN",
         "resume with a change that keeps it from diverging"),
    ]


@pytest.mark.parametrize("error, status, reason, resume", _stop_cases(),
                         ids=["ctrl-c", "worker-lost", "reward-failure", "diverged"])
def test_a_run_that_stops_says_in_one_line_where_what_it_lost_and_the_command_that_resumes_it(
    error, status, reason, resume, tmp_path, monkeypatch, capsys
):
    import rlpipe.cli

    monkeypatch.setattr(rlpipe.cli, "train_with_restarts", _stopping_run(error, steps=7, saved_at=5))
    overrides = [f"run.output_dir={tmp_path}", "run.name=x", "train.steps=20", "data.system_prompt=Be brief."]
    assert _train_until_it_stops(["train", *overrides, "--auto-resume"]) == status
    captured = capsys.readouterr()
    checkpoint = tmp_path / "x" / "checkpoints" / "step_000005"
    command = f"rlpipe train run.output_dir={tmp_path} run.name=x train.steps=20 'data.system_prompt=Be brief.'"
    assert captured.err.splitlines() == [
        f"rlpipe: {reason}; stopped after step 7 of 20; last checkpoint: step 5 ({checkpoint}): steps 6-7 are lost; "
        f"{resume}: {command} --auto-resume --resume"
    ]
    assert captured.out == ""


def test_sigterm_stops_a_run_as_ctrl_c_does_with_exit_status_143(tmp_path, monkeypatch, capsys):
    import os
    import signal
    import time

    import rlpipe.cli

    class NotHandledByRlpipe(Exception):
        pass

    def outside(signum, frame):  # this test's own handler: what SIGTERM meets where rlpipe installs none
        raise NotHandledByRlpipe()

    def signalled(cfg, resume, auto_resume, progress=None):
        if progress is not None:
            progress.begin(cfg.run_dir, cfg.train.steps)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises in the main thread before this ends

    monkeypatch.setattr(rlpipe.cli, "train_with_restarts", signalled)
    previous = signal.signal(signal.SIGTERM, outside)
    try:
        assert _train_until_it_stops(["train", f"run.output_dir={tmp_path}", "run.name=x"]) == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is outside  # the process's own handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err.splitlines() == [
        f"rlpipe: terminated (SIGTERM); stopped before step 1; no checkpoint yet; start again: rlpipe train "
        f"run.output_dir={tmp_path} run.name=x"
    ]


def test_a_stopped_run_without_a_checkpoint_starts_again_over_its_steps(tmp_path, monkeypatch, capsys):
    import rlpipe.cli

    monkeypatch.setattr(rlpipe.cli, "train_with_restarts", _stopping_run(KeyboardInterrupt(), steps=3))
    assert _train_until_it_stops(["train", f"run.output_dir={tmp_path}", "run.name=x", "train.steps=20"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        f"rlpipe: interrupted (Ctrl-C); stopped after step 3 of 20; no checkpoint yet: steps 1-3 are lost; start "
        f"again: rlpipe train run.output_dir={tmp_path} run.name=x train.steps=20 run.overwrite=true"
    ]


def test_a_branch_stopped_before_its_own_checkpoint_resumes_from_the_one_it_branched_off(
    tmp_path, monkeypatch, capsys
):
    import rlpipe.cli

    source = tmp_path / "x" / "checkpoints" / "step_000004"
    argv = ["train", f"run.output_dir={tmp_path}", "run.name=y", "train.steps=20", "--resume", str(source)]
    monkeypatch.setattr(rlpipe.cli, "train_with_restarts",
                        _stopping_run(KeyboardInterrupt(), steps=1, resumed_from=str(source)))
    assert _train_until_it_stops(argv) == 130
    assert capsys.readouterr().err.splitlines() == [
        f"rlpipe: interrupted (Ctrl-C); stopped after step 5 of 20; last checkpoint: step 4 ({source}): step 5 is "
        f"lost; resume: rlpipe train run.output_dir={tmp_path} run.name=y train.steps=20 --resume {source}"
    ]
    # Once it saved a checkpoint of its own, its latest is where it resumes.
    monkeypatch.setattr(rlpipe.cli, "train_with_restarts",
                        _stopping_run(KeyboardInterrupt(), steps=2, saved_at=6, resumed_from=str(source)))
    assert _train_until_it_stops(argv) == 130
    assert capsys.readouterr().err.endswith("run.name=y train.steps=20 --resume\n")


def test_a_run_interrupted_before_it_started_says_so(monkeypatch, capsys):
    import rlpipe.cli

    def interrupted(cfg, resume, auto_resume, progress=None):  # while the inputs are checked: no run directory yet
        raise KeyboardInterrupt

    monkeypatch.setattr(rlpipe.cli, "train_with_restarts", interrupted)
    assert _train_until_it_stops(["train", "run.name=x"]) == 130
    assert capsys.readouterr().err.splitlines() == ["rlpipe: interrupted (Ctrl-C); stopped before the run started"]
