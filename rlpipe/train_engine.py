"""The train engine: one learner rank's model, sharding strategy, optimizer and step, blind to the algorithm.

It runs whatever objective it is given (`rlpipe/algo/objective.py`): every micro-batch goes through the model to a
`ModelOutputs` and the objective turns that into a loss and its statistics. Around that it owns the model (loaded
from a Hugging Face folder, with frozen copies for whoever needs one), the sharding strategy
(`rlpipe/parallel/strategy.py`), one optimizer (the functional AdamW of `rlpipe/parallel/graph_trainer.py`, for
eager and compiled steps alike: `learner.graph` only decides whether the step is compiled), the learning-rate
schedule, micro-batching, packing, gradient accumulation and clipping, checkpoint state, and export.

Batches arrive as CPU tensors: a `TrainBatch` (token ids, lengths, and the mask of tokens the objective trains on)
and named extra fields, per row ([B]) or per token ([B, T]), that the engine slices, pads and moves with each
micro-batch without reading them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlpipe.checkpoint import load_tensors, single_process_dcp
from rlpipe.config import KernelsConfig
from rlpipe.device import backend, step_boundary
from rlpipe.kernels import linear_logprob, logits_logprob
from rlpipe.models import load_model, read_hf_config, save_state_dict
from rlpipe.packing import pack, pack_static, packed_length, packed_static_token_logprobs
from rlpipe.parallel.graph_trainer import GraphTrainStep, bucket_length
from rlpipe.parallel.strategy import choose_strategy
from rlpipe.types import ModelOutputs, TrainBatch
from rlpipe.weightsync.probe import DecodedProbe


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


class TrainEngine:
    """One rank of the learner: `model`, `learner` and `train` are those config sections; `loss` the objective run
    on every micro-batch; `total_steps` the optimizer steps the schedule spans; `step_rows` the rows of the largest
    mini-batch; `temperature` the one the rollout engine sampled at (its log-probs are taken after it). Ranks of a
    group of several call `join_group` together before training; a single process finishes its set-up itself."""

    def __init__(
        self, model_path: str, model, learner, train, *, loss, total_steps: int, step_rows: int | None = None,
        temperature: float = 1.0, rank: int = 0, world_size: int = 1,
    ):
        self.model_path, self.model_section, self.learner, self.train = model_path, model, learner, train
        self.loss = loss
        self.total_steps = total_steps
        # With static shapes every optimizer step runs as many micro-batch passes as its largest mini-batch
        # (`step_rows` rows) needs, so a smaller one (uniform groups dropped) pads with empty passes instead of
        # compiling a graph of its own.
        self.static_passes = (
            math.ceil(math.ceil(step_rows / world_size) / train.micro_batch_size) if step_rows else None
        )
        self.temperature = temperature
        self.rank, self.world_size = rank, world_size
        self.kernels = model.kernels
        self.dtype = getattr(torch, model.dtype)
        self.hf_config = read_hf_config(model_path)
        self.strategy = choose_strategy(learner, self.dtype, rank, world_size)  # before any model tensor exists
        self.device = self.strategy.device
        self.model = self._load()
        self.model.model.activation_checkpointing = learner.activation_checkpointing
        self.moe_layers = self.model.config.moe_layers
        self.frozen: list = []
        self.step_fn: GraphTrainStep | None = None
        self.optimizer_steps_taken = 0
        self.policy_version = 0
        # Static shapes (a compiled or lazily traced step) keep every row of a batch and pad rows and columns.
        self.static_shapes = learner.graph or self.device.type == "xla"

    def _load(self):
        model = load_model(self.model_path, dtype=self.dtype)
        kernels = self.kernels
        return model.use_kernels(rmsnorm=kernels.rmsnorm, attention=kernels.attention, experts=kernels.experts).to(
            self.device
        )

    def frozen_copy(self):
        """Another copy of the starting model, sharded like the policy and never trained (e.g. a KL reference)."""
        if self.step_fn is not None:
            raise RuntimeError("frozen copies are made before the engine joins its group")
        copy = self._load().eval().requires_grad_(False)
        self.frozen.append(copy)
        return copy

    def join_group(self, master_addr: str = "127.0.0.1", master_port: int | None = None) -> None:
        """Form the process group (if the strategy has one), shard the models and build the step; every rank calls
        it at the same time. Without a group it only finishes the set-up."""
        if self.step_fn is not None:
            return
        if self.strategy.needs_group:
            from rlpipe.parallel.mesh import find_free_port

            self.strategy.join(master_addr, master_port if master_port is not None else find_free_port(master_addr))
        for model in (self.model, *self.frozen):
            self.strategy.shard(model)
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
            backend=backend(self.learner.device).compile_backend,
            buckets=max(self.learner.length_buckets, self.learner.packed_buckets or [], key=len),
        )
        optimizer = self.step_fn.optimizer
        self.strategy.shard_state([*optimizer.exp_avg, *optimizer.exp_avg_sq])

    def ready(self) -> GraphTrainStep:
        """The step, finishing the set-up first where no group is needed (one process: it joins a group of one)."""
        if self.step_fn is None:
            if self.world_size > 1:
                raise RuntimeError("a learner of several ranks must join its group first (join_group on every rank)")
            self.join_group()
        return self.step_fn

    # ------------------------------------------------------------------ forward

    def _packing(self, lengths: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The arguments of `token_logprobs` that make a forward run packed (learner.packing; not on xla, where every
        new packed width would compile anew), with the prompts' lengths where a group's prompt can run once
        (learner.share_prompts); none for padded rows."""
        if not self.learner.packing or self.device.type == "xla":
            return {}
        if not self.learner.share_prompts or self.moe_layers or self.kernels.attention != "torch":
            # MoE: router statistics and the balance loss count tokens as run, which must not depend on sharing.
            return {"lengths": lengths}
        # A row's prompt ends where its trained tokens start; a row without any keeps to itself.
        prompt_lengths = torch.where(mask.any(dim=1), mask.int().argmax(dim=1), lengths)
        return {"lengths": lengths, "prompt_lengths": prompt_lengths}

    def _micro_loss(self, model, micro: dict[str, torch.Tensor]):
        """Model outputs of one micro-batch, then the objective's loss and statistics (pure tensor code, so the same
        function runs eagerly and traced into the compiled step)."""
        mask = micro["mask"]
        router_logits = [] if self.moe_layers else None
        layout = micro.get("layout")
        if layout is not None:  # packed with static shapes (the compiled step)
            logprobs, entropy = packed_static_token_logprobs(
                model, layout, micro["input_ids"], mask, self.temperature, with_entropy=True, kernels=self.kernels,
                router_logits=router_logits,
            )
        else:
            logprobs, entropy = token_logprobs(
                model, micro["input_ids"], self.temperature, with_entropy=True, kernels=self.kernels,
                lengths=micro.get("lengths"), prompt_lengths=micro.get("prompt_lengths"), scored=mask,
                router_logits=router_logits,
            )
        outputs = ModelOutputs(logprobs, entropy)
        if router_logits:
            lengths = micro.get("lengths")
            if layout is not None:
                outputs.router_mask = layout.packed_mask(mask)
            elif lengths is not None:  # packed: the router saw the real tokens of each row, back to back
                columns = torch.arange(mask.shape[1], device=mask.device)
                outputs.router_mask = mask[columns < lengths[:, None].to(mask.device)]
            else:
                outputs.router_mask = mask.reshape(-1)
            outputs.router_logits = router_logits
        return self.loss(outputs, micro)

    def _rank_micro_batches(self, first: int, last: int) -> list[tuple[int, int, bool]]:
        """This rank's micro-batches of rows [first, last) as (start, stop, real).

        Ranks take contiguous shares. Every rank runs the same number of forward passes, because each pass gathers
        parameters collectively; a rank whose share runs out runs a masked-out `real=False` pass.
        """
        shares = torch.arange(first, last).tensor_split(self.world_size)
        micro = self.train.micro_batch_size
        passes = max(math.ceil(len(share) / micro) for share in shares)
        mine = shares[self.rank].tolist()
        out = []
        for index in range(passes):
            rows = mine[index * micro : (index + 1) * micro]
            out.append((rows[0], rows[-1] + 1, True) if rows else (first, first + 1, False))
        return out

    def _micro_batch(self, batch: TrainBatch, fields: dict, part, width: int | None = None) -> dict:
        """The tensors of one micro-batch: ids, the trained-token `mask` and every field, cut to `width` columns
        (default: the micro-batch's longest row), with the packing arguments of an eager forward. A padding pass
        (`real` False) keeps its tokens but has an all-False mask, so it adds nothing."""
        start, stop, real = part
        span = slice(start, stop)
        width = width or int(batch.lengths[span].max())
        mask = batch.completion_mask[span] if real else torch.zeros_like(batch.completion_mask[span])
        micro = {"input_ids": _fit(batch.input_ids[span], width), "mask": _fit(mask, width)}
        for name, value in fields.items():
            micro[name] = _fit(value[span], width) if value.dim() == 2 else value[span]
        micro.update(self._packing(batch.lengths[span], micro["mask"]))
        return micro

    def _static_micro_batches(self, batch: TrainBatch, fields: dict, parts) -> list[dict]:
        """Micro-batches of static shapes, so a graph compiles once per length bucket and not per batch: rows padded
        to micro_batch_size and columns to the bucket of the mini-batch's longest row (every rank sees the whole
        mini-batch). Packed (learner.packing, torch attention), each micro-batch runs as one row, padded for the
        whole step to the smallest of learner.packed_buckets that holds the longest, with its layout as tensors
        only; the rows' columns are padded to that width too, so it alone decides the graph's shapes."""
        buckets, rows = self.learner.length_buckets, self.train.micro_batch_size
        width = bucket_length(int(batch.lengths.max()), buckets)
        micro_batches = [self._micro_batch(batch, fields, part, width) for part in parts]
        packing = [{key: micro.pop(key) for key in ("lengths", "prompt_lengths") if key in micro} for micro in micro_batches]
        packed = all(packing) and self.kernels.attention == "torch"  # the Pallas kernel takes no arbitrary mask
        if packed:
            longest = max(
                packed_length(micro["input_ids"], args["lengths"], args.get("prompt_lengths"))
                for micro, args in zip(micro_batches, packing)
            )
            width = bucket_length(longest, self.learner.packed_buckets or [rows * bucket for bucket in buckets])
        out = []
        for micro, args in zip(micro_batches, packing):
            micro = {key: _pad_rows(_fit(value, width) if value.dim() == 2 else value, rows) for key, value in micro.items()}
            if packed:
                prompts = args.get("prompt_lengths")
                micro["layout"] = pack_static(
                    micro["input_ids"], _pad_rows(args["lengths"], rows), None if prompts is None else _pad_rows(prompts, rows),
                    width,
                )
            out.append(micro)
        return out

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, model=None) -> torch.Tensor:
        """Log-probs of this rank's rows of `batch` under `model` (default: the policy), [B, T] on the CPU; other
        rows stay 0."""
        model = model if model is not None else self.model
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for start, stop, real in self._rank_micro_batches(0, len(batch)):
            part = batch.slice(start, stop)
            rows, width = part.input_ids.shape
            ids = part.input_ids
            packing = self._packing(part.lengths, part.completion_mask)
            if self.device.type == "xla":
                # Static shapes, as in the train step: each bucket compiles once instead of every new width.
                bucket = bucket_length(width, self.learner.length_buckets)
                ids = _pad_rows(_fit(ids, bucket), self.train.micro_batch_size)
            values = token_logprobs(
                model, ids.to(self.device), self.temperature, kernels=self.kernels, **packing,
                scored=part.completion_mask,
            )
            if real:
                out[start:stop, :width] = values[:rows, :width].cpu()
        return out

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs of a fixed sequence at temperature 1, the probe that weight sync is checked against."""
        with torch.no_grad():
            ids = torch.tensor([token_ids], device=self.device)
            return token_logprobs(self.model, ids, kernels=self.kernels)[0].tolist()

    def decoded_probe(self, token_ids: list[int], count: int) -> DecodedProbe:
        """`count` tokens decoded greedily after `token_ids`, for engines that cannot replay a sequence
        (rlpipe/weightsync/probe.py); the log-probs come from `sequence_logprobs`, as a replayed probe's do."""
        tokens = list(token_ids)
        with torch.no_grad():
            for _ in range(count):
                ids = torch.tensor([tokens], device=self.device)
                if hasattr(self.model, "output_embedding"):
                    logits = F.linear(self.model.hidden_states(ids)[0, -1], self.model.output_embedding())
                else:
                    logits = self.model(ids)[0, -1]
                tokens.append(int(logits.argmax()))
        logprobs = self.sequence_logprobs(tokens)
        return DecodedProbe(tokens[len(token_ids):], logprobs[len(token_ids):], logprobs[: len(token_ids)])

    # ------------------------------------------------------------------ the update

    def lr_factor(self, step: int) -> float:
        """Multiplier of train.lr at optimizer step `step` (the step count is the schedule's only state, which is
        what a checkpoint keeps)."""
        train = self.train
        return lr_factor(step, train.warmup_steps, self.total_steps, train.lr_schedule, train.min_lr_ratio)

    def optimizer_step(self, rows: TrainBatch | None, fields: dict[str, torch.Tensor], totals: dict) -> dict[str, float]:
        """One optimizer step over the mini-batch `rows` (this rank takes its share, micro-batch by micro-batch):
        gradients accumulated over micro-batches, clipped by their global norm, AdamW. `fields` are the objective's
        extra per-row/per-token tensors for those rows; `totals` its mini-batch-wide scalars. `rows` None steps on
        zero gradients (momentum and weight decay still act). Returns this rank's sums of the objective's stats, the
        loss, grad_norm, lr and counts."""
        self.ready()
        lr = self.train.lr * self.lr_factor(self.optimizer_steps_taken)
        parts = self._rank_micro_batches(0, len(rows)) if rows is not None else []
        if self.static_shapes and parts:
            parts += [(0, 1, False)] * ((self.static_passes or 0) - len(parts))
            micro_batches = self._static_micro_batches(rows, fields, parts)
        else:
            micro_batches = [self._micro_batch(rows, fields, part) for part in parts]
        micro_batches = [self.strategy.place({**micro, **totals}) for micro in micro_batches]
        out = self.step_fn.step(micro_batches, lr=lr)
        counts = {name: out.pop(name) for name in ("compiles", "graph_breaks")}
        if self.static_shapes:
            out.update(counts)
        self.optimizer_steps_taken += 1
        out["lr"] = lr
        out["optimizer_steps"] = 1.0
        out["samples_run"] = float(len(rows)) if rows is not None else 0.0
        return out

    # ------------------------------------------------------------------ weights, checkpoints, export

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors under Hugging Face names, on the CPU (a collective when sharded: every rank calls it)."""
        return self.strategy.full_state_dict(self.model)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's full shape under its Hugging Face name, in state-dict order. No communication."""
        return {name: tuple(value.shape) for name, value in self.model.state_dict().items()}

    def local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every weight (the whole tensor when unsharded), as weight sync reads them: no
        gather. Rows follow `rlpipe.weightsync.shard_rows`."""
        return self.strategy.local_weights(self.model)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Everything a resumed engine needs, as tensors under stable names: the weights (`model.<HF name>`), AdamW's
        moments (`optim.<HF name>.exp_avg` / `.exp_avg_sq`), its step count and the policy version. Sharded engines
        hold DTensor shards here, so torch.distributed.checkpoint writes each rank's own rows and loading into
        another layout reshards (any number of ranks)."""
        self.ready()
        state = {f"model.{name}": value for name, value in self.model.state_dict().items()}
        optimizer = self.step_fn.optimizer
        moments = {id(p): (m, v) for p, m, v in zip(self.step_fn.params, optimizer.exp_avg, optimizer.exp_avg_sq)}
        for name, param in self.model.named_parameters():
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

    def export(self, out_dir: str) -> str:
        """The policy as a Hugging Face folder (rank 0 writes; every rank calls it, the gather is collective)."""
        state = self.full_state_dict()
        if self.rank == 0:
            save_state_dict(state, self.hf_config, out_dir, source_dir=self.model_section.tokenizer or self.model_path)
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


def accumulate(sums: dict[str, float], values: dict[str, float]) -> None:
    """Add into running sums; keys ending in `_max` keep the maximum."""
    for key, value in values.items():
        sums[key] = max(sums.get(key, value), value) if key.endswith("_max") else sums.get(key, 0.0) + value
