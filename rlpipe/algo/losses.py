"""Policy-gradient losses, KL estimators and loss aggregation as tensor functions.

Shape conventions used throughout:
    B = sequences (completions) in the batch, T = padded completion length.
    ``logprobs``-like tensors are ``[B, T]``: log-probability of the sampled token
    at each completion position. ``mask`` is ``[B, T]`` (bool, or 0/1 numbers;
    any non-zero counts as valid) marking real completion tokens; padding is 0.

Masked positions are removed with ``torch.where`` rather than multiplication so
that garbage in padding (inf/NaN logprobs) cannot leak into the result.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "policy_loss",
    "sequence_policy_loss",
    "kl_penalty",
    "aggregate",
    "truncated_importance_weights",
    "masked_importance_weights",
]

_KL_ESTIMATORS = ("k1", "k2", "k3")
_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _bool_mask(mask: Tensor, like: Tensor) -> Tensor:
    if mask.shape != like.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match {tuple(like.shape)}"
        )
    return mask if mask.dtype == torch.bool else mask != 0


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, per token.

    ``ratio = exp(logprobs - old_logprobs)`` and
    ``loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``.
    Separate ``clip_low``/``clip_high`` allow DAPO's "clip-higher" (a larger upper
    bound lets low-probability tokens with positive advantage grow further).

    Args:
        logprobs: ``[B, T]`` current-policy logprobs of the sampled tokens (grad flows).
        old_logprobs: ``[B, T]`` logprobs under the policy that generated the data
            (treated as constants: detached).
        advantages: ``[B]`` one advantage per sequence, broadcast over its tokens
            (detached).
        mask: ``[B, T]`` valid-token mask.
        clip_low: lower clip range, ratio floor is ``1 - clip_low`` (0 <= clip_low <= 1).
        clip_high: upper clip range, ratio ceiling is ``1 + clip_high`` (>= 0).
        token_weights: optional ``[B, T]`` multiplicative weights (e.g. truncated
            importance weights); detached, so they rescale but are never trained.

    Returns:
        ``(per_token_loss [B, T], stats)``. ``per_token_loss`` is 0 at masked
        positions; reduce it with :func:`aggregate`. ``stats`` holds detached
        scalar float tensors over valid tokens:
        ``clip_fraction`` -- share of valid tokens where the clipped branch is the
        minimum (strictly), i.e. the token's gradient is zero because of clipping;
        ``clip_fraction_high`` / ``clip_fraction_low`` -- the same split into
        tokens clipped at the ceiling (A > 0) and at the floor (A < 0);
        ``ratio_mean`` / ``ratio_max`` -- of the importance ratio.
        All are 0 when there are no valid tokens.
    """
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"logprobs/old_logprobs must both be [B, T]; got "
            f"{tuple(logprobs.shape)} and {tuple(old_logprobs.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [B]={tuple(logprobs.shape[:1])}, "
            f"got {tuple(advantages.shape)}"
        )
    if not 0.0 <= clip_low <= 1.0:
        raise ValueError(f"clip_low must be in [0, 1], got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    valid = _bool_mask(mask, logprobs)

    ratio = torch.exp(logprobs - old_logprobs.detach())
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(-1)  # [B, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    # Select rather than torch.minimum: on ties minimum splits the gradient
    # between branches; here a tie means "not clipped" and the full gradient
    # flows through the unclipped branch. Where the clipped branch wins, clamp
    # has zero gradient, which is exactly PPO's trust-region behaviour.
    took_clip = clipped < unclipped
    loss = -torch.where(took_clip, clipped, unclipped)
    if token_weights is not None:
        if token_weights.shape != logprobs.shape:
            raise ValueError(
                f"token_weights must be [B, T]={tuple(logprobs.shape)}, "
                f"got {tuple(token_weights.shape)}"
            )
        loss = loss * token_weights.detach()
    loss = torch.where(valid, loss, torch.zeros_like(loss))

    with torch.no_grad():
        n = valid.sum().clamp_min(1).to(logprobs.dtype)
        clip_valid = took_clip & valid
        ratio_valid = torch.where(valid, ratio, torch.zeros_like(ratio))
        stats = {
            "clip_fraction": clip_valid.sum().to(logprobs.dtype) / n,
            "clip_fraction_high": (clip_valid & (adv > 0)).sum().to(logprobs.dtype) / n,
            "clip_fraction_low": (clip_valid & (adv < 0)).sum().to(logprobs.dtype) / n,
            "ratio_mean": ratio_valid.sum() / n,
            "ratio_max": ratio_valid.max() if ratio.numel() else ratio.new_zeros(()),
        }
    return loss, stats


def sequence_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GSPO's clipped surrogate, per sequence.

    ``s_i = exp(mean over the valid tokens of sequence i of (logprobs - old_logprobs))`` and
    ``loss_i = -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)``: the importance ratio is the
    geometric mean of the tokens' ratios, so it does not grow with length, and clipping keeps or drops a whole
    sequence. ``token_weights`` (importance corrections) weigh a sequence by their mean over its valid tokens.
    A sequence without valid tokens has ratio 1 and loss 0.

    Returns ``(per_sequence_loss [B], clipped [B] bool)``; ``clipped`` marks sequences where the clipped branch is
    strictly the minimum (their gradient is zero). Ties take the unclipped branch, as in :func:`policy_loss`.
    """
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"logprobs/old_logprobs must both be [B, T]; got {tuple(logprobs.shape)} and {tuple(old_logprobs.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}")
    valid = _bool_mask(mask, logprobs)
    lengths = valid.sum(-1).clamp_min(1).to(logprobs.dtype)
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio.sum(-1) / lengths)
    adv = advantages.detach().to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    took_clip = clipped < unclipped
    loss = -torch.where(took_clip, clipped, unclipped)
    if token_weights is not None:
        weights = torch.where(valid, token_weights.detach(), torch.zeros_like(token_weights))
        loss = loss * (weights.sum(-1) / lengths)
    has_tokens = valid.any(-1)
    return torch.where(has_tokens, loss, torch.zeros_like(loss)), took_clip & has_tokens


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || ref) from tokens sampled by the policy.

    With ``d = logprobs - ref_logprobs`` (Schulman, "Approximating KL Divergence"):
        ``k1 = d`` (unbiased, high variance, can be negative);
        ``k2 = d**2 / 2`` (biased, low variance, >= 0);
        ``k3 = exp(-d) + d - 1`` (unbiased, low variance, >= 0).

    Args:
        logprobs: ``[...]`` logprobs of the sampled tokens under the policy.
        ref_logprobs: same shape, under the reference model.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        Tensor of the same shape, unmasked (reduce with :func:`aggregate`).
    """
    if estimator not in _KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; expected one of {_KL_ESTIMATORS}"
        )
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    # exp(ref - logp) - (ref - logp) - 1
    return torch.exp(-diff) + diff - 1.0


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    Modes:
        ``"token-mean"``: sum over valid tokens / number of valid tokens (every
        token weighs the same; long sequences weigh more).
        ``"seq-mean-token-mean"``: mean over sequences of each sequence's mean over
        its valid tokens (every sequence weighs the same).
        ``"seq-mean-token-sum-norm"``: mean over sequences of each sequence's token
        *sum* divided by the constant ``max_tokens`` (Dr. GRPO: no
        length-dependent normaliser). ``max_tokens`` is required.

    Gradient accumulation: when a mini-batch is split into micro-batches, pass
    ``total_tokens`` (valid tokens in the whole mini-batch) and ``total_seqs``
    (sequences, i.e. rows, in the whole mini-batch). The denominators then refer to
    the mini-batch, so the SUM of the micro-batch results (and of their gradients)
    equals the result over the whole mini-batch. ``None`` means "use this batch's
    own count" (valid tokens for ``total_tokens``; B for ``total_seqs``). Only the
    count a mode uses is read: ``total_tokens`` for ``token-mean``, ``total_seqs``
    for the two ``seq-mean`` modes.

    Every row counts as a sequence in the ``seq-mean`` denominators, including rows
    with no valid token; such rows contribute 0 (never NaN). A zero denominator
    (nothing valid at all) yields 0.

    Args:
        per_token: ``[B, T]`` per-token values.
        mask: ``[B, T]`` valid-token mask.
        mode: one of the modes above.

    Returns:
        0-dim tensor.
    """
    if mode not in _AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {_AGG_MODES}")
    if per_token.dim() != 2:
        raise ValueError(f"per_token must be [B, T], got {tuple(per_token.shape)}")
    valid = _bool_mask(mask, per_token)
    for name, value in (("total_tokens", total_tokens), ("total_seqs", total_seqs)):
        # Tensor counts (a compiled step passes them as graph inputs) are not inspected: that would sync.
        if value is not None and not isinstance(value, Tensor) and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")

    masked = torch.where(valid, per_token, torch.zeros_like(per_token))
    seq_sum = masked.sum(dim=-1)  # [B]

    if mode == "token-mean":
        if total_tokens is None:
            # Stay on-device (no .item() sync); clamp: no valid token -> 0, not NaN.
            n_tok = valid.sum().clamp_min(1).to(per_token.dtype)
            return seq_sum.sum() / n_tok
        return seq_sum.sum() / _at_least_one(total_tokens, per_token.dtype)

    n_seq = per_token.shape[0] if total_seqs is None else total_seqs
    if mode == "seq-mean-token-mean":
        # clamp: a row with no valid token has sum 0 -> contributes 0, not 0/0.
        seq_val = seq_sum / valid.sum(dim=-1).clamp_min(1).to(per_token.dtype)
    else:
        if max_tokens is None or max_tokens <= 0:
            raise ValueError(
                f"mode 'seq-mean-token-sum-norm' requires max_tokens > 0, got {max_tokens}"
            )
        seq_val = seq_sum / float(max_tokens)
    return seq_val.sum() / _at_least_one(n_seq, per_token.dtype)


def _at_least_one(count: float | Tensor, dtype: torch.dtype) -> float | Tensor:
    """A denominator that is never 0, staying a tensor when it is one."""
    if isinstance(count, Tensor):
        return count.to(dtype).clamp_min(1.0)
    return max(float(count), 1.0)


def truncated_importance_weights(
    learner_logprobs: Tensor, rollout_logprobs: Tensor, cap: float
) -> Tensor:
    """Truncated importance sampling (TIS) weights per token.

    The rollout engine (e.g. vLLM) computes slightly different probabilities than
    the learner for the same policy weights; weighting the loss by
    ``p_learner / p_rollout`` corrects that mismatch, and capping it bounds the
    variance from tokens where the two disagree wildly.

    Args:
        learner_logprobs: ``[B, T]`` logprobs under the learner's forward pass.
        rollout_logprobs: ``[B, T]`` logprobs reported by the rollout engine.
        cap: upper bound for the weights (> 0).

    Returns:
        ``[B, T]`` ``min(exp(learner - rollout), cap)``, detached (a weight, not a
        training target). Masking is left to the consumer.
    """
    if not cap > 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    with torch.no_grad():
        return torch.exp(learner_logprobs - rollout_logprobs).clamp(max=cap)


def masked_importance_weights(
    learner_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, threshold: float, level: str = "token"
) -> Tensor:
    """Masked importance sampling (MIS): 1 for tokens kept, 0 for tokens dropped from the loss.

    Where the learner and the rollout engine disagree too much, the sample is treated as off-policy noise and
    dropped rather than reweighted: a token whose ratio ``p_learner / p_rollout`` lies outside
    ``[1/threshold, threshold]`` (``level="token"``), or every token of a sequence whose geometric-mean ratio over
    its valid tokens does (``level="sequence"``; the mean keeps the threshold independent of length).

    Args:
        learner_logprobs, rollout_logprobs: ``[B, T]``.
        mask: ``[B, T]`` valid-token mask (padding never decides a sequence's fate).
        threshold: > 1.
        level: ``"token"`` or ``"sequence"``.

    Returns:
        ``[B, T]`` float 0/1, detached.
    """
    if not threshold > 1:
        raise ValueError(f"MIS threshold must be > 1, got {threshold}")
    if level not in ("token", "sequence"):
        raise ValueError(f"MIS level must be 'token' or 'sequence', got {level!r}")
    valid = _bool_mask(mask, learner_logprobs)
    limit = math.log(threshold)
    with torch.no_grad():
        log_ratio = torch.where(valid, learner_logprobs - rollout_logprobs, torch.zeros_like(learner_logprobs))
        if level == "sequence":
            per_sequence = log_ratio.sum(-1) / valid.sum(-1).clamp_min(1)
            log_ratio = per_sequence[:, None].expand_as(log_ratio)
        return (log_ratio.abs() <= limit).to(learner_logprobs.dtype)

