"""The `reward` section: the reward functions, their time limits, and the workers that call them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlpipe.config.errors import ConfigError, require
from rlpipe.config.keys import key

# The built-in verl adapter names its scorer in kwargs.function, which may be a file path too.
VERL_ADAPTER_NAMES = ("verl", "rlpipe.rewards.verl:compute_score")


@dataclass
class RewardFunctionConfig:
    name: str = key(
        "rlpipe.rewards.reasoning_gym:verifier",
        "import path pkg.mod:fn, file path path/to/file.py:fn (from the recipe's folder, else the working directory), "
        "a built-in name, or a reward model: a folder (./rm) or Hub id (org/name) of a sequence-classification model",
    )
    weight: float = key(1.0, "weight of this function in the total reward")
    kwargs: dict = key({}, "keyword arguments passed on every call")
    group: bool = key(False, "call the function once per group (it sees one prompt's completions together)")


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = key(
        [RewardFunctionConfig()], "reward functions: list of {name, weight, kwargs, group}"
    )
    timeout_s: float = key(
        30.0, "time limit of a function's call on a worker's whole share (or one group), at most its samples' part of "
        "the time left; past it, or when it raises, the function is called once per sample"
    )
    sample_timeout_s: float = key(
        20.0, "time limit of each of those per-sample calls (above the code reward's own wall_s 10 plus its start), at "
        "most the sample's part of the time left; a sample whose call runs out of time scores 0"
    )
    deadline_s: float = key(
        300.0, "the longest the driver waits for a reward worker's share of a step; what is not scored by then is "
        "unscored, and a worker that has not answered is restarted"
    )
    num_workers: int = key(1, "reward actors")
    max_restarts: int = key(
        3, "a reward actor that dies (killed, out of memory) is restarted and its call re-run, this many times"
    )
    success_threshold: float = key(1.0, "a sample with total reward >= this counts as correct (accuracy)")
    max_failed_share: float = key(
        0.5, "stop the run when one function fails on more than this share of a step's samples ..."
    )
    max_failed_steps: int = key(3, "... for this many steps in a row")

    def check(self) -> None:
        require(0 <= self.max_failed_share <= 1, "reward.max_failed_share: must be between 0 and 1")
        require(self.max_failed_steps >= 1, "reward.max_failed_steps: must be >= 1")
        require(self.num_workers >= 1, "reward.num_workers: must be >= 1")
        require(self.max_restarts >= 0, "reward.max_restarts: must be >= 0")
        require(self.timeout_s > 0, "reward.timeout_s: must be > 0")
        require(self.sample_timeout_s > 0, "reward.sample_timeout_s: must be > 0")
        require(self.deadline_s > 0, "reward.deadline_s: must be > 0")
        require(len(self.functions) >= 1, "reward.functions: at least one reward function is needed")

    def resolve_files(self, recipe_dir: Path | None) -> None:
        """Make every `path/to/file.py:fn` absolute, so that reward workers (whatever their working directory) load
        the file this config means: a relative path is looked up in the recipe's folder first, then in the working
        directory. Also the verl adapter's `kwargs.function`, and a model's folder where one is found there (a reward
        model's: a name with a `/` and no `:`, rlpipe/rewards/specs.py; the judge's kwargs.model); otherwise that
        name is a Hub id."""
        for index, function in enumerate(self.functions):
            where = f"reward.functions[{index}]"
            if _file_and_function(function.name):
                function.name = _absolute_file_reference(function.name, recipe_dir, f"{where}.name")
            elif isinstance(function.name, str) and "/" in function.name and ":" not in function.name:
                function.name = _local_folder(function.name, recipe_dir)
            judge = function.kwargs.get("model") if function.name == "judge" else None
            if isinstance(judge, str) and "/" in judge:
                function.kwargs = {**function.kwargs, "model": _local_folder(judge, recipe_dir)}
            scorer = function.kwargs.get("function") if isinstance(function.kwargs, dict) else None
            if function.name in VERL_ADAPTER_NAMES and _file_and_function(scorer):
                function.kwargs = {
                    **function.kwargs,
                    "function": _absolute_file_reference(scorer, recipe_dir, f"{where}.kwargs.function"),
                }


def _candidates(path: Path, recipe_dir: Path | None) -> list[Path]:
    """Where a path named in a recipe may be: itself when absolute, else in the recipe's folder, then the working
    directory."""
    return [path] if path.is_absolute() else [*([recipe_dir / path] if recipe_dir else []), Path.cwd() / path]


def _local_folder(name: str, recipe_dir: Path | None) -> str:
    """`name` made absolute where it is a folder relative to the recipe's folder or the working directory."""
    folder = Path(name).expanduser()
    if folder.is_absolute():
        return name
    found = [candidate for candidate in _candidates(folder, recipe_dir) if candidate.is_dir()]
    return str(found[0].resolve()) if found else name


def _file_and_function(reference: object) -> tuple[str, str] | None:
    """`("dir/file.py", "fn")` for a file reference `dir/file.py:fn` (the reward registry's rule; the registry itself
    is not imported here, to keep loading a config light), else None."""
    if not isinstance(reference, str):
        return None
    file_name, _, attribute = reference.strip().rpartition(":")
    return (file_name, attribute) if file_name.endswith(".py") else None


def _absolute_file_reference(reference: str, recipe_dir: Path | None, where: str) -> str:
    file_name, attribute = _file_and_function(reference)
    file = Path(file_name).expanduser()
    candidates = _candidates(file, recipe_dir)
    for candidate in candidates:
        if candidate.is_file():
            return f"{candidate.resolve()}:{attribute}"
    looked = " nor ".join(str(candidate.parent.resolve()) for candidate in candidates)
    raise ConfigError(f"{where}: file {file_name} not found (looked in {looked})")
