"""Training objectives as small objects: a policy loss (GRPO, Dr. GRPO, DAPO, GSPO), importance corrections that
weight its tokens (TIS, MIS) and terms added to it (KL to a reference model, an entropy bonus, the reverse KL to a
teacher, the MoE router's balance loss).

An `Objective` is what the train engine runs on every micro-batch: `objective(outputs, inputs) -> (loss, stats)`.
`outputs` is what the model computed (`ModelOutputs`); `inputs` is the micro-batch's `LossInputs` — `mask` ([B, T],
the tokens trained on), `advantages` [B], `rollout_logprobs` [B, T], optionally `old_logprobs` and `ref_logprobs`
[B, T], and the mini-batch's `total_tokens` / `total_seqs`, so that losses summed over micro-batches are the
mini-batch's loss. `stats` is a `LossStats` (rlpipe/types.py): sums over the micro-batch's trained tokens, which
add up over micro-batches and ranks; a correction or term fills its own fields.

Everything here is pure tensor code (no `.item()`, no data-dependent Python branch), so the same objective runs
eagerly and inside the compiled step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from torch import Tensor

from rlpipe.algo.losses import (
    aggregate,
    kl_penalty,
    masked_importance_weights,
    policy_loss,
    sequence_policy_loss,
    truncated_importance_weights,
)
from rlpipe.models.moe import expert_token_counts, load_balancing_loss, router_probability_sums
from rlpipe.types import LossInputs, LossStats, ModelOutputs


# ------------------------------------------------------------------ policy losses


@dataclass
class GRPOLoss:
    """Token-level PPO clipped surrogate with separate clip-low / clip-high, reduced by `aggregation`."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    aggregation: str = "token-mean"
    max_tokens: int | None = None  # the constant of seq-mean-token-sum-norm
    # What the rest of the pipeline does for this loss unless configured otherwise.
    advantage_scale: ClassVar[str] = "group"
    drop_uniform_groups: ClassVar[bool] = False

    def __call__(self, logprobs, old, advantages, mask, weights, inputs: LossInputs) -> tuple[Tensor, Tensor]:
        """The loss and the share of trained tokens whose clipped branch is the minimum."""
        per_token, stats = policy_loss(
            logprobs, old, advantages, mask, clip_low=self.clip_low, clip_high=self.clip_high, token_weights=weights
        )
        return self.aggregate(per_token, mask, inputs), stats["clip_fraction"]

    def importance_ratio(self, logprobs: Tensor, old: Tensor, mask: Tensor) -> Tensor:
        """[B, T] p / p_old as this loss takes it, with its gradient: each token's own."""
        return torch.exp(logprobs - old.detach())

    def aggregate(self, per_token: Tensor, mask: Tensor, inputs: LossInputs) -> Tensor:
        """Reduce a [B, T] per-token quantity as this loss reduces its own (additive terms use it too)."""
        return aggregate(
            per_token, mask, self.aggregation, total_tokens=inputs.total_tokens, total_seqs=inputs.total_seqs,
            max_tokens=self.max_tokens,
        )


@dataclass
class DrGRPOLoss(GRPOLoss):
    """Dr. GRPO: advantages are not divided by the group's std, and each sequence's token sum is divided by a
    constant (the maximum completion length) instead of its own length, so no length bias enters the gradient."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = "seq-mean-token-sum-norm"
    advantage_scale: ClassVar[str] = "none"


@dataclass
class DAPOLoss(GRPOLoss):
    """DAPO: clip-higher, every token weighs the same (token mean over the mini-batch), and groups whose rewards
    are all equal are left out of the batch (dynamic sampling)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    aggregation: str = "token-mean"
    drop_uniform_groups: ClassVar[bool] = True


