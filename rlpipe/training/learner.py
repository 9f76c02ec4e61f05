"""One learner rank without Ray: GRPO on the train engine. It builds the objective from the `algo` config section,
computes the log-probs it compares against (the policy before the update, a frozen reference), chooses which
samples to run, and hands mini-batches to the algorithm-blind engine (rlpipe/training/train_engine.py)."""

from __future__ import annotations

import math
from functools import reduce
from operator import add

import torch

from rlpipe.algo import build_objective
from rlpipe.config import Config
from rlpipe.models import read_hf_config
from rlpipe.models.moe import balance_loss_from_sums
from rlpipe.models.registry import model_architecture
from rlpipe.training.train_engine import TrainEngine
from rlpipe.types import LossInputs, LossStats, TrainBatch, TrainSums
from rlpipe.weightsync.form import FULL, WeightForm
from rlpipe.weightsync.probe import DecodedProbe, decode_probe


class Learner:
    """One rank of the learner group: the train engine plus what GRPO asks of it. `algo` is that config section;
    `model`, `learner` and `train` go to the engine; `samples_per_step` is a step's batch (prompts x group size),
    `temperature` and `max_tokens` the rollout's sampling temperature and longest completion; `form`: the run's weight
    form (rlpipe/weightsync/form.py), decided at start-up; `engine_options` go to the `TrainEngine` as they are."""

    def __init__(
        self, model_path: str, *, model, learner, train, algo, samples_per_step: int, temperature: float,
        max_tokens: int, form: WeightForm, seed: int = 0, rank: int = 0, world_size: int = 1,
        **engine_options,
    ):
        torch.manual_seed(seed)
        self.rank, self.world_size = rank, world_size
        self.optimizer_steps_per_batch = samples_per_step // (train.mini_batch_size or samples_per_step)
        self.num_iterations = train.num_iterations  # passes over a step's mini-batches
        config = model_architecture(read_hf_config(model_path))
        moe = None
        if config.moe_layers:
            coef = algo.router_aux_loss_coef if algo.router_aux_loss_coef is not None else config.router_aux_loss_coef
            moe = (config.experts_per_token, coef)
        self.objective = build_objective(algo, max_tokens=max_tokens, moe=moe)
        self.engine = TrainEngine(
            model_path, model, learner, train, loss=self.objective,
            total_steps=train.steps * self.optimizer_steps_per_batch * self.num_iterations,
            step_rows=samples_per_step // self.optimizer_steps_per_batch,
            # vLLM reports log-probs after temperature; greedy decoding (0) has no temperature to divide by.
            temperature=temperature or 1.0, rank=rank, world_size=world_size, form=form,
            **engine_options,
        )
        # Without a KL term there is nothing to compare against, so no second copy of the model is held; with LoRA
        # the reference is the frozen base itself, read with the adapters off (the weights view's).
        self.reference = self.engine.weights.frozen_reference(self.engine) if self.objective.needs_reference else None
        # A sample with advantage 0 adds exactly 0 to a policy loss and its gradient; only a term such as KL or the
        # router loss gives it one. Static shapes (a compiled step, xla) keep every row.
        self.skip_zero_advantage = (
            learner.skip_zero_advantage and not self.engine.static_shapes and not self.objective.every_row_counts
        )
        if world_size == 1 and not self.engine.strategy.needs_process_group:
            self.engine.ready()  # nothing to wait for: the step and its optimizer memory now, while engines start

    @classmethod
    def from_config(
        cls, model_path: str, cfg: Config, rank: int = 0, world_size: int = 1, form: WeightForm = FULL
    ) -> Learner:
        """A rank as `cfg` configures it; `form`: the run's weight form (`rlpipe.weightsync.form.weight_form`), which
        must be given where learner.lora is set."""
        if (form.lora is None) != (cfg.learner.lora is None):
            raise ValueError("learner.lora and the weight form disagree: give the run's weight form "
                             "(rlpipe.weightsync.form.weight_form)")
        return cls(
            model_path, model=cfg.model, learner=cfg.learner, train=cfg.train, algo=cfg.algo,
            samples_per_step=cfg.samples_per_step, temperature=cfg.rollout.temperature,
            max_tokens=cfg.rollout.max_tokens, seed=cfg.run.seed, rank=rank, world_size=world_size,
            form=form,
        )

    @property
    def model(self):
        return self.engine.model

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def join_process_group(self, master_addr: str, master_port: int) -> None:
        """Form the torch.distributed group (when sharded) and shard the models; every rank calls this at once."""
        self.engine.join_process_group(master_addr, master_port)

    def _mini_batches(self, size: int) -> list[tuple[int, int]]:
        bounds = torch.arange(size).tensor_split(self.optimizer_steps_per_batch)
        return [(int(b[0]), int(b[-1]) + 1) for b in bounds if len(b)]

    def _rows_to_run(self, batch: TrainBatch, first: int, last: int) -> TrainBatch | None:
        """The rows of mini-batch [first, last) the step computes: all of them, or only those with a non-zero
        advantage (learner.skip_zero_advantage); None when none is left."""
        if not self.skip_zero_advantage:
            return batch.slice(first, last)
        rows = first + torch.nonzero(batch.advantages[first:last]).flatten()
        return batch.take(rows) if len(rows) else None

    def train_step(self, batch: TrainBatch) -> TrainSums:
        """One GRPO update on a step's samples: a mini-batch per optimizer step, every mini-batch once per iteration
        (train.num_iterations). Returns this rank's sums; `combine_rank_metrics` turns every rank's into the step's
        metrics."""
        engine = self.engine
        engine.ready()
        # With one optimizer step per batch the policy cannot move before every token has been seen, so the "old"
        # log-probs are the training forward's own (detached) and a separate pass is waste.
        several_steps = self.optimizer_steps_per_batch * self.num_iterations > 1
        mini_batches: list[tuple[TrainBatch | None, LossInputs | None]] = []
        for first, last in self._mini_batches(len(batch)):
            rows = self._rows_to_run(batch, first, last)
            inputs = None if rows is None else LossInputs(
                mask=rows.completion_mask,
                advantages=rows.advantages,
                rollout_logprobs=rows.rollout_logprobs,
                teacher_logprobs=rows.teacher_logprobs,
                # The loss's denominators count the rows left out as well.
                total_tokens=batch.completion_mask[first:last].sum().float(),
                total_seqs=torch.tensor(float(last - first)),
            )
            mini_batches.append((rows, inputs))
        # All before the first update: "old" is the policy that generated the step.
        running = [(rows, inputs) for rows, inputs in mini_batches if rows is not None]
        if several_steps:
            for rows, inputs in running:
                inputs.old_logprobs = engine.logprobs(rows, self.model)
        if self.objective.needs_reference:
            for rows, inputs in running:
                inputs.ref_logprobs = self._reference_logprobs(rows)
        steps = [engine.optimizer_step(rows, inputs) for rows, inputs in mini_batches * self.num_iterations]
        engine.policy_version += 1
        return reduce(TrainSums.then, steps)

    def _reference_logprobs(self, rows: TrainBatch) -> torch.Tensor:
        """The KL reference's log-probs of `rows`: the frozen copy's, or under LoRA the policy's with its adapters
        off, which is the starting model (the base never trains)."""
        return self.engine.weights.reference_logprobs(self.engine, rows, self.reference)

    def probe_reference(self, token_ids: list[int], by_decoding: bool) -> list[float] | DecodedProbe:
        """What an engine's probe is checked against: the log-probs of `token_ids`, or for an engine that decodes
        its probe, the greedy continuation of them (rlpipe/weightsync/probe.py)."""
        if by_decoding:
            return decode_probe(token_ids, self.engine.next_token, self.engine.sequence_logprobs)
        return self.engine.sequence_logprobs(token_ids)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.engine.weight_shapes()

    def local_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.local_weights()

    def save_checkpoint(self, directory: str) -> None:
        self.engine.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        self.engine.load_checkpoint(directory)

    def export(self, out_dir: str) -> str:
        return self.engine.export(out_dir)


