"""Reward functions, their registry and the runner that scores batches with them (installed as rlpipe.rewards).

Plain Python on purpose: this package imports nothing else of rlpipe (neither its core nor rlpipe.actors) and not
`ray`, so it runs in any worker. The contract functions are written against is TRL's, called by keyword
(`rlpipe.rewards.contract`). Built-ins (`rlpipe.rewards.math`, `rlpipe.rewards.reasoning_gym`, `rlpipe.rewards.code`,
`rlpipe.rewards.verl`) import their heavy dependencies only when loaded; model-written code runs only in
`rlpipe.rewards.sandbox`.
"""

from rlpipe.rewards.contract import RESERVED_COLUMNS, SAMPLE_COLUMNS, TrainerState, trainer_state
from rlpipe.rewards.registry import RewardConfigError, load_reward
from rlpipe.rewards.runner import FailureWatch, RewardFailure, RewardResult, RewardRunner

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
