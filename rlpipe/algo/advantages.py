"""Group-relative advantages for GRPO-style training.

Samples are laid out *group-contiguous*: a batch of ``N = num_groups * group_size``
rewards where samples ``[g * group_size, (g + 1) * group_size)`` are the completions
of prompt ``g``.

A reward of NaN means "this sample could not be scored" (verifier crash, timeout,
...). Such samples are not evidence about the prompt, so they are left out of every
statistic and receive advantage 0 (no gradient signal either way).

Standard deviations are either *population* ones (divide by the number of valid
samples ``n``: what "normalise the group to unit variance" means literally) or
*unbiased* ones (Bessel's ``n - 1``, as ``torch.std``, TRL and verl compute them).
With small groups the choice matters: unbiased advantages are ``sqrt((n - 1) / n)``
times the population ones (0.935x at n = 8, 0.866x at n = 4).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "ESTIMATORS", "estimate_advantages", "group_advantages", "leave_one_out_advantages", "token_whitened",
    "uniform_groups",
]

_SCALES = ("group", "batch", "none")
_STDS = ("population", "unbiased")
# algo.advantage_estimator: GRPO's group mean (scaled as algo.advantage_scale says), RLOO's leave-one-out mean (TRL's
# RLOOTrainer), REINFORCE++ with the batch as baseline and with the group mean as baseline (verl's
# reinforce_plus_plus and reinforce_plus_plus_baseline for outcome rewards): both whitened over the batch's tokens.
ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def _grouped(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Reshape ``rewards [N]`` to ``[num_groups, group_size]`` and return it with
    the validity mask (``~isnan``) of the same shape. Validates the layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) is not a multiple of "
            f"group_size ({group_size})"
        )
    # Integer/bool rewards are legal input; statistics need floating point.
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if torch.isinf(rewards).any():
        raise ValueError("rewards must be finite or NaN (unscored); got +/-inf")
    grouped = rewards.detach().view(-1, group_size)
    return grouped, ~torch.isnan(grouped)


def _uniform(grouped: Tensor, valid: Tensor) -> Tensor:
    """``[G]`` bool: valid rewards of the group are all equal, or < 2 are valid."""
    inf = torch.tensor(float("inf"), dtype=grouped.dtype, device=grouped.device)
    hi = torch.where(valid, grouped, -inf).amax(dim=-1)
    lo = torch.where(valid, grouped, inf).amin(dim=-1)
    return (valid.sum(dim=-1) < 2) | (hi == lo)


def uniform_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Flag groups that carry no learning signal (DAPO's dynamic-sampling filter).

    Args:
        rewards: ``[N]`` float rewards, group-contiguous, NaN = unscored.
        group_size: completions per prompt; ``N`` must be a multiple of it.

    Returns:
        ``[num_groups]`` bool tensor, True where the group's valid (non-NaN)
        rewards are all exactly equal or where fewer than 2 rewards are valid.
        Group-relative advantages are identically 0 for such groups.
    """
    grouped, valid = _grouped(rewards, group_size)
    return _uniform(grouped, valid)


