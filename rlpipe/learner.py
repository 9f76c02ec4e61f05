"""One learner rank without Ray: the policy, its optimizer, the GRPO update, log-probs and weights for sync."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from rlpipe.algo import (
    aggregate,
    kl_penalty,
    masked_importance_weights,
    policy_loss,
    truncated_importance_weights,
)
from rlpipe.checkpoint import load_tensors
from rlpipe.config import Config, KernelsConfig
from rlpipe.device import step_boundary, torch_device
from rlpipe.kernels import linear_logprob, logits_logprob
from rlpipe.models import load_model, read_hf_config, save_state_dict
from rlpipe.models.moe import balance_loss_from_sums, expert_token_counts, load_balancing_loss, router_probability_sums
from rlpipe.types import TrainBatch


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    kernels: KernelsConfig | None = None,
    lengths: torch.Tensor | None = None,
    scored: torch.Tensor | None = None,
    router_logits: list[torch.Tensor] | None = None,
    prompt_lengths: torch.Tensor | None = None,
):
    """Logprob of each token given the ones before it, aligned with input_ids (position 0 gets 0).

    With `with_entropy`, also the policy's entropy at each position (detached; a metric, not a loss term).
    rlpipe's models go through the output projection with `kernels.logprob` (by default in vocabulary chunks, so
    [tokens x vocab] logits never exist); any other callable returning logits is read the plain way.
    With `lengths` (real tokens per row) an rlpipe model runs on the rows packed into one (`pack`), so no padding
    token is computed, and `scored` ([B, T] bool, e.g. the completion mask) limits the output projection to the
    tokens whose log-prob is used; every other position gets 0. With `prompt_lengths` too, rows with the same
    prompt run it once (see `pack`).
    A `router_logits` list receives a mixture-of-experts model's router logits, one [tokens, experts] tensor per
    MoE layer, over the rows as run: packed (the real tokens in row order) or padded (B x T).
    """
    kernels = kernels or KernelsConfig()
    if lengths is not None and hasattr(model, "output_embedding"):
        return _packed_token_logprobs(
            model, input_ids, lengths, temperature, with_entropy, kernels, scored, router_logits, prompt_lengths
        )
    targets = input_ids[:, 1:]
    if hasattr(model, "output_embedding"):
        hidden = model.hidden_states(input_ids, router_logits=router_logits)[:, :-1]
        picked, entropy = linear_logprob(
            hidden.reshape(-1, hidden.shape[-1]),
            model.output_embedding(),
            targets.reshape(-1),
            temperature,
            impl=kernels.logprob,
            chunk=kernels.logprob_chunk,
        )
    else:
        logits = model(input_ids)[:, :-1]
        picked, entropy = logits_logprob(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), 1.0 / temperature)
    picked = torch.nn.functional.pad(picked.view(targets.shape), (1, 0))
    if not with_entropy:
        return picked
    return picked, torch.nn.functional.pad(entropy.view(targets.shape), (1, 0))


def pack(input_ids: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor | None = None):
    """Right-padded rows [B, T] as one row of their real tokens: ids [1, N], position ids [1, N] (each token's
    position in its own sequence), the row's `Segments` and `where` [B, T], each real token's index in the packed
    row (-1 at padding).

    With `prompt_lengths`, consecutive rows whose prompts are the same tokens (a GRPO group) share one copy: the
    prompt runs once and each row's completion follows it, attending to it — the values a row would get alone,
    with the prompt's tokens computed once per group instead of once per sample."""
    rows, lengths = input_ids.tolist(), lengths.tolist()
    prompts = lengths if prompt_lengths is None else [max(1, min(p, n)) for p, n in zip(prompt_lengths.tolist(), lengths)]
    ids, positions, segments = [], [], []
    where = torch.full(input_ids.shape, -1, dtype=torch.long)
    first = 0
    while first < len(rows):
        prompt, block = prompts[first], [prompts[first]]
        last = first + 1
        while last < len(rows) and prompts[last] == prompt and rows[last][:prompt] == rows[first][:prompt]:
            last += 1
        where[first:last, :prompt] = torch.arange(len(ids), len(ids) + prompt)
        ids += rows[first][:prompt]
        positions += range(prompt)
        for row in range(first, last):
            continuation = range(prompt, lengths[row])
            if continuation:
                where[row, prompt : lengths[row]] = torch.arange(len(ids), len(ids) + len(continuation))
                ids += rows[row][prompt : lengths[row]]
                positions += continuation
                block.append(len(continuation))
        segments.append(tuple(block))
        first = last
    return torch.tensor([ids]), torch.tensor([positions]), tuple(segments), where


