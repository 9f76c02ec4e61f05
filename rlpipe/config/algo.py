"""The `algo` section: the policy loss, its advantages and clipping, the KL term, importance-sampling corrections."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key


@dataclass
class AlgoConfig:
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo"] = key(
        "grpo",
        "policy loss: grpo (token-level clipped surrogate), dr_grpo (no std scaling, token sums over a constant), "
        "dapo (clip-higher, token mean, uniform groups dropped), gspo (sequence-level ratio and clipping)",
    )
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = key(
        "grpo",
        "the baseline a reward is compared with: grpo (its group's mean, scaled by algo.advantage_scale), rloo (the "
        "mean of its group's other samples, TRL's RLOO; scale none or batch), reinforce_pp (the batch, whitened over "
        "its tokens: verl's REINFORCE++), reinforce_pp_baseline (its group's mean, then whitened over the batch's "
        "tokens: verl's REINFORCE++-baseline) (docs/algorithms.md)",
    )
    advantage_scale: Literal["group", "batch", "none"] | None = key(
        None, "divide advantages by the group's std, the batch's std, or nothing (null: the loss's own: none for "
        "dr_grpo, group for the others)"
    )
    advantage_std: Literal["unbiased", "population"] = key(
        "unbiased", "the std advantages are divided by: unbiased (Bessel's n - 1, as TRL and verl) or population (n)"
    )
    clip_low: float | None = key(
        None, "clip epsilon below 1 (null: the loss's own: 0.2; gspo 3e-4)"
    )
    clip_high: float | None = key(
        None, "clip epsilon above 1, clip-higher when above clip_low (null: the loss's own: 0.28; dr_grpo 0.2; "
        "gspo 4e-4)"
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = key(
        None, "how grpo averages per-token losses (null: token-mean); the other losses fix their own"
    )
    distill_teacher: str | None = key(
        None, "on-policy distillation: a teacher model (folder, Hub id or builtin:NAME, with the policy's tokenizer) "
        "whose log-probs of the policy's sampled tokens add coef x KL(policy || teacher) to the loss, served by the "
        "scorer role (docs/algorithms.md); null: none"
    )
    distill_coef: float = key(1.0, "with algo.distill_teacher: the weight of the reverse KL to the teacher")
    distill_rewards: bool = key(
        True, "with algo.distill_teacher: keep the rewards' advantages beside the teacher's signal (false: the "
        "teacher's alone; reward functions still score, for the metrics)"
    )
    kl_beta: float = key(0.0, "weight of the KL penalty to a frozen reference model (0: no reference model)")
    kl_estimator: Literal["k1", "k2", "k3"] = key("k3", "KL estimator")
    kl_bias_correction: bool = key(
        False, "multiply the KL estimate by the importance ratio p / p_old (TRL's use_bias_correction_kl, its "
        "default); nothing to correct while algo.kl_beta is 0"
    )
    entropy_coef: float = key(
        0.0, "entropy bonus: subtract coef x the mean per-token entropy of the trained tokens from the loss (TRL's "
        "entropy_coef; a token mean whatever algo.loss_agg; 0: off; needs model.kernels.logprob chunked or reference)"
    )
    mask_truncated_completions: bool = key(
        False, "leave completions that reached rollout.max_tokens without ending out of the loss (their tokens "
        "do not train; their rewards still count in their group's advantages)"
    )
    tis_cap: float | None = key(2.0, "cap of the truncated importance weight learner/rollout (null: off)")
    mis_threshold: float | None = key(
        None, "masked importance sampling: drop tokens whose learner/rollout ratio is outside [1/t, t] (null: off)"
    )
    mis_level: Literal["token", "sequence"] = key(
        "token", "what MIS drops: single tokens, or whole sequences by their geometric-mean ratio"
    )
    dynamic_sampling: bool = key(
        False, "DAPO's dynamic sampling: while fewer than train.prompts_per_step of a step's groups have signal "
        "(rewards not all equal), draw that many more prompts and generate again, up to algo.max_generation_rounds "
        "rounds; the step trains on prompts_per_step groups with signal (synchronous mode only)"
    )
    max_generation_rounds: int = key(
        10, "with algo.dynamic_sampling, a step's generation rounds at most (verl's max_num_gen_batches); once spent, "
        "the step trains on the groups with signal it has"
    )
    drop_uniform_groups: bool | None = key(
        None, "skip groups whose rewards are all equal (no signal) (null: the loss's own: true for dapo)"
    )
    router_aux_loss_coef: float | None = key(
        None,
        "mixture-of-experts models: weight of the router's load-balancing loss added to the policy loss "
        "(null: the model config's router_aux_loss_coef when its output_router_logits is true, as transformers "
        "trains, else 0)",
    )

    def check(self) -> None:
        require(
            self.advantage_estimator != "rloo" or self.advantage_scale in (None, "none", "batch"),
            "algo.advantage_scale: rloo's advantages are scaled none (TRL's default) or batch (TRL's "
            f"normalize_advantages), not {self.advantage_scale}",
        )
        require(
            not self.advantage_estimator.startswith("reinforce_pp") or self.advantage_scale is None,
            f"algo.advantage_scale: {self.advantage_estimator} whitens its advantages over the batch's tokens itself; "
            "leave advantage_scale null",
        )
        require(self.max_generation_rounds >= 1, "algo.max_generation_rounds: must be >= 1")
        require(self.clip_low is None or 0 <= self.clip_low <= 1, "algo.clip_low: must be in [0, 1] or null")
        require(self.clip_high is None or self.clip_high >= 0, "algo.clip_high: must be >= 0 or null")
        require(
            self.loss_agg is None or self.loss == "grpo",
            f"algo.loss_agg: only grpo takes an aggregation; {self.loss} fixes its own (set it to null)",
        )
        require(self.kl_beta >= 0, "algo.kl_beta: must be >= 0")
        require(self.distill_coef > 0 and math.isfinite(self.distill_coef), "algo.distill_coef: must be > 0")
        require(math.isfinite(self.entropy_coef), "algo.entropy_coef: must be a finite number")
        require(
            self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
            "algo.router_aux_loss_coef: must be >= 0 or null",
        )
        require(self.tis_cap is None or self.tis_cap > 0, "algo.tis_cap: must be > 0 or null")
        require(self.mis_threshold is None or self.mis_threshold > 1, "algo.mis_threshold: must be > 1 or null")
