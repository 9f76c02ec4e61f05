"""rlpipe's Python API: `import rlpipe` stays cheap, `rlpipe.load_config` takes the CLI's keys as keyword arguments,
and reward functions given as callables or found beside a recipe reach the reward worker's child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import rlpipe
from rlpipe.api import add_reward_search_path, check_by_value_rewards, reward_specs
from rlpipe.usercode.callables import BY_VALUE_PREFIX, SEARCH_PATH_VARIABLE, display_name
from rlpipe.config import ConfigError
from rlpipe.rewards import RewardConfigError, RewardRunner, load_reward
from rlpipe.rewards.math import numeric_answer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_rlpipe_loads_no_torch_vllm_or_ray_and_exports_the_api():
    program = (
        "import sys, json, rlpipe; rlpipe.load_config(None, **{'train.steps': 1}); "
        "print(json.dumps([sorted(rlpipe.__all__), [m for m in ('torch', 'vllm', 'ray', 'transformers') "
        "if m in sys.modules], callable(rlpipe.train), rlpipe.Config.__name__]))"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": ROOT})
    exported, heavy, trainable, config_name = json.loads(done.stdout.splitlines()[-1])
    assert exported == ["Config", "load_config", "train"]
    assert heavy == [] and trainable and config_name == "Config"


def test_load_config_takes_dotted_keys_sections_and_cli_text():
    cfg = rlpipe.load_config(None, **{"train.steps": 3}, rollout={"group_size": 4}, train={"lr": "1e-4"})
    assert (cfg.train.steps, cfg.rollout.group_size, cfg.train.lr) == (3, 4, 1e-4)
    again = rlpipe.load_config(cfg, **{"train.steps": 5})  # a Config is a starting point too
    assert (again.train.steps, again.rollout.group_size, cfg.train.steps) == (5, 4, 3)
    with pytest.raises(ConfigError, match=r"^train\.stepz: unknown key"):
        rlpipe.load_config(None, train={"stepz": 3})
    with pytest.raises(ConfigError, match=r"^train\.steps: "):
        rlpipe.load_config(None, **{"train.steps": "many"})


def _local_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_reward_funcs_become_names_installed_by_path_and_the_users_own_by_value():
    specs = reward_specs([numeric_answer, "format_tags", _local_reward, lambda completions, **kw: [0.0]], [1, 2, 3, 4])
    names = [spec["name"] for spec in specs]
    assert names[:2] == ["rlpipe.rewards.math:numeric_answer", "format_tags"]
    assert names[2].startswith(BY_VALUE_PREFIX) and names[3].startswith(BY_VALUE_PREFIX)  # a test module is no package
    assert [display_name(name) for name in names] == ["numeric_answer", "format_tags", "_local_reward", "<lambda>"]
    assert [spec["weight"] for spec in specs] == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="2 weights for 1 reward_funcs"):
        reward_specs([numeric_answer], [1, 2])


def test_a_callable_by_value_runs_in_the_reward_child_without_its_module(tmp_path):
    """A closure over a local file, and a function of a module that only this process can import: both run in the
    runner's child process, which cannot import that module."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "user_rewards_by_value.py").write_text(textwrap.dedent("""
        def length_over(completions, limit=3, **kwargs):
            return [float(len(c) > limit) for c in completions]
    """))
    sys.path.insert(0, str(folder))
    try:
        import user_rewards_by_value
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("user_rewards_by_value")
    calls = tmp_path / "calls.txt"

    def recorded(completions, **kwargs):
        with open(calls, "a") as out:
            out.write(f"{os.getpid()}\n")
        return [1.0] * len(completions)

    runner = RewardRunner(reward_specs([recorded, user_rewards_by_value.length_over]))
    try:
        result = runner.score(["q", "q"], ["ab", "abcdef"], {})
        child = runner.child.pid
    finally:
        runner.close()
    assert result.per_function == {"recorded": [1.0, 1.0], "length_over": [0.0, 1.0]}
    assert calls.read_text().split() == [str(child)] and child != os.getpid()


def test_a_reward_module_beside_the_recipe_imports_after_sys_path(tmp_path, monkeypatch):
    folder = tmp_path / "recipe_folder"
    folder.mkdir()
    (folder / "beside_recipe_rewards.py").write_text("def constant(completions, **kw):\n    return [2.0] * len(completions)\n")
    (folder / "json.py").write_text("raise SystemExit('the standard library was shadowed')\n")
    monkeypatch.setenv(SEARCH_PATH_VARIABLE, "")
    with pytest.raises(RewardConfigError, match="cannot import module 'beside_recipe_rewards'"):
        load_reward("beside_recipe_rewards:constant")
    add_reward_search_path(str(folder))
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder is appended to it: undone after the test
    assert load_reward("json:dumps") is json.dumps  # appended, so never ahead of the standard library
    runner = RewardRunner([{"name": "beside_recipe_rewards:constant"}])
    try:
        assert runner.score(["q"], ["a"], {}).totals == [2.0]  # in the child too
    finally:
        runner.close()
        sys.modules.pop("beside_recipe_rewards", None)


def test_a_reward_environment_without_cloudpickle_is_refused_for_a_function_by_value(tmp_path):
    # An interpreter whose cloudpickle cannot be imported (otherwise this very one).
    python = tmp_path / "python-without-cloudpickle"
    python.write_text(
        "#!/bin/sh\nshift\nprogram=\"$1\"\nshift\n"
        f"exec {sys.executable} -c \"import sys; sys.modules['cloudpickle'] = None; exec(sys.argv.pop(1))\" "
        "\"$program\" \"$@\"\n"
    )
    python.chmod(0o755)
    cfg = rlpipe.load_config(None, placement={"reward": {"python": str(python)}},
                             **{"reward.functions": reward_specs([_local_reward])})
    with pytest.raises(ConfigError, match=r"^placement\.reward\.python: .* cannot import cloudpickle .* needed by "
                                          r"reward function _local_reward \(passed by value\)"):
        check_by_value_rewards(cfg)
    by_path = rlpipe.load_config(cfg, **{"reward.functions": [{"name": "rlpipe.rewards.math:numeric_answer"}]})
    check_by_value_rewards(by_path)  # nothing by value: nothing asked of that environment


def _triple(x):
    return 3 * x


def test_a_function_passed_by_value_loads_only_with_this_process_key(monkeypatch):
    """A by-value name is signed with the process's key: its workers (which inherit the key) rebuild it; the same
    name copied into a file and read by another process (another key, or none) is refused before any unpickling."""
    from rlpipe.usercode.callables import BY_VALUE_KEY_VARIABLE, RewardConfigError, by_value_name, load_reward

    monkeypatch.delenv(BY_VALUE_KEY_VARIABLE, raising=False)
    name = by_value_name(_triple)
    assert load_reward(name)(2) == 6
    monkeypatch.setenv(BY_VALUE_KEY_VARIABLE, "another process's key")
    with pytest.raises(RewardConfigError, match="not serialized by this run's own process"):
        load_reward(name)
    monkeypatch.delenv(BY_VALUE_KEY_VARIABLE)
    with pytest.raises(RewardConfigError, match="never from a recipe or checkpoint file"):
        load_reward(name)


def _add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class _Counter:
    def reset(self, **row):
        self.count = 0

    def bump(self, by: int) -> int:
        """Adds to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return self.count