@dataclass
class GSPOLoss:
    """GSPO: one importance ratio per sequence — the geometric mean of its tokens' ratios, exp(mean over its tokens
    of log p - log p_old) — clipped at the sequence level, each sequence weighing the same. Its clip range is
    narrow because a length-normalised ratio moves far less than a token's."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    advantage_scale: ClassVar[str] = "group"
    drop_uniform_groups: ClassVar[bool] = False

    def __call__(self, logprobs, old, advantages, mask, weights, inputs: LossInputs) -> tuple[Tensor, Tensor]:
        per_sequence, clipped = sequence_policy_loss(
            logprobs, old, advantages, mask, clip_low=self.clip_low, clip_high=self.clip_high, token_weights=weights
        )
        loss = per_sequence.sum() / inputs.total_seqs.to(per_sequence.dtype).clamp_min(1.0)
        tokens = mask.sum(-1).to(per_sequence.dtype)
        # Share of tokens whose sequence was clipped, so it averages over tokens like the token-level losses'.
        fraction = (clipped.to(tokens.dtype) * tokens).sum() / tokens.sum().clamp_min(1.0)
        return loss, fraction

    def importance_ratio(self, logprobs: Tensor, old: Tensor, mask: Tensor) -> Tensor:
        """[B, T] p / p_old as this loss takes it, with its gradient: the sequence's geometric mean on each token."""
        valid = mask.bool()
        log_ratio = torch.where(valid, logprobs - old.detach(), torch.zeros_like(logprobs))
        per_sequence = log_ratio.sum(-1) / valid.sum(-1).clamp_min(1).to(logprobs.dtype)
        return torch.exp(per_sequence)[:, None].expand_as(logprobs)

    def aggregate(self, per_token: Tensor, mask: Tensor, inputs: LossInputs) -> Tensor:
        """Length-normalised per sequence, then the mean over sequences, as the ratio itself is."""
        return aggregate(per_token, mask, "seq-mean-token-mean", total_seqs=inputs.total_seqs)


POLICY_LOSSES = {"grpo": GRPOLoss, "dr_grpo": DrGRPOLoss, "dapo": DAPOLoss, "gspo": GSPOLoss}


# ------------------------------------------------------------------ importance corrections (token weights)


@dataclass
class TruncatedImportance:
    """TIS: weight each token by min(p_learner / p_rollout, cap), correcting the engine's numerics and staleness."""

    cap: float

    def __call__(self, old: Tensor, inputs: LossInputs, stats: LossStats) -> Tensor:
        return truncated_importance_weights(old, inputs.rollout_logprobs, self.cap)


@dataclass
class MaskedImportance:
    """MIS: drop tokens (or whole sequences) whose learner/rollout ratio lies outside [1/threshold, threshold]."""

    threshold: float
    level: str = "token"

    def __call__(self, old: Tensor, inputs: LossInputs, stats: LossStats) -> Tensor:
        mask = inputs.mask
        kept = masked_importance_weights(old, inputs.rollout_logprobs, mask, self.threshold, self.level)
        stats.mis_dropped = torch.where(mask, 1 - kept, torch.zeros_like(kept)).sum()
        return kept


# ------------------------------------------------------------------ additive terms


@dataclass
class KLPenalty:
    """beta x KL(policy || reference), estimated per token (k1/k2/k3), reduced as the policy loss reduces. With
    `bias_correction` the estimate is weighted by the policy loss's importance ratio p / p_old (TRL's
    use_bias_correction_kl): the tokens were sampled from the old policy, so the plain estimate is biased once the
    policy moves; the ratio's gradient flows, so the gradient differs even where the ratio is 1."""

    beta: float
    estimator: str = "k3"
    bias_correction: bool = False
    every_row_counts: ClassVar[bool] = True  # a sample with advantage 0 still has a KL gradient
    needs_reference: ClassVar[bool] = True

    def __call__(self, outputs: ModelOutputs, inputs: LossInputs, policy, stats: LossStats) -> Tensor:
        mask = inputs.mask
        kl = kl_penalty(outputs.logprobs, inputs.ref_logprobs, self.estimator)
        stats.kl = torch.where(mask, kl.detach(), torch.zeros_like(kl)).sum()
        if self.bias_correction:
            kl = kl * policy.importance_ratio(outputs.logprobs, old_logprobs(outputs, inputs), mask)
        return self.beta * policy.aggregate(kl, mask, inputs)


