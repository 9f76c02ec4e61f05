"""The train engine: one learner rank's model, sharding strategy, optimizer and step, blind to the algorithm.

It runs whatever objective it is given (`rlpipe/algo/objective.py`): every micro-batch goes through the model to a
`ModelOutputs` and the objective turns that and the micro-batch's `LossInputs` into a loss and its `LossStats`.
How the rows run (padded or packed, eager or static shapes) is the forward variant chosen once at start
(`rlpipe/training/forward.py`); what the device implies, the backend table says (`rlpipe/hardware/device.py`). Around that the
engine owns the model (loaded from a Hugging Face folder, with frozen copies for whoever needs one), the sharding
strategy (`rlpipe/parallel/strategy.py`), one optimizer (the functional AdamW of
`rlpipe/parallel/graph_trainer.py`, for eager and compiled steps alike: `learner.graph` only decides whether the
step is compiled), the learning-rate schedule, micro-batching, gradient accumulation and clipping, checkpoint
state, and export.

Batches arrive as CPU tensors: a `TrainBatch` (token ids and lengths) with the `LossInputs` of its rows, which the
engine slices, pads and moves with each micro-batch without reading them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlpipe.training.checkpoint import load_tensors, single_process_dcp
from rlpipe.hardware.device import backend, step_boundary
from rlpipe.training.forward import RowPass, choose_forward, token_logprobs
from rlpipe.models import read_hf_config, save_state_dict
from rlpipe.models.hf import CheckpointWeights, meta_model
from rlpipe.parallel.graph_trainer import GraphTrainStep
from rlpipe.parallel.strategy import choose_strategy
from rlpipe.types import LossInputs, TrainBatch, TrainSums
from rlpipe.training.weight_views import weights_view
from rlpipe.weightsync.form import FULL, WeightForm


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based): a linear warm-up whose first step
    already trains (lr / warmup), then transformers' schedule of that name (`linear` to 0 at `total`, `cosine` to
    `min_ratio` at `total`, held there beyond it).

    The decays are transformers' `get_scheduler` multipliers (constant, linear, cosine_with_min_lr) written out:
    importing them from transformers loads its trainer stack, seconds of every learner process's first step.
    tests/unit/test_trl_knobs.py holds them equal to transformers' own."""
    if step < warmup:
        return (step + 1) / warmup
    step = min(step, total)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    if schedule == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)) * (1 - min_ratio) + min_ratio)
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


