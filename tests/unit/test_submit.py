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
