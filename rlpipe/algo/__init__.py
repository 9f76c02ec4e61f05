"""GRPO algorithm pieces: advantages, loss functions as pure tensor code, and the objectives built from them."""

from rlpipe.algo.advantages import estimate_advantages, group_advantages, uniform_groups
from rlpipe.algo.losses import (
    aggregate,
    kl_penalty,
    masked_importance_weights,
    policy_loss,
    sequence_policy_loss,
    truncated_importance_weights,
)
from rlpipe.algo.objective import (
    POLICY_LOSSES,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    GSPOLoss,
    KLPenalty,
    MaskedImportance,
    Objective,
    RouterBalance,
    TruncatedImportance,
    build_objective,
    loss_defaults,
)
from rlpipe.types import LossInputs, LossStats, ModelOutputs

__all__ = [
    "estimate_advantages",
    "group_advantages",
    "uniform_groups",
    "policy_loss",
    "sequence_policy_loss",
    "kl_penalty",
    "aggregate",
    "truncated_importance_weights",
    "masked_importance_weights",
    "POLICY_LOSSES",
    "GRPOLoss",
    "DrGRPOLoss",
    "DAPOLoss",
    "GSPOLoss",
    "KLPenalty",
    "MaskedImportance",
    "TruncatedImportance",
    "RouterBalance",
    "LossInputs",
    "LossStats",
    "ModelOutputs",
    "Objective",
    "build_objective",
    "loss_defaults",
]