class TrainEngine:
    """One rank of the learner: `model`, `learner` and `train` are those config sections; `loss` the objective run
    on every micro-batch; `total_steps` the optimizer steps the schedule spans; `step_rows` the rows of the largest
    mini-batch; `temperature` the one the rollout engine sampled at (its log-probs are taken after it). Ranks of a
    group of several call `join_process_group` together before training; a single process finishes its set-up itself.
    `form`: the run's weight form (rlpipe/weightsync/form.py), whose view of the weights (rlpipe/training/weight_views.py: with
    adapters or without, what a sync sends, what a checkpoint stores) the engine holds. `weights_from(model_path,
    model, dtype)` gives the weights each rank reads its rows from (default: the model folder's safetensors files)."""

    def __init__(
        self, model_path: str, model, learner, train, *, loss, total_steps: int, step_rows: int | None = None,
        temperature: float = 1.0, rank: int = 0, world_size: int = 1, form: WeightForm = FULL,
        weights_from=CheckpointWeights,
    ):
        self.weights_from = weights_from
        self.model_path, self.model_section, self.learner, self.train = model_path, model, learner, train
        self.loss = loss
        self.total_steps = total_steps
        self.rank, self.world_size = rank, world_size
        # One choice for the model: its eager passes (the forward-only ones) run the compiled step's kernels too.
        self.kernels = model.kernels.decided(compiled_for_tpu=learner.device == "tpu" and learner.graph)
        self.dtype = getattr(torch, model.dtype)
        self.hf_config = read_hf_config(model_path)
        self.backend = backend(learner.device)
        self.strategy = choose_strategy(learner, self.dtype, rank, world_size)  # before any model tensor exists
        self.device = self.strategy.device
        self.frozen: list = []
        self._unloaded: list = []  # (model on meta, its weights) for a scheme that loads once its group exists
        self.form = form
        self.weights = weights_view(form, self.strategy, rank, world_size, model_path)
        self.model = self._load(self.weights.weights_to_load)
        self.model.set_activation_checkpointing(learner.activation_checkpointing)
        self.step_fn: GraphTrainStep | None = None
        self.optimizer_steps_taken = 0
        self.policy_version = 0
        # Static shapes (a compiled step, or one recorded on a lazy device) keep every row of a batch and pad rows
        # and columns.
        self.static_shapes = learner.graph or self.backend.lazy
        # With static shapes every optimizer step runs as many micro-batch passes as its largest mini-batch
        # (`step_rows` rows) needs, so a smaller one (uniform groups dropped) pads with empty passes instead of
        # compiling a graph of its own.
        passes = math.ceil(math.ceil(step_rows / world_size) / train.micro_batch_size) if step_rows else 0
        self.forward, self.forward_only = choose_forward(
            learner, self.kernels, temperature=temperature, moe=bool(self.model.architecture.moe_layers),
            own_model=self.model.architecture.implementation == "rlpipe",
            lazy=self.backend.lazy, micro_batch_size=train.micro_batch_size, passes=passes,
        )

    def _load(self, weights_to_load=None):
        """The model, built on `meta`; its weights come straight from the checkpoint, each rank reading only what it
        keeps (the strategy's `load`): now where no group is needed, else when the group forms. `weights_to_load`
        (the weights view's) adds adapters on a frozen base to the model and its weights."""
        kernels = self.kernels
        model = meta_model(self.model_path, self.model_section.impl)
        model.set_kernels(rmsnorm=kernels.rmsnorm, attention=kernels.attention, experts=kernels.experts)
        weights = self.weights_from(self.model_path, model, self.dtype)
        if weights_to_load is not None:
            weights = weights_to_load(model, weights)
        if self.strategy.needs_process_group:
            self._unloaded.append((model, weights))
        else:
            self.strategy.load(model, weights)
        return model

    def frozen_copy(self):
        """Another copy of the starting model, sharded like the policy and never trained (e.g. a KL reference)."""
        if self.step_fn is not None:
            raise RuntimeError("frozen copies are made before the engine joins its group")
        copy = self._load().eval().requires_grad_(False)
        self.frozen.append(copy)
        return copy

    def join_process_group(self, master_addr: str = "127.0.0.1", master_port: int | None = None) -> None:
        """Form the process group (if the strategy has one), shard the models and build the step; every rank calls
        it at the same time. Without a group it only finishes the set-up."""
        if self.step_fn is not None:
            return
        if self.strategy.needs_process_group:
            from rlpipe.parallel.mesh import find_free_port

            self.strategy.join(master_addr, master_port if master_port is not None else find_free_port(master_addr))
        for model, weights in self._unloaded:
            self.strategy.load(model, weights)
        self._unloaded.clear()
        if self.backend.bridged_kernels:
            from rlpipe.kernels import register_torchtpu_ops

            register_torchtpu_ops()
        train = self.train
        self.step_fn = GraphTrainStep(
            self.model,
            self._micro_loss,
            lr=train.lr,
            betas=tuple(train.betas),
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
            grad_clip=train.grad_clip if train.grad_clip > 0 else float("inf"),
            compile=self.learner.graph,
            # Sharded steps compile with inductor too: the SIGSEGV a 2-rank 12-layer inductor step once hit came
            # from gloo running several of its in-flight collectives at once; see rlpipe/parallel/mesh.py.
            backend=self.backend.compile_backend,
            buckets=max(self.learner.length_buckets, self.learner.packed_buckets or [], key=len),
            lazy=self.backend.lazy,
        )
        optimizer = self.step_fn.optimizer
        self.strategy.shard_state([*optimizer.exp_avg, *optimizer.exp_avg_sq])

    def ready(self) -> GraphTrainStep:
        """The step, finishing the set-up first where no group is needed (one process: it joins a group of one)."""
        if self.step_fn is None:
            if self.world_size > 1:
                raise RuntimeError(
                    "a learner of several ranks must join its group first (join_process_group on every rank)"
                )
            self.join_process_group()
        return self.step_fn

    # ------------------------------------------------------------------ forward

    def _micro_loss(self, model, micro: MicroBatch):
        """One micro-batch through the model, then the objective's loss and statistics (pure tensor code, so the
        same function runs eagerly and traced into the compiled step)."""
        return self.loss(self.forward(model, micro), micro.loss_inputs)

    def _micro_batch_shares(self, first: int, last: int) -> list[list[RowPass]]:
        """Every rank's micro-batches of rows [first, last) as (start, stop, real), by rank.

        Ranks take contiguous shares. Every rank runs the same number of forward passes, because each pass gathers
        parameters collectively; a rank whose share runs out runs a masked-out `real=False` pass. Every rank holds
        the whole batch and computes all shares alike, so what shapes a step can be agreed without a collective.
        """
        shares = torch.arange(first, last).tensor_split(self.world_size)
        micro = self.train.micro_batch_size
        passes = max(math.ceil(len(share) / micro) for share in shares)
        out = []
        for share in shares:
            rows = share.tolist()
            chunks = [rows[index * micro : (index + 1) * micro] for index in range(passes)]
            out.append([(chunk[0], chunk[-1] + 1, True) if chunk else (first, first + 1, False) for chunk in chunks])
        return out

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, model=None) -> torch.Tensor:
        """Log-probs of this rank's rows of `batch` under `model` (default: the policy), [B, T] on the CPU; other
        rows stay 0."""
        model = model if model is not None else self.model
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for start, stop, real in self._micro_batch_shares(0, len(batch))[self.rank]:
            part = batch.slice(start, stop)
            rows, width = part.input_ids.shape
            values = self.forward_only.logprobs(model, part, self.device)
            if real:
                out[start:stop, :width] = values[:rows, :width].cpu()
        return out

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs of a fixed sequence at temperature 1, the probe that weight sync is checked against."""
        with torch.no_grad():
            ids = torch.tensor([token_ids], device=self.device)
            return token_logprobs(self.model, ids, kernels=self.kernels)[0].tolist()

    def next_token(self, token_ids: list[int]) -> int:
        """The policy's most likely token after `token_ids` (greedy decoding, for a decoded probe)."""
        with torch.no_grad():
            ids = torch.tensor([token_ids], device=self.device)
            logits = F.linear(self.model.hidden_states(ids)[0, -1], self.model.output_embedding())
            return int(logits.argmax())

    # ------------------------------------------------------------------ the update

    def lr_factor(self, step: int) -> float:
        """Multiplier of train.lr at optimizer step `step` (the step count is the schedule's only state, which is
        what a checkpoint keeps)."""
        train = self.train
        return lr_factor(step, train.warmup_steps, self.total_steps, train.lr_schedule, train.min_lr_ratio)

    def optimizer_step(self, rows: TrainBatch | None, inputs: LossInputs | None) -> TrainSums:
        """One optimizer step over the mini-batch `rows` (this rank takes its share, micro-batch by micro-batch):
        gradients accumulated over micro-batches, clipped by their global norm, AdamW. `inputs` are the objective's
        inputs for those rows. `rows` None steps on zero gradients (momentum and weight decay still act). Returns
        this rank's figures of the step: the loss, grad_norm, lr, the objective's `LossStats` and, with static shapes,
        the step's counts of compiles and graph breaks."""
        self.ready()
        lr = self.train.lr * self.lr_factor(self.optimizer_steps_taken)
        shares = self._micro_batch_shares(0, len(rows)) if rows is not None else [[]] * self.world_size
        micro_batches = self.forward.micro_batches(rows, inputs, shares, self.rank)
        micro_batches = [self.strategy.place(micro) for micro in micro_batches]
        report = self.step_fn.step(micro_batches, lr=lr)
        self.optimizer_steps_taken += 1
        return TrainSums(
            loss=report.loss, grad_norm=report.grad_norm, lr=lr, optimizer_steps=1.0,
            samples_run=float(len(rows)) if rows is not None else 0.0, stats=report.stats,
            # Counted where the step is captured (an eager step compiles nothing).
            compiles=report.compiles if self.static_shapes else None,
            graph_breaks=report.graph_breaks if self.static_shapes else None,
        )

    # ------------------------------------------------------------------ weights, checkpoints, export

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full shape of every tensor weight sync sends, under its Hugging Face name, in state-dict order: every
        weight, or with adapters the merged weights or the adapters alone (the weights view's). No communication."""
        return {name: tuple(value.shape) for name, value in self.model.state_dict().items() if self.weights.synced(name)}

    def local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every tensor `weight_shapes` names (the whole tensor when unsharded), as weight sync
        reads them: no gather. Rows follow `rlpipe.weightsync.shard_rows`. With adapters merged, B's rows are the
        weight's rows and A is whole on every rank, so each rank merges its own rows, one weight at a time as the
        sync reads it; with the adapters alone, the rank's rows of each adapter (`adapter_rows`)."""
        return self.weights.local_weights(self.model)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Everything a resumed engine needs, as tensors under stable names: the weights (`model.<HF name>`), AdamW's
        moments (`optim.<HF name>.exp_avg` / `.exp_avg_sq`), its step count and the policy version. Sharded engines
        hold DTensor shards here, so torch.distributed.checkpoint writes each rank's own rows and loading into
        another layout reshards (any number of ranks)."""
        self.ready()
        # With adapters the base is the model folder's, unchanged: only the adapters are state.
        state = {f"model.{name}": value for name, value in self.model.state_dict().items()
                 if self.weights.checkpointed(name)}
        optimizer = self.step_fn.optimizer
        moments = {id(p): (m, v) for p, m, v in zip(self.step_fn.params, optimizer.exp_avg, optimizer.exp_avg_sq)}
        for name, param in self.model.named_parameters():
            if id(param) in moments:  # a frozen parameter has none
                state[f"optim.{name}.exp_avg"], state[f"optim.{name}.exp_avg_sq"] = moments[id(param)]
        state["optim.step"] = optimizer.step
        state["learner.policy_version"] = torch.tensor(self.policy_version)
        return state

    def save_checkpoint(self, directory: str) -> None:
        """Write this rank's part of the state; every rank calls it at the same time."""
        import torch.distributed.checkpoint as dcp

        with single_process_dcp(self.world_size == 1):
            dcp.save(self.checkpoint_state(), checkpoint_id=directory)

    def load_checkpoint(self, directory: str) -> None:
        """Load a state saved by `save_checkpoint` with any number of ranks, resharded to this engine."""
        state = self.checkpoint_state()
        load_tensors(state, directory, "this model", single_process=self.world_size == 1)
        # On xla the loaded values are still pending copies: materialised here, the next step's program is the one
        # every step runs instead of a variant that also performs the load.
        step_boundary(self.device)
        self.optimizer_steps_taken = int(state["optim.step"].item())
        self.policy_version = int(state["learner.policy_version"].item())

    def export(self, out_dir: str, merge: bool = False) -> str:
        """The policy as a Hugging Face folder (rank 0 writes; every rank calls it, each tensor's gather is
        collective). Streamed: a whole tensor at a time on every rank, and a safetensors shard's worth on rank 0.
        With adapters: a PEFT adapter folder, or with `merge` a Hugging Face folder of the merged weights."""
        tensors = self.weights.export(self.strategy.full_tensors(self.model), out_dir, merge)
        if tensors is None:  # the view wrote its own folder (adapters)
            return out_dir
        if self.rank == 0:
            save_state_dict(tensors, self.hf_config, out_dir, source_dir=self.model_section.tokenizer or self.model_path)
        else:
            for _ in tensors:  # take part in every gather
                pass
        return out_dir
