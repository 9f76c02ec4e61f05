"""One learner rank without Ray: the policy, its optimizer, the GRPO update, log-probs and weights for sync."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from rlpipe.algo import (
    aggregate,
    kl_penalty,
    logprob_gap,
    policy_loss,
    truncated_importance_weights,
)
from rlpipe.config import Config
from rlpipe.models import load_model, read_hf_config, save_model
from rlpipe.rollout import encode_weights
from rlpipe.types import TrainBatch


def token_logprobs(model, input_ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False):
    """Logprob of each token given the ones before it, aligned with input_ids (position 0 gets 0).

    With `with_entropy`, also the policy's entropy at each position (detached; a metric, not a loss term).
    """
    logits = model(input_ids).float()[:, :-1] / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    picked = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    picked = torch.nn.functional.pad(picked, (1, 0))
    if not with_entropy:
        return picked
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return picked, torch.nn.functional.pad(entropy, (1, 0))


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Learner:
    def __init__(self, model_path: str, cfg: Config):
        torch.manual_seed(cfg.run.seed)
        self.cfg = cfg
        self.model_path = model_path
        self.dtype = getattr(torch, cfg.model.dtype)
        self.hf_config = read_hf_config(model_path)
        self.model = load_model(model_path, dtype=self.dtype)
        # Without a KL term there is nothing to compare against, so no second copy of the model is held.
        self.reference = None
        if cfg.algo.kl_beta > 0:
            self.reference = load_model(model_path, dtype=self.dtype).eval().requires_grad_(False)
        train = cfg.train
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, foreach=True
        )
        self.optimizer_steps_per_batch = cfg.samples_per_step // (train.mini_batch_size or cfg.samples_per_step)
        total = train.steps * self.optimizer_steps_per_batch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, train.warmup_steps, total, train.lr_schedule, train.min_lr_ratio),
        )
        # vLLM reports logprobs after temperature; greedy decoding (0) has no temperature to divide by.
        self.temperature = cfg.rollout.temperature or 1.0
        self.policy_version = 0

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        micro = self.cfg.train.micro_batch_size
        for start in range(0, len(batch), micro):
            part = batch.slice(start, start + micro)
            out[start : start + micro, : part.input_ids.shape[1]] = token_logprobs(model, part.input_ids, self.temperature)
        return out

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprobs of a fixed sequence at temperature 1, the probe that weight sync is checked against."""
        with torch.no_grad():
            return token_logprobs(self.model, torch.tensor([token_ids]))[0].tolist()

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One GRPO update on a step's samples: mini-batches of optimizer steps, each micro-batched."""
        cfg, algo = self.cfg, self.cfg.algo
        mask = batch.completion_mask
        # With one optimizer step per batch the policy cannot move before every token has been seen,
        # so the "old" logprobs are the training forward's own (detached) and a separate pass is waste.
        old_logprobs = None if self.optimizer_steps_per_batch == 1 else self._logprobs(self.model, batch)
        ref_logprobs = self._logprobs(self.reference, batch) if self.reference is not None else None

        sums: dict[str, float] = defaultdict(float)
        gap_max = 0.0
        if old_logprobs is not None:
            gap = logprob_gap(old_logprobs, batch.rollout_logprobs, mask)
            valid = float(mask.sum())
            sums["gap_abs"], sums["gap_kl"], gap_max = gap["mean_abs"] * valid, gap["kl"] * valid, gap["max_abs"]
        mini_batches = [c.tolist() for c in torch.arange(len(batch)).tensor_split(self.optimizer_steps_per_batch)]
        for rows in (r for r in mini_batches if r):
            first, last = rows[0], rows[-1] + 1
            total_tokens = float(mask[first:last].sum())
            self.optimizer.zero_grad(set_to_none=True)
            for start in range(first, last, cfg.train.micro_batch_size):
                stop = min(start + cfg.train.micro_batch_size, last)
                part = batch.slice(start, stop)
                width = part.input_ids.shape[1]
                logprobs, entropy = token_logprobs(self.model, part.input_ids, self.temperature, with_entropy=True)
                old = logprobs.detach() if old_logprobs is None else old_logprobs[start:stop, :width]
                tokens = float(part.completion_mask.sum())
                if old_logprobs is None:
                    gap = logprob_gap(old, part.rollout_logprobs, part.completion_mask)
                    sums["gap_abs"] += gap["mean_abs"] * tokens
                    sums["gap_kl"] += gap["kl"] * tokens
                    gap_max = max(gap_max, gap["max_abs"])
                per_token, stats = policy_loss(
                    logprobs,
                    old,
                    part.advantages,
                    part.completion_mask,
                    clip_low=algo.clip_low,
                    clip_high=algo.clip_high,
                    token_weights=None
                    if algo.tis_cap is None
                    else truncated_importance_weights(old, part.rollout_logprobs, algo.tis_cap),
                )
                if ref_logprobs is not None:
                    kl = kl_penalty(logprobs, ref_logprobs[start:stop, :width], algo.kl_estimator)
                    per_token = per_token + algo.kl_beta * kl
                    sums["kl"] += float((kl.detach() * part.completion_mask).sum())
                loss = aggregate(
                    per_token,
                    part.completion_mask,
                    algo.loss_agg,
                    total_tokens=total_tokens,
                    total_seqs=float(last - first),
                    max_tokens=cfg.rollout.max_tokens,
                )
                loss.backward()
                sums["loss"] += float(loss.detach())
                sums["clip_fraction"] += float(stats["clip_fraction"]) * tokens
                sums["entropy"] += float((entropy * part.completion_mask).sum())
                sums["tokens"] += tokens
            max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
            sums["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
            sums["lr"] += self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            sums["optimizer_steps"] += 1

        self.policy_version += 1
        steps, tokens = max(1.0, sums["optimizer_steps"]), max(1.0, sums["tokens"])
        gap_tokens = max(1.0, float(mask.sum()))
        metrics = {
            "loss": sums["loss"] / steps,
            "grad_norm": sums["grad_norm"] / steps,
            "lr": sums["lr"] / steps,
            "clip_fraction": sums["clip_fraction"] / tokens,
            "entropy": sums["entropy"] / tokens,
            "train_tokens": sums["tokens"],
            "logprob_gap/mean_abs": sums["gap_abs"] / gap_tokens,
            "logprob_gap/max_abs": gap_max,
            "logprob_gap/kl": sums["gap_kl"] / gap_tokens,
        }
        if ref_logprobs is not None:
            metrics["kl"] = sums["kl"] / tokens
        return metrics

    def weights_payload(self) -> bytes:
        """The policy's weights under Hugging Face names in the rollout dtype, as safetensors bytes."""
        rollout_dtype = getattr(torch, self.cfg.rollout.dtype)
        return encode_weights({name: t.to(rollout_dtype) for name, t in self.model.state_dict().items()})

    def export(self, out_dir: str) -> str:
        save_model(self.model, self.hf_config, out_dir, source_dir=self.cfg.model.tokenizer or self.model_path)
        return out_dir
