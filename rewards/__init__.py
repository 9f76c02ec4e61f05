"""Reward functions and the runner that scores batches with them (rlpipe.rewards).

Plain Python on purpose: of the rest of rlpipe this package imports only rlpipe.usercode.callables (a function resolved from
its name, or carried by value) and rlpipe.usercode.sandbox (where model-written code runs), which import nothing of rlpipe but
rlpipe.orphans; neither the core nor rlpipe.actors, and not `ray`, so it runs in any worker. The contract
functions are written against is TRL's, called by keyword (`rlpipe.rewards.contract`). Built-ins
(`rlpipe.rewards.math`, `rlpipe.rewards.reasoning_gym`, `rlpipe.rewards.code`, `rlpipe.rewards.verl`) import their
heavy dependencies only when loaded.
"""

from rlpipe.usercode.callables import RewardConfigError, load_reward
from rlpipe.rewards.contract import RESERVED_COLUMNS, SAMPLE_COLUMNS, TrainerState, trainer_state
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