def _packed_token_logprobs(
    model, input_ids, lengths, temperature, with_entropy, kernels, scored, router_logits, prompt_lengths
):
    ids, positions, segments, where = pack(input_ids, lengths, prompt_lengths)
    hidden = model.hidden_states(ids.to(input_ids.device), positions.to(input_ids.device), segments, router_logits)[0]
    # Token (r, t) is scored from the hidden state of token (r, t - 1); a sequence's first token has no prediction.
    # On RL batches the prompt tokens are about half of all tokens, and their log-probs are never used, so they
    # skip the projection.
    wanted = where >= 0
    wanted[:, 0] = False
    if scored is not None:
        wanted &= scored.cpu()
    rows, columns = wanted.nonzero(as_tuple=True)
    if len(rows) == 0:  # e.g. a padding pass of a sharded learner: still one row, so every rank runs the same ops
        rows, columns = torch.tensor([0]), torch.tensor([max(1, int(lengths[0]) - 1)])
    picked, entropy = linear_logprob(
        hidden[where[rows, columns - 1].to(hidden.device)], model.output_embedding(), input_ids[rows, columns],
        temperature, impl=kernels.logprob, chunk=kernels.logprob_chunk,
    )
    wanted = wanted.to(hidden.device)

    def unpacked(values: torch.Tensor) -> torch.Tensor:
        placed = values.new_zeros(input_ids.shape).index_put((rows.to(values.device), columns.to(values.device)), values)
        return torch.where(wanted, placed, 0.0)

    return (unpacked(picked), unpacked(entropy)) if with_entropy else unpacked(picked)


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Learner:
    """One rank of the learner group. With several ranks (or a compute dtype other than the master dtype)
    the model is sharded SimpleFSDP-style over a torch.distributed group; every rank takes its share of
    each mini-batch and the gradients meet in the reduce-scatter.

    The model lives on `learner.device`; batches arrive as CPU tensors and each micro-batch is moved there, and
    weights leave as CPU tensors (`full_state_dict`, `local_weights`). On xla the step is traced lazily and run as
    one XLA program (see rlpipe/parallel/graph_trainer.py), and rows are never packed: packing makes every
    micro-batch a new shape, which XLA would compile anew.
    """

    def __init__(self, model_path: str, cfg: Config, rank: int = 0, world_size: int = 1):
        torch.manual_seed(cfg.run.seed)
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.model_path = model_path
        # On xla, learner.ranks > 1 is one process driving that many XLA devices as an SPMD mesh (see
        # rlpipe/parallel/simple_fsdp.py for why not one process per device).
        self.spmd_mesh = None
        if cfg.learner.device == "xla" and cfg.learner.ranks > 1:
            if world_size > 1:
                raise ValueError("learner.device: 'xla' runs one learner process that shards over its devices (SPMD)")
            from rlpipe.parallel.simple_fsdp import xla_spmd_mesh

            self.spmd_mesh = xla_spmd_mesh(cfg.learner.ranks)  # before any XLA tensor exists
        self.device = torch_device(cfg.learner.device)
        self.dtype = getattr(torch, cfg.model.dtype)
        self.param_dtype = getattr(torch, cfg.learner.param_dtype or cfg.model.dtype)
        self.hf_config = read_hf_config(model_path)
        self.kernels = cfg.model.kernels
        self.model = self._load(model_path)
        model_config = self.model.config
        self.moe_layers = model_config.moe_layers
        self.router_aux_loss_coef = (
            cfg.algo.router_aux_loss_coef
            if cfg.algo.router_aux_loss_coef is not None
            else model_config.router_aux_loss_coef
        )
        # Only the policy: the reference model runs under no_grad, where nothing is saved for backward anyway.
        self.model.model.activation_checkpointing = cfg.learner.activation_checkpointing
        # Without a KL term there is nothing to compare against, so no second copy of the model is held.
        self.reference = None
        if cfg.algo.kl_beta > 0:
            self.reference = self._load(model_path).eval().requires_grad_(False)
        self.sharded = world_size > 1 or self.param_dtype != self.dtype
        self.optimizer_steps_per_batch = cfg.samples_per_step // (cfg.train.mini_batch_size or cfg.samples_per_step)
        # A sample with advantage 0 adds exactly 0 to the policy loss and its gradient; only a KL term or a router
        # loss would give it one. The compiled step keeps every row (static shapes), as does xla.
        self.skip_zero_advantage = (
            cfg.learner.skip_zero_advantage
            and not cfg.learner.graph
            and self.device.type != "xla"
            and self.reference is None
            and not (self.moe_layers and self.router_aux_loss_coef)
        )
        # vLLM reports logprobs after temperature; greedy decoding (0) has no temperature to divide by.
        self.temperature = cfg.rollout.temperature or 1.0
        self.policy_version = 0
        if self.spmd_mesh is not None:
            from rlpipe.parallel.simple_fsdp import shard_dim0_spmd

            shard_dim0_spmd(self.model.parameters(), self.spmd_mesh)
            if self.reference is not None:
                shard_dim0_spmd(self.reference.parameters(), self.spmd_mesh)
        if not self.sharded:
            self._build_optimizer()

    def _load(self, model_path: str):
        model = load_model(model_path, dtype=self.dtype)
        return model.use_kernels(
            rmsnorm=self.kernels.rmsnorm, attention=self.kernels.attention, experts=self.kernels.experts
        ).to(self.device)

    def join_group(self, master_addr: str, master_port: int) -> None:
        """Form the torch.distributed group and shard the model; every rank calls this at the same time."""
        if not self.sharded:
            return
        from rlpipe.device import backend
        from rlpipe.parallel.mesh import init_distributed, make_mesh
        from rlpipe.parallel.simple_fsdp import MixedPrecision, shard_model

        learner = self.cfg.learner
        init_distributed(
            backend(learner.device).dist_backend,
            self.rank,
            self.world_size,
            master_addr,
            master_port,
            timeout_s=learner.collective_timeout_s,
        )
        mesh = make_mesh(self.world_size, backend(learner.device).torch_device)
        precision = MixedPrecision(param_dtype=self.param_dtype, reduce_dtype=getattr(torch, learner.reduce_dtype))
        shard_model(self.model, mesh, precision)
        if self.reference is not None:
            shard_model(self.reference, mesh, precision)
        self._build_optimizer()

    def _build_optimizer(self) -> None:
        train = self.cfg.train
        self.graph_step = None
        self.optimizer_steps_taken = 0
        if self.cfg.learner.graph:
            from rlpipe.device import backend
            from rlpipe.parallel.graph_trainer import GraphTrainStep

            # Sharded steps compile with inductor too: the SIGSEGV a 2-rank 12-layer inductor step once hit came from
            # gloo running several of its in-flight collectives at once; see GLOO_WORKER_THREADS in
            # rlpipe/parallel/mesh.py.
            compiler = backend(self.cfg.learner.device).compile_backend
            self.graph_step = GraphTrainStep(
                self.model,
                self._micro_loss,
                lr=train.lr,
                betas=tuple(train.betas),
                eps=train.adam_eps,
                weight_decay=train.weight_decay,
                grad_clip=train.grad_clip if train.grad_clip > 0 else float("inf"),
                backend=compiler,
                buckets=self.cfg.learner.length_buckets,
            )
            if self.spmd_mesh is not None:
                from rlpipe.parallel.simple_fsdp import shard_dim0_spmd

                optimizer = self.graph_step.optimizer
                shard_dim0_spmd([*optimizer.exp_avg, *optimizer.exp_avg_sq], self.spmd_mesh)
            return
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=train.lr,
            betas=tuple(train.betas),
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
            foreach=True,
        )

    def _micro_batches(self, first: int, last: int) -> list[tuple[int, int, bool]]:
        """This rank's micro-batches of rows [first, last) as (start, stop, real).

        Ranks take contiguous shares. Every rank runs the same number of forward passes, because each pass
        gathers parameters collectively; a rank whose share runs out runs a masked-out `real=False` pass.
        """
        shares = torch.arange(first, last).tensor_split(self.world_size)
        micro = self.cfg.train.micro_batch_size
        passes = max(math.ceil(len(share) / micro) for share in shares)
        mine = shares[self.rank].tolist()
        out = []
        for index in range(passes):
            rows = mine[index * micro : (index + 1) * micro]
            out.append((rows[0], rows[-1] + 1, True) if rows else (first, first + 1, False))
        return out

    def _packed(self, lengths: torch.Tensor, completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The arguments of `token_logprobs` that make an eager forward run packed (learner.packing, not on xla),
        with the prompts' lengths where a group's prompt can run once (learner.share_prompts); none for padded rows."""
        learner = self.cfg.learner
        if not learner.packing or self.device.type == "xla":
            return {}
        if not learner.share_prompts or self.moe_layers or self.kernels.attention != "torch":
            # MoE: the router statistics and load-balancing term count tokens as run, which must not depend on it.
            return {"lengths": lengths}
        # A row's prompt ends where its completion starts; a row without completion tokens keeps to itself.
        prompt_lengths = torch.where(completion_mask.any(dim=1), completion_mask.int().argmax(dim=1), lengths)
        return {"lengths": lengths, "prompt_lengths": prompt_lengths}

    def _on_device(self, tensors: dict) -> dict:
        """A micro-batch's tensors on the learner's device; on an SPMD mesh its rows are split over the devices."""
        moved = {key: value.to(self.device) if isinstance(value, torch.Tensor) else value for key, value in tensors.items()}
        if self.spmd_mesh is not None:
            from rlpipe.parallel.simple_fsdp import shard_dim0_spmd

            shard_dim0_spmd([value for value in moved.values() if isinstance(value, torch.Tensor)], self.spmd_mesh)
        return moved

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

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        """Logprobs of this rank's rows of one mini-batch (other rows stay 0)."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for start, stop, real in self._micro_batches(0, len(batch)):
            part = batch.slice(start, stop)
            rows, width = part.input_ids.shape
            ids = part.input_ids
            if self.device.type == "xla":
                # Static shapes, as in the train step: each bucket compiles once instead of every new width.
                from rlpipe.parallel.graph_trainer import bucket_length

                bucket = bucket_length(width, self.cfg.learner.length_buckets)
                ids = _pad_rows(_fit(ids, bucket), self.cfg.train.micro_batch_size)
            values = token_logprobs(
                model,
                ids.to(self.device),
                self.temperature,
                kernels=self.kernels,
                **self._packed(part.lengths, part.completion_mask),
                scored=part.completion_mask,
            )
            if real:
                out[start:stop, :width] = values[:rows, :width].cpu()
        return out

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprobs of a fixed sequence at temperature 1, the probe that weight sync is checked against."""
        with torch.no_grad():
            ids = torch.tensor([token_ids], device=self.device)
            return token_logprobs(self.model, ids, kernels=self.kernels)[0].tolist()

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One GRPO update on a step's samples: mini-batches of optimizer steps, each micro-batched.

        Eager, or with each mini-batch's whole step (forward, loss, backward, clip, AdamW) as one compiled graph;
        both run the same `_micro_loss`. Returns this rank's sums; `combine_rank_metrics` turns every rank's sums
        into the step's metrics.
        """
        train = self.cfg.train
        # Every mini-batch's rows to run, and the loss's denominators, which count the rows left out as well.
        mini_batches = [
            (
                self._rows_to_run(batch, first, last),
                {
                    "total_tokens": batch.completion_mask[first:last].sum().float(),
                    "total_seqs": torch.tensor(float(last - first)),
                },
            )
            for first, last in self._mini_batches(len(batch))
        ]
        # With one optimizer step per batch the policy cannot move before every token has been seen,
        # so the "old" logprobs are the training forward's own (detached) and a separate pass is waste.
        several_steps = self.optimizer_steps_per_batch > 1
        old = [self._logprobs(self.model, mini) if several_steps and mini is not None else None for mini, _ in mini_batches]
        ref = [self._logprobs(self.reference, mini) if self.reference is not None else None for mini, _ in mini_batches]
        sums: dict[str, float] = defaultdict(float)
        for (mini, totals), old_logprobs, ref_logprobs in zip(mini_batches, old, ref):
            if self.graph_step is not None:
                # Static shapes, so a graph compiles once per length bucket: rows padded to micro_batch_size,
                # columns to the bucket of the mini-batch's longest sequence (every rank sees the whole batch).
                from rlpipe.parallel.graph_trainer import bucket_length

                width = bucket_length(int(mini.lengths.max()), self.cfg.learner.length_buckets)
                micro_batches = [
                    self._on_device(
                        {**self._micro_batch(mini, part, old_logprobs, ref_logprobs, width, train.micro_batch_size), **totals}
                    )
                    for part in self._micro_batches(0, len(mini))
                ]
                lr = train.lr * self.scheduler_factor(self.optimizer_steps_taken)
                out = self.graph_step.step(micro_batches, lr=lr)
                sums["compiles"] = out.pop("compiles")
                out.pop("graph_breaks")
            else:
                lr = train.lr * self.scheduler_factor(self.optimizer_steps_taken)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.zero_grad(set_to_none=True)
                out = defaultdict(float)
                for part in self._micro_batches(0, len(mini)) if mini is not None else []:
                    micro = self._micro_batch(mini, part, old_logprobs, ref_logprobs)
                    micro.update(self._packed(mini.lengths[part[0] : part[1]], micro["mask"]))
                    loss, stats = self._micro_loss(self.model, self._on_device({**micro, **totals}))
                    loss.backward()
                    # One host transfer for all of them: a MoE model adds a count per (layer, expert).
                    values = torch.stack([loss.detach().float(), *(v.detach().float() for v in stats.values())])
                    _accumulate(out, dict(zip(["loss", *stats], values.tolist())))
                if mini is None:  # every row had advantage 0: AdamW still steps (momentum, weight decay) on zeros
                    for param in self.model.parameters():
                        param.grad = torch.zeros_like(param)
                max_norm = train.grad_clip if train.grad_clip > 0 else float("inf")
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
                out["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                self.optimizer.step()
            self.optimizer_steps_taken += 1
            run = float(len(mini)) if mini is not None else 0.0
            _accumulate(sums, {**out, "lr": lr, "optimizer_steps": 1.0, "samples_run": run})
        self.policy_version += 1
        return dict(sums)

    def scheduler_factor(self, step: int) -> float:
        """Multiplier of train.lr at optimizer step `step`, for both the eager and the compiled step (the step
        count is the schedule's only state, which is what a checkpoint keeps)."""
        train = self.cfg.train
        total = train.steps * self.optimizer_steps_per_batch
        return lr_factor(step, train.warmup_steps, total, train.lr_schedule, train.min_lr_ratio)

    def _micro_batch(
        self, batch: TrainBatch, part, old_logprobs, ref_logprobs, width: int | None = None, rows: int | None = None
    ) -> dict[str, torch.Tensor]:
        """The tensors of one micro-batch; padded to `rows` x `width` when given (for a static-shape graph).

        A padding pass (`real` False) keeps its tokens but has an all-False mask, so it adds nothing.
        """
        start, stop, real = part
        span = slice(start, stop)
        width = width or int(batch.lengths[span].max())
        mask = batch.completion_mask[span] if real else torch.zeros_like(batch.completion_mask[span])
        fields = {"input_ids": batch.input_ids[span], "mask": mask, "rollout_logprobs": batch.rollout_logprobs[span]}
        if old_logprobs is not None:
            fields["old_logprobs"] = old_logprobs[span]
        if ref_logprobs is not None:
            fields["ref_logprobs"] = ref_logprobs[span]
        micro = {key: _fit(value, width) for key, value in fields.items()}
        micro["advantages"] = batch.advantages[span]
        if rows is not None:
            micro = {key: _pad_rows(value, rows) for key, value in micro.items()}
        return micro

    def _micro_loss(self, model, micro: dict[str, torch.Tensor]):
        """The GRPO loss of one micro-batch and its statistics (sums over its tokens), as pure tensor code, so
        the same function runs eagerly and traced into the compiled step."""
        algo = self.cfg.algo
        mask = micro["mask"]
        router_logits = [] if self.moe_layers else None
        logprobs, entropy = token_logprobs(
            model,
            micro["input_ids"],
            self.temperature,
            with_entropy=True,
            kernels=self.kernels,
            lengths=micro.get("lengths"),
            prompt_lengths=micro.get("prompt_lengths"),
            scored=mask,
            router_logits=router_logits,
        )
        old = micro["old_logprobs"] if "old_logprobs" in micro else logprobs.detach()
        # Corrections for the rollout engine's numerics (and staleness): reweight (TIS) and/or drop (MIS).
        weights = torch.ones_like(old)
        if algo.tis_cap is not None:
            weights = weights * truncated_importance_weights(old, micro["rollout_logprobs"], algo.tis_cap)
        if algo.mis_threshold is not None:
            kept = masked_importance_weights(old, micro["rollout_logprobs"], mask, algo.mis_threshold, algo.mis_level)
            weights = weights * kept
        per_token, stats = policy_loss(
            logprobs,
            old,
            micro["advantages"],
            mask,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            token_weights=weights,
        )
        zeros = torch.zeros_like(old)
        tokens = mask.sum().float()
        # The rollout engine's logprobs against the learner's pre-update ones, on the same sampled tokens.
        gap = torch.where(mask, (old - micro["rollout_logprobs"]).abs(), zeros)
        gap_kl = kl_penalty(micro["rollout_logprobs"], old, "k3")  # as logprob_gap measures it
        out = {
            "tokens": tokens,
            "clip_fraction": stats["clip_fraction"] * tokens,
            "entropy": (entropy * mask).sum(),
            "gap_abs": gap.sum(),
            "gap_max": gap.max(),
            "gap_kl": torch.where(mask, gap_kl, zeros).sum(),
        }
        if algo.mis_threshold is not None:
            out["mis_dropped"] = torch.where(mask, 1 - kept, zeros).sum()
        if "ref_logprobs" in micro:
            kl = kl_penalty(logprobs, micro["ref_logprobs"], algo.kl_estimator)
            per_token = per_token + algo.kl_beta * kl
            out["kl"] = torch.where(mask, kl.detach(), zeros).sum()
        loss = aggregate(
            per_token,
            mask,
            algo.loss_agg,
            total_tokens=micro["total_tokens"],
            total_seqs=micro["total_seqs"],
            max_tokens=self.cfg.rollout.max_tokens,
        )
        if router_logits:
            loss = loss + self._router_terms(router_logits, micro, out)
        return loss, out

    def _router_terms(self, router_logits: list[torch.Tensor], micro: dict, out: dict) -> torch.Tensor:
        """The load-balancing loss term of one micro-batch (zero unless a coefficient is set), and into `out` the
        router statistics as sums over the completion tokens (the ones the policy loss trains on; the same tokens
        whether the rows run packed or padded): routed copies per (MoE layer, expert) and router probability per
        expert over all MoE layers. Sums add up over micro-batches and ranks, so the step's metrics do not depend
        on how the batch was split. The loss term itself is per micro-batch, as in transformers with gradient
        accumulation: its gradient does depend on the split."""
        mask, lengths = micro["mask"], micro.get("lengths")
        if lengths is not None:  # packed: the router saw the real tokens of each row, back to back
            token_mask = mask[torch.arange(mask.shape[1], device=mask.device) < lengths[:, None].to(mask.device)]
        else:
            token_mask = mask.reshape(-1)
        top_k = self.model.config.experts_per_token
        probability = 0.0
        for layer, logits in zip(self.moe_layers, router_logits):
            counts = expert_token_counts(logits.detach(), top_k, token_mask)
            for expert in range(counts.shape[0]):
                out[f"router_tokens.{layer}.{expert}"] = counts[expert]
            probability = probability + router_probability_sums(logits.detach(), token_mask)
        for expert in range(probability.shape[0]):
            out[f"router_probability.{expert}"] = probability[expert]
        aux = load_balancing_loss(router_logits, top_k, token_mask)
        # Token-weighted over micro-batches, so the sum over a mini-batch's micro-batches is its mean.
        return self.router_aux_loss_coef * aux * token_mask.sum().float() / micro["total_tokens"]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors under Hugging Face names, on the CPU (a collective when sharded: every rank calls it)."""
        if not self.sharded:
            return {name: value.cpu() for name, value in self.model.state_dict().items()}
        from rlpipe.parallel.simple_fsdp import full_state_dict

        return full_state_dict(self.model)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's full shape under its Hugging Face name, in state-dict order: the learner side of the
        sync plan. No communication."""
        return {name: tuple(value.shape) for name, value in self.model.state_dict().items()}

    def local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every weight (the whole tensor when unsharded), as the weight sync reads them:
        no gather. Rows follow `rlpipe.weightsync.shard_rows`."""
        from torch.distributed.tensor import DTensor

        state = self.model.state_dict()
        return {name: (value.to_local() if isinstance(value, DTensor) else value).cpu() for name, value in state.items()}

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Everything a resumed learner needs, as tensors under stable names: the weights (`model.<HF name>`), AdamW's
        moments (`optim.<HF name>.exp_avg` / `.exp_avg_sq`) and step count. Sharded learners hold DTensor shards here,
        so torch.distributed.checkpoint writes each rank's own rows, and loading into another learner's state
        reshards to its layout (any number of ranks). The eager and the compiled step share this format."""
        state = {f"model.{name}": value for name, value in self.model.state_dict().items()}
        named = list(self.model.named_parameters())
        if self.graph_step is not None:
            optimizer = self.graph_step.optimizer
            by_param = {id(param): (m, v) for param, m, v in zip(self.graph_step.params, optimizer.exp_avg, optimizer.exp_avg_sq)}
            step = optimizer.step
        else:
            by_param = {}
            for _, param in named:
                if not self.optimizer.state[param]:  # never stepped: the state a fresh AdamW starts from
                    self.optimizer.state[param].update(
                        step=torch.zeros((), dtype=torch.float32),
                        exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param),
                    )
                moments = self.optimizer.state[param]
                by_param[id(param)] = (moments["exp_avg"], moments["exp_avg_sq"])
            step = torch.tensor(float(self.optimizer_steps_taken))
        for name, param in named:
            state[f"optim.{name}.exp_avg"], state[f"optim.{name}.exp_avg_sq"] = by_param[id(param)]
        state["optim.step"] = step
        state["learner.policy_version"] = torch.tensor(self.policy_version)
        return state

    def save_checkpoint(self, directory: str) -> None:
        """Write this rank's part of the learner state; every rank calls it at the same time."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.checkpoint_state(), checkpoint_id=directory)

    def load_checkpoint(self, directory: str) -> None:
        """Load a learner state saved by `save_checkpoint` with any number of ranks, resharded to this learner."""
        state = self.checkpoint_state()
        load_tensors(state, directory, "this model")
        # On xla the loaded values are still pending copies: materialised here, the next step's program is the one
        # every step runs instead of a variant that also performs the load.
        step_boundary(self.device)
        steps = int(state["optim.step"].item())
        self.optimizer_steps_taken = steps
        self.policy_version = int(state["learner.policy_version"].item())
        if self.graph_step is None:
            for param in self.model.parameters():
                self.optimizer.state[param]["step"] = torch.tensor(float(steps))

    def export(self, out_dir: str) -> str:
        state = self.full_state_dict()
        if self.rank == 0:
            save_state_dict(state, self.hf_config, out_dir, source_dir=self.cfg.model.tokenizer or self.model_path)
        return out_dir


def _fit(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or zero-pad the last dimension of a [B, T] tensor to `width`."""
    if tensor.shape[1] >= width:
        return tensor[:, :width]
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad the first dimension with zeros (masked-out rows) up to `rows`."""
    missing = rows - tensor.shape[0]
    if missing <= 0:
        return tensor
    return torch.cat([tensor, torch.zeros((missing, *tensor.shape[1:]), dtype=tensor.dtype)])


def _accumulate(sums: dict[str, float], values: dict[str, float]) -> None:
    """Add into running sums; keys ending in `_max` keep the maximum."""
    for key, value in values.items():
        sums[key] = max(sums.get(key, value), value) if key.endswith("_max") else sums.get(key, 0.0) + value


def combine_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The step's metrics from every rank's sums (rank-local token sums add up; norms and lr are shared)."""
    total: dict[str, float] = defaultdict(float)
    for sums in per_rank:
        _accumulate(total, sums)
    first = per_rank[0]
    steps = max(1.0, first.get("optimizer_steps", 0.0))
    metrics = {
        "loss": total["loss"] / steps,
        "grad_norm": first.get("grad_norm", 0.0) / steps,
        "lr": first.get("lr", 0.0) / steps,
        "train_tokens": total["tokens"],
        "learner/samples_run": first.get("samples_run", 0.0),  # every rank sees every row
    }
    if "compiles" in first:
        metrics["learner/graph_compiles"] = first["compiles"]
    tokens = total["tokens"]
    if not tokens:  # no token ran (every sample had advantage 0): nothing to average over
        return metrics
    metrics.update({
        "clip_fraction": total["clip_fraction"] / tokens,
        "entropy": total["entropy"] / tokens,
        "logprob_gap/mean_abs": total["gap_abs"] / tokens,
        "logprob_gap/max_abs": total["gap_max"],
        "logprob_gap/kl": total["gap_kl"] / tokens,
    })
    if "kl" in total:
        metrics["kl"] = total["kl"] / tokens
    if "mis_dropped" in total:
        metrics["mis/dropped_fraction"] = total["mis_dropped"] / tokens
    metrics.update(_router_metrics(total, tokens))
    return metrics


def _router_metrics(total: dict[str, float], tokens: float) -> dict[str, float]:
    """Expert load of a mixture-of-experts step from the routed copies per (layer, expert), summed over ranks:
    the least and most loaded expert as a multiple of the balanced share (1.0 each when balanced; 0 for an expert
    that got nothing), worst over layers, and the entropy of the load over experts as a fraction of its maximum
    (log of the expert count), averaged over layers; and the load-balancing loss of the whole step's completion
    tokens. Routing is dropless (no capacity), so no token is dropped."""
    per_layer: dict[int, dict[int, float]] = defaultdict(dict)
    for key, value in total.items():
        if key.startswith("router_tokens."):
            _, layer, expert = key.split(".")
            per_layer[int(layer)][int(expert)] = value
    if not per_layer:
        return {}
    shares, entropies = [], []
    for counts in per_layer.values():
        load = torch.tensor([counts[e] for e in sorted(counts)], dtype=torch.float64)
        if load.sum() <= 0:
            continue
        shares.append(load / load.mean())
        p = load / load.sum()
        entropies.append(float(-(p[p > 0] * p[p > 0].log()).sum() / math.log(len(load))))
    if not shares:
        return {}
    experts = sorted(next(iter(per_layer.values())))
    copies = torch.tensor([sum(counts[e] for counts in per_layer.values()) for e in experts])
    probability = torch.tensor([total[f"router_probability.{e}"] for e in experts])
    return {
        "moe/expert_load_min": float(min(share.min() for share in shares)),
        "moe/expert_load_max": float(max(share.max() for share in shares)),
        "moe/expert_load_entropy": sum(entropies) / len(entropies),
        "moe/aux_loss": float(balance_loss_from_sums(copies, probability, tokens * len(per_layer))),
    }