def combine_rank_metrics(per_rank: list[TrainSums]) -> dict[str, float]:
    """The step's metrics from every rank's sums (rank-local sums add up; norms and lr are shared)."""
    first = per_rank[0]
    steps = max(1.0, first.optimizer_steps)
    stats = [sums.stats for sums in per_rank if sums.stats is not None]
    total = reduce(LossStats.combine, stats) if stats else None
    figures = total.metrics() if total is not None else {"train_tokens": 0.0}
    metrics = {
        "loss": reduce(add, [sums.loss for sums in per_rank]) / steps,
        "grad_norm": first.grad_norm / steps,
        "lr": first.lr / steps,
        "train_tokens": figures.pop("train_tokens"),
        "learner/samples_run": first.samples_run,  # every rank sees every row
    }
    if first.compiles is not None:  # the captured step (learner.graph, or xla), counted since the learner started
        metrics["learner/graph_compiles"] = first.compiles
        metrics["learner/graph_breaks"] = first.graph_breaks  # on xla: programs run beyond one per step
    metrics.update(figures)
    if metrics["train_tokens"] and total.router_tokens is not None:
        metrics.update(_router_metrics(total.router_tokens, total.router_probability, metrics["train_tokens"]))
    return metrics


def _router_metrics(router_tokens: torch.Tensor, router_probability: torch.Tensor, tokens: float) -> dict[str, float]:
    """Expert load of a mixture-of-experts step from the routed copies per (MoE layer, expert) and the router
    probability per expert, summed over ranks: the least and most loaded expert as a multiple of the balanced share
    (1.0 each when balanced; 0 for an expert that got nothing), worst over layers, and the entropy of the load over
    experts as a fraction of its maximum (log of the expert count), averaged over layers; and the load-balancing loss
    of the whole step's completion tokens. Routing is dropless (no capacity), so no token is dropped."""
    per_layer = router_tokens.double()
    shares, entropies = [], []
    for load in per_layer:
        if load.sum() <= 0:
            continue
        shares.append(load / load.mean())
        p = load / load.sum()
        entropies.append(float(-(p[p > 0] * p[p > 0].log()).sum() / math.log(len(load))))
    if not shares:
        return {}
    copies = reduce(add, per_layer)  # layer by layer, in order
    return {
        "moe/expert_load_min": float(min(share.min() for share in shares)),
        "moe/expert_load_max": float(max(share.max() for share in shares)),
        "moe/expert_load_entropy": sum(entropies) / len(entropies),
        "moe/aux_loss": float(
            balance_loss_from_sums(copies.float(), router_probability.float(), tokens * len(per_layer))
        ),
    }
