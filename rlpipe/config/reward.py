"""The `reward` section: the reward functions, their time limits, and the workers that call them."""

from __future__ import annotations

from dataclasses import dataclass

from rlpipe.config.errors import require
from rlpipe.config.keys import key


@dataclass
class RewardFunctionConfig:
    name: str = key("rlpipe.rewards.reasoning_gym:verifier", "import path pkg.mod:fn, or a built-in name")
    weight: float = key(1.0, "weight of this function in the total reward")
    kwargs: dict = key({}, "keyword arguments passed on every call")
    group: bool = key(False, "call the function once per group (it sees one prompt's completions together)")


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = key(
        [RewardFunctionConfig()], "reward functions: list of {name, weight, kwargs, group}"
    )
    timeout_s: float = key(
        30.0, "time limit of a function's call on a worker's whole share (or one group); past it, or when it raises, "
        "the function is called once per sample"
    )
    sample_timeout_s: float = key(
        20.0, "time limit of each of those per-sample calls (above the code reward's own wall_s 10 plus its start)"
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
