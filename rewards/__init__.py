"""Reward functions, their registry and the runner that scores batches with them.

Plain Python on purpose: this package imports neither `rlpipe`, `actors` nor `ray`, so it runs in any
worker. Built-ins (`rewards.math`, `rewards.reasoning_gym`, `rewards.code`) import their heavy dependencies only when
loaded; model-written code runs only in `rewards.sandbox`.
"""

from rewards.registry import RewardConfigError, load_reward
from rewards.runner import SAMPLE_COLUMNS, FailureWatch, RewardFailure, RewardResult, RewardRunner

__all__ = [
    "SAMPLE_COLUMNS",
    "FailureWatch",
    "RewardConfigError",
    "RewardFailure",
    "RewardResult",
    "RewardRunner",
    "load_reward",
]