def test_tools_and_an_environment_factory_given_as_objects_load_where_episodes_run(monkeypatch):
    """rlpipe.train(tools=[fn], environment_factory=Cls): objects of the user's own modules travel by value and are
    rebuilt, schemas and all, by the engine's ToolSet; with another process's key they are refused."""
    from rlpipe.api import _named
    from rlpipe.usercode.callables import BY_VALUE_KEY_VARIABLE
    from rlpipe.tools import ToolConfigError, ToolSet

    monkeypatch.delenv(BY_VALUE_KEY_VARIABLE, raising=False)
    tool, factory = _named(_add, "tools[0]"), _named(_Counter, "environment_factory")
    assert tool.startswith(BY_VALUE_PREFIX) and factory.startswith(BY_VALUE_PREFIX)
    toolset = ToolSet.load([tool], factory)
    environment = toolset.new_environment()
    environment.reset()
    assert [schema["function"]["name"] for schema in toolset.schemas(environment)] == ["_add", "bump"]
    assert toolset.tools[0](2, 3) == 5 and toolset.episode_tools(environment)[1](4) == 4
    assert _named("rlpipe.tools:calculator", "tools[0]") == "rlpipe.tools:calculator"
    monkeypatch.setenv(BY_VALUE_KEY_VARIABLE, "another process's key")
    with pytest.raises(ToolConfigError, match="rollout.tools: tool '_add' .*not serialized by this run's own process"):
        ToolSet.load([tool], None)