@dataclass
class EntropyBonus:
    """-coef x the mean per-token entropy over the mini-batch's trained tokens (TRL's entropy_coef): a positive
    coefficient rewards keeping the policy from collapsing. It is a token mean whatever the policy loss's
    aggregation, so the coefficient means the same for every loss; padding and tool-output tokens are outside
    the mask and do not count."""

    coef: float
    every_row_counts: ClassVar[bool] = True  # a sample with advantage 0 still has an entropy gradient
    needs_reference: ClassVar[bool] = False

    def __call__(self, outputs: ModelOutputs, inputs: LossInputs, policy, stats: LossStats) -> Tensor:
        entropy = torch.where(inputs.mask, outputs.entropy, torch.zeros_like(outputs.entropy)).sum()
        return -self.coef * entropy / inputs.total_tokens.to(entropy.dtype).clamp_min(1.0)


@dataclass
class TeacherKL:
    """On-policy distillation: coef x KL(policy || teacher), the reverse KL to a teacher model, through its estimator
    on the tokens the policy sampled. The log-ratio log p(x) - log q(x) of each token (p the policy that sampled it,
    q the teacher, whose log-probs the scorer role computed) is a per-token advantage of minus itself: the term is
    the log-ratio, detached, times the policy loss's importance ratio p / p_old, whose gradient at p = p_old is
    log-ratio x grad log p, and over tokens sampled from p that is the reverse KL's gradient (the score function's
    mean is zero). Reduced as the policy loss reduces; tokens where the teacher gave nothing have log-ratio 0."""

    coef: float
    every_row_counts: ClassVar[bool] = True  # a sample with advantage 0 still learns from the teacher
    needs_reference: ClassVar[bool] = False

    def __call__(self, outputs: ModelOutputs, inputs: LossInputs, policy, stats: LossStats) -> Tensor:
        mask = inputs.mask
        old = old_logprobs(outputs, inputs)
        log_ratio = torch.where(mask, old - inputs.teacher_logprobs, torch.zeros_like(old)).detach()
        stats.teacher_kl = log_ratio.sum()
        ratio = policy.importance_ratio(outputs.logprobs, old, mask)
        return self.coef * policy.aggregate(log_ratio * ratio, mask, inputs)


@dataclass
class RouterBalance:
    """A mixture-of-experts model's load-balancing loss (coefficient x transformers' switch loss), and the router
    statistics as sums over the trained tokens: routed copies per (MoE layer, expert) and router probability per
    expert. The sums add up over micro-batches and ranks; the loss itself is per micro-batch, token-weighted so
    that a mini-batch's micro-batches add up to its mean (as transformers does with gradient accumulation)."""

    coef: float
    experts_per_token: int

    @property
    def every_row_counts(self) -> bool:
        return bool(self.coef)

    needs_reference: ClassVar[bool] = False

    def __call__(self, outputs: ModelOutputs, inputs: LossInputs, policy, stats: LossStats) -> Tensor:
        token_mask = outputs.router_mask
        counts, probability = [], 0.0
        for logits in outputs.router_logits:  # one per MoE layer, in layer order
            counts.append(expert_token_counts(logits.detach(), self.experts_per_token, token_mask))
            probability = probability + router_probability_sums(logits.detach(), token_mask)
        stats.router_tokens, stats.router_probability = torch.stack(counts), probability
        aux = load_balancing_loss(outputs.router_logits, self.experts_per_token, token_mask)
        return self.coef * aux * token_mask.sum().float() / inputs.total_tokens


# ------------------------------------------------------------------ the objective


