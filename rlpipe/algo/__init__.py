"""GRPO algorithm pieces as pure tensor functions: advantages and losses."""

from rlpipe.algo.advantages import group_advantages, uniform_groups
from rlpipe.algo.losses import (
    aggregate,
    kl_penalty,
    logprob_gap,
    masked_importance_weights,
    policy_loss,
    truncated_importance_weights,
)

__all__ = [
    "group_advantages",
    "uniform_groups",
    "policy_loss",
    "kl_penalty",
    "aggregate",
    "truncated_importance_weights",
    "logprob_gap",
    "masked_importance_weights",
]