def test_what_cards_and_trackers_show_of_a_config_names_objects_passed_by_value_never_their_code():
    from rlpipe.api import _named
    from rlpipe.usercode.callables import readable

    config = {"reward": {"functions": [{"name": _named(_triple, "r"), "weight": 1.0}]},
              "rollout": {"tools": [_named(_add, "t"), "rlpipe.tools:calculator"],
                          "environment_factory": _named(_Counter, "e")}}
    shown = readable(config)
    assert shown == {"reward": {"functions": [{"name": "_triple (passed by value)", "weight": 1.0}]},
                     "rollout": {"tools": ["_add (passed by value)", "rlpipe.tools:calculator"],
                                 "environment_factory": "_Counter (passed by value)"}}


def test_an_auto_resumed_run_waits_for_a_lost_host_but_a_new_run_that_cannot_be_placed_is_a_config_error(
    tmp_path, monkeypatch, capsys
):
    """A placement timeout at a run's start is the configuration's fault (exit 2). After a lost worker, the same
    timeout most likely means the lost host is not back yet: auto-resume tries again, within train.max_auto_resumes."""
    import rlpipe.run.controller
    from rlpipe.actors.calls import WorkerLost
    from rlpipe.actors.placement import PlacementTimeout
    from rlpipe.api import train_with_restarts
    from rlpipe.config import load_config

    cfg = load_config(None, [f"run.output_dir={tmp_path}", "train.max_auto_resumes=3"])
    no_room = PlacementTimeout("placement.rollout: the cluster cannot place 1 bundle(s) within 1 s")
    outcomes = []

    def train(cfg, resume, progress):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return {"resumed_from": resume}

    monkeypatch.setattr(rlpipe.run.controller, "train", train)
    outcomes[:] = [no_room]
    with pytest.raises(PlacementTimeout):
        train_with_restarts(cfg, None, auto_resume=True)
    outcomes[:] = [WorkerLost("rollout engine 0 lost its host"), no_room, no_room, {"done": True}]
    assert train_with_restarts(cfg, None, auto_resume=True) == {"resumed_from": None}
    restarts = [line for line in capsys.readouterr().err.splitlines() if "restarting from" in line]
    assert [line.split("(auto-resume ")[1] for line in restarts] == ["1 of 3)", "2 of 3)", "3 of 3)"]
    assert "cannot place" in restarts[1] and "lost its host" in restarts[0]
    outcomes[:] = [WorkerLost("lost"), no_room, no_room, no_room]
    with pytest.raises(WorkerLost, match="cannot place"):  # given up after max_auto_resumes attempts
        train_with_restarts(cfg, None, auto_resume=True)


def test_an_automatic_restart_says_which_steps_run_again(tmp_path, monkeypatch, capsys):
    import rlpipe.run.controller
    from rlpipe.actors.calls import WorkerLost
    from rlpipe.api import train_with_restarts
    from rlpipe.config import load_config
    from rlpipe.run.progress import RunProgress

    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=x", "train.steps=10"])
    saved = cfg.run_dir / "checkpoints" / "step_000001"
    (saved / "learner").mkdir(parents=True)
    (saved / "learner" / ".metadata").write_bytes(b"")
    (saved / "trainer.json").write_text('{"format": 1}')
    (saved.parent / "latest").write_text("step_000001\n")
    attempts = []

    def train(cfg, resume, progress=None):  # the first attempt checkpoints step 1 and loses its learner at step 3
        attempts.append(resume)
        if len(attempts) > 1:
            return {}
        progress = RunProgress() if progress is None else progress
        progress.begin(cfg.run_dir, cfg.train.steps)
        progress.step = 3
        progress.saved(saved, 1)
        raise WorkerLost("learner rank 0 died")

    monkeypatch.setattr(rlpipe.run.controller, "train", train)
    assert train_with_restarts(cfg, None, auto_resume=True, progress=RunProgress()) == {}
    assert attempts == [None, "latest"]
    assert capsys.readouterr().err.splitlines() == [
        "rlpipe: learner rank 0 died; restarting from step_000001: steps 2-3 run again (auto-resume 1 of 3)"
    ]