class Objective:
    """A policy loss, the corrections that weight its tokens, and the terms added to it; plus the diagnostics every
    step reports (trained tokens, entropy, and the gap between the learner's and the rollout engine's log-probs)."""

    def __init__(self, policy, corrections=(), terms=()):
        self.policy = policy
        self.corrections = list(corrections)
        self.terms = list(terms)

    @property
    def every_row_counts(self) -> bool:
        """Whether a sample with advantage 0 can still change the update (else the engine may skip it)."""
        return any(term.every_row_counts for term in self.terms)

    @property
    def needs_reference(self) -> bool:
        return any(term.needs_reference for term in self.terms)

    def __call__(self, outputs: ModelOutputs, inputs: LossInputs) -> tuple[Tensor, LossStats]:
        mask, logprobs = inputs.mask, outputs.logprobs
        old = old_logprobs(outputs, inputs)
        zeros = torch.zeros_like(old)
        rollout = inputs.rollout_logprobs
        gap = torch.where(mask, (old - rollout).abs(), zeros)
        stats = LossStats(
            tokens=mask.sum().float(),
            entropy=torch.where(mask, outputs.entropy.detach(), zeros).sum(),
            gap_abs=gap.sum(),
            gap_max=gap.max(),
            # The rollout engine sampled the tokens, so it is the "policy" of the k3 estimator and the learner the
            # reference: KL(rollout || learner).
            gap_kl=torch.where(mask, kl_penalty(rollout, old, "k3"), zeros).sum(),
        )
        weights = torch.ones_like(old)
        for correction in self.corrections:
            weights = weights * correction(old, inputs, stats)
        loss, clip_fraction = self.policy(logprobs, old, inputs.advantages, mask, weights, inputs)
        stats.clip_fraction = clip_fraction * stats.tokens
        for term in self.terms:
            loss = loss + term(outputs, inputs, self.policy, stats)
        return loss, stats


def old_logprobs(outputs: ModelOutputs, inputs: LossInputs) -> Tensor:
    """The log-probs of the policy that generated the rows, as the importance ratio's denominator. With one optimizer
    step per batch the policy has not moved yet: its own detached log-probs are "old"."""
    return inputs.old_logprobs if inputs.old_logprobs is not None else outputs.logprobs.detach()


def loss_defaults(algo) -> tuple[str, bool]:
    """(advantage_scale, drop_uniform_groups) of an `algo` config section: its own values, or its loss's."""
    policy = POLICY_LOSSES[algo.loss]
    # RLOO's advantages are not scaled unless asked (TRL's RLOOTrainer); REINFORCE++ whitens its own.
    own_scale = "none" if algo.advantage_estimator != "grpo" else policy.advantage_scale
    scale = algo.advantage_scale if algo.advantage_scale is not None else own_scale
    drop = algo.drop_uniform_groups if algo.drop_uniform_groups is not None else policy.drop_uniform_groups
    return scale, drop


def build_objective(algo, *, max_tokens: int, moe=None) -> Objective:
    """The objective an `algo` config section describes. `max_tokens` is the longest completion (Dr. GRPO's
    normaliser); `moe` is (experts_per_token, coefficient) for a mixture-of-experts model, else None."""
    policy_class = POLICY_LOSSES[algo.loss]
    # Each loss takes the settings it has fields for; a null one leaves the loss's own default.
    settings = {"clip_low": algo.clip_low, "clip_high": algo.clip_high, "aggregation": algo.loss_agg,
                "max_tokens": max_tokens}
    accepted = {f.name for f in fields(policy_class)}
    policy = policy_class(**{k: v for k, v in settings.items() if k in accepted and v is not None})
    corrections = []
    if algo.tis_cap is not None:
        corrections.append(TruncatedImportance(algo.tis_cap))
    if algo.mis_threshold is not None:
        corrections.append(MaskedImportance(algo.mis_threshold, algo.mis_level))
    terms = []
    if algo.kl_beta > 0:
        terms.append(KLPenalty(algo.kl_beta, algo.kl_estimator, algo.kl_bias_correction))
    if algo.entropy_coef != 0:
        terms.append(EntropyBonus(algo.entropy_coef))
    if algo.distill_teacher is not None:
        terms.append(TeacherKL(algo.distill_coef))
    if moe is not None:
        experts_per_token, coef = moe
        terms.append(RouterBalance(coef, experts_per_token))
    return Objective(policy, corrections, terms)
