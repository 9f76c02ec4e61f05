"""Reward functions, their registry and the runner that scores batches with them (installed as rlpipe.rewards).

Plain Python on purpose: this package imports nothing else of rlpipe (neither its core nor rlpipe.actors) and not
`ray`, so it runs in any worker. Built-ins (`rlpipe.rewards.math`, `rlpipe.rewards.reasoning_gym`,
`rlpipe.rewards.code`) import their heavy dependencies only when loaded; model-written code runs only in
`rlpipe.rewards.sandbox`.
"""

from rlpipe.rewards.registry import RewardConfigError, load_reward
from rlpipe.rewards.runner import SAMPLE_COLUMNS, FailureWatch, RewardFailure, RewardResult, RewardRunner

__all__ = [
    "SAMPLE_COLUMNS",
    "FailureWatch",
    "RewardConfigError",
    "RewardFailure",
    "RewardResult",
    "RewardRunner",
    "load_reward",
]