def group_advantages(
    rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-6, std: str = "population"
) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally rescaled.

    Args:
        rewards: ``[N]`` rewards, group-contiguous (``N = num_groups * group_size``).
            NaN marks an unscored sample: it gets advantage 0 and is excluded from
            its group's mean/std and from the batch std.
        group_size: completions per prompt.
        scale: how the centred reward ``r - mean(group)`` is divided:
            ``"group"``: by (std of the group's valid rewards + eps) -- the
            original GRPO normalisation;
            ``"batch"``: by (std of *all* valid rewards in the batch + eps) -- a
            single scale for the whole batch, so easy/hard prompts are not
            re-weighted against each other;
            ``"none"``: no division (Dr. GRPO, which removes the per-group std
            because it biases updates towards low-variance prompts).
        eps: added to the std before dividing, for numerical safety.
        std: ``"population"`` (divide the squared deviations by ``n``) or
            ``"unbiased"`` (by ``n - 1``), ``n`` the valid rewards in scope.

    Returns:
        ``[N]`` advantages in the rewards' floating dtype (detached). Exactly 0 for
        NaN samples and for every sample of a group whose valid rewards are all
        equal (including groups with fewer than 2 valid samples): centring makes
        those 0 mathematically, and forcing it avoids amplifying float rounding
        (e.g. ``mean([0.1] * 3) != 0.1``) by a tiny std.

    Raises:
        ValueError: unknown ``scale`` or ``std``, bad shape/group_size, or infinite rewards.
    """
    if scale not in _SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; expected one of {_SCALES}")
    if std not in _STDS:
        raise ValueError(f"unknown advantage std {std!r}; expected one of {_STDS}")
    bessel = 1 if std == "unbiased" else 0
    grouped, valid = _grouped(rewards, group_size)
    zeros = torch.zeros_like(grouped)

    count = valid.sum(dim=-1, keepdim=True)
    safe_count = count.clamp_min(1)  # all-NaN group: numerator is 0 anyway
    mean = torch.where(valid, grouped, zeros).sum(dim=-1, keepdim=True) / safe_count
    centred = torch.where(valid, grouped - mean, zeros)
    centred = torch.where(_uniform(grouped, valid).unsqueeze(-1), zeros, centred)

    if scale == "none":
        adv = centred
    else:
        # A scope with fewer than 2 valid rewards has every centred value 0 already; the clamp only avoids 0/0.
        if scale == "group":
            spread = (centred.square().sum(dim=-1, keepdim=True) / (count - bessel).clamp_min(1)).sqrt()
        else:  # "batch": one std over every valid reward in the batch
            flat, flat_valid = grouped.reshape(-1), valid.reshape(-1)
            n = flat_valid.sum()
            b_mean = torch.where(flat_valid, flat, 0.0).sum() / n.clamp_min(1)
            spread = (torch.where(flat_valid, flat - b_mean, 0.0).square().sum() / (n - bessel).clamp_min(1)).sqrt()
        denom = spread + eps
        # denom can only be 0 with eps=0 and a zero std, i.e. when every centred
        # value in its scope is already 0; divide by 1 there instead of 0 -> NaN.
        adv = centred / torch.where(denom > 0, denom, torch.ones_like(denom))
    return adv.reshape(-1)


def leave_one_out_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: each reward minus the mean of the other valid rewards of its group, as TRL's RLOOTrainer computes it;
    ``(n / (n - 1))`` times the group-centred reward, ``n`` the group's valid rewards. Exactly 0 for NaN (unscored)
    samples and for every sample of a group with fewer than 2 valid rewards or all of them equal."""
    grouped, valid = _grouped(rewards, group_size)
    zeros = torch.zeros_like(grouped)
    count = valid.sum(dim=-1, keepdim=True)
    total = torch.where(valid, grouped, zeros).sum(dim=-1, keepdim=True)
    others = (total - torch.where(valid, grouped, zeros)) / (count - 1).clamp_min(1)
    advantage = torch.where(valid, grouped - others, zeros)
    return torch.where(_uniform(grouped, valid).unsqueeze(-1), zeros, advantage).reshape(-1)


def token_whitened(values: Tensor, tokens: Tensor, eps: float = 1e-8) -> Tensor:
    """Per-sample values whitened over the batch's tokens, as verl's ``masked_whiten`` whitens a [B, T] tensor in which
    each sample's value fills its ``tokens`` trained tokens: minus the token mean, divided by the square root of the
    tokens' unbiased variance plus ``eps``. NaN values (unscored samples) take no part and come back 0."""
    valid = ~torch.isnan(values)
    weights = torch.where(valid, tokens.to(values.dtype), torch.zeros_like(values))
    count = weights.sum()
    if count < 2:
        return torch.zeros_like(values)
    filled = torch.where(valid, values, torch.zeros_like(values))
    mean = (weights * filled).sum() / count
    variance = (weights * (filled - mean).square()).sum() / count * count / (count - 1)
    return torch.where(valid, (filled - mean) * torch.rsqrt(variance + eps), torch.zeros_like(values))


def estimate_advantages(
    rewards: Tensor, group_size: int, estimator: str = "grpo", scale: str = "group", std: str = "population",
    tokens: Tensor | None = None,
) -> Tensor:
    """``[N]`` advantages of group-contiguous ``rewards`` (NaN: unscored, advantage 0) by ``estimator``:

    - ``"grpo"``: `group_advantages` with ``scale`` and ``std``;
    - ``"rloo"``: `leave_one_out_advantages`, with ``scale`` ``"none"``, or ``"batch"``: then minus their batch mean
      and divided by their batch std (unbiased) + 1e-4, over the samples that have a baseline (TRL's
      ``normalize_advantages``);
    - ``"reinforce_pp"``: the rewards themselves `token_whitened` over the batch (``tokens``: each sample's trained
      tokens), the batch as their baseline;
    - ``"reinforce_pp_baseline"``: the group-centred rewards `token_whitened` over the batch.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ESTIMATORS}")
    if estimator == "grpo":
        return group_advantages(rewards, group_size, scale, std=std)
    if estimator == "rloo":
        if scale not in ("none", "batch"):
            raise ValueError(f"rloo takes advantage scale none or batch, not {scale!r}")
        advantage = leave_one_out_advantages(rewards, group_size)
        if scale == "none":
            return advantage
        # As TRL: the samples of a group with fewer than 2 scored ones have no leave-one-out baseline, and take no
        # part in the batch's statistics either.
        _, valid = _grouped(rewards, group_size)
        scored = (valid & (valid.sum(dim=-1, keepdim=True) >= 2)).reshape(-1)
        if scored.sum() < 2:
            return torch.zeros_like(advantage)
        kept = advantage[scored]
        return torch.where(scored, (advantage - kept.mean()) / (kept.std() + 1e-4), torch.zeros_like(advantage))
    if tokens is None:
        raise ValueError(f"{estimator} whitens over tokens: give each sample's token count")
    grouped, valid = _grouped(rewards, group_size)
    values = grouped
    if estimator == "reinforce_pp_baseline":
        centred = group_advantages(rewards, group_size, "none").view_as(grouped)
        values = torch.where(valid, centred, torch.full_like(grouped, float("nan")))
    return token_whitened(values.reshape(-1), tokens)
