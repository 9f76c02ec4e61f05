"""`rlpipe submit`'s checks that run before anything reaches a cluster: reward files travel with the working dir."""

from pathlib import Path

import pytest

from rlpipe.config import load_config
from rlpipe.run.submit import DEFAULT_EXCLUDES, SubmitError, check_reward_files_uploaded, reward_files


def project(tmp_path: Path) -> Path:
    (tmp_path / "rewards_here").mkdir(parents=True)
    (tmp_path / "rewards_here" / "score.py").write_text("def fn(**kwargs): ...\n")
    (tmp_path / "recipe.yaml").write_text('reward:\n  functions:\n    - {name: "rewards_here/score.py:fn"}\n')
    return tmp_path


def test_reward_files_inside_the_working_dir_are_accepted(tmp_path):
    root = project(tmp_path)
    files = reward_files(load_config(root / "recipe.yaml"))
    assert files == [root / "rewards_here" / "score.py"]
    check_reward_files_uploaded(files, root, DEFAULT_EXCLUDES)


@pytest.mark.parametrize("layout, cause", [
    ("outside", "is outside the uploaded working directory"),
    ("gitignored", "rewards_here is excluded"),
    ("excluded", "rewards_here/score.py is excluded"),
])
def test_reward_files_that_would_not_reach_the_cluster_are_refused(tmp_path, layout, cause):
    root = project(tmp_path / "project")
    files = reward_files(load_config(root / "recipe.yaml"))
    excludes = list(DEFAULT_EXCLUDES)
    if layout == "outside":
        root = root / "rewards_here" / "sub"  # a working dir that holds the recipe's folder's child only
        root.mkdir()
    elif layout == "gitignored":
        (root / ".gitignore").write_text("rewards_here\n")
    else:
        excludes.append("score.py")
    with pytest.raises(SubmitError, match=cause):
        check_reward_files_uploaded(files, root, excludes)


def test_a_runtime_env_file_whose_aliases_stand_for_a_billion_nodes_is_refused_before_any_cluster(tmp_path):
    from rlpipe.run.submit import submit
    from tests.unit.test_config import billion_laughs

    root = project(tmp_path)
    laughs = tmp_path / "runtime_env.yaml"
    laughs.write_text("env_vars:\n  LAUGHS: x\n" + billion_laughs().replace("reward:", "pip:", 1))
    with pytest.raises(SubmitError) as err:
        submit("http://127.0.0.1:1", str(root / "recipe.yaml"), [], str(root), runtime_env_file=str(laughs))
    assert str(err.value).startswith(f"--runtime-env: {laughs}: its aliases stand for ")
    assert str(err.value).endswith(" nodes, more than the 10000 allowed")
