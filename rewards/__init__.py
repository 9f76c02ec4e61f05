"""Reward functions, their registry and the runner that scores batches with them.

Plain Python on purpose: this package imports neither `rlpipe`, `actors` nor `ray`, so it runs in any
worker. The contract functions are written against is TRL's, called by keyword (`rewards.contract`). Built-ins
(`rewards.math`, `rewards.reasoning_gym`, `rewards.code`, `rewards.verl`) import their heavy dependencies only when
loaded; model-written code runs only in `rewards.sandbox`.
"""

from rewards.contract import RESERVED_COLUMNS, SAMPLE_COLUMNS, TrainerState, trainer_state
from rewards.registry import RewardConfigError, load_reward
from rewards.runner import FailureWatch, RewardFailure, RewardResult, RewardRunner

__all__ = [
    "RESERVED_COLUMNS",
    "SAMPLE_COLUMNS",
    "FailureWatch",
    "RewardConfigError",
    "RewardFailure",
    "RewardResult",
    "RewardRunner",
    "TrainerState",
    "load_reward",
    "trainer_state",
]
