"""How the learner's rows run through the model: one forward variant per layout, chosen once (`choose_forward`).

- `PaddedForward`: right-padded rows, each micro-batch as wide as its longest row (eager shapes).
- `PackedForward`: a micro-batch's real tokens back to back in one row (rlpipe/models/packing.py `pack`), a GRPO group's
  shared prompt once (learner.share_prompts), so no padding token is computed (eager shapes).
- `StaticPaddedForward`, `StaticPackedForward`: the same with static shapes, for a captured step (learner.graph) or
  a lazy device (xla, where packing is off): rows padded to train.micro_batch_size, columns to a length bucket (the
  packed row to a packed bucket, its layout as tensors), and empty passes up to the step's largest pass count, so
  the step compiles once per bucket rather than per batch. Every rank holds the whole mini-batch, so each takes
  these shapes from every rank's micro-batches: all ranks run the same program, whose collectives then match.

A variant builds a mini-batch's micro-batches (`MicroBatch`, typed: ids, the objective's `LossInputs` and the
variant's own layout) and runs one through the model to `ModelOutputs`: each token's log-prob and entropy, and for a
mixture-of-experts model the router logits over the tokens as run with the mask of the trained ones among them
(the router mask, whose rule is the variant's). Forward-only passes (old and reference log-probs) take their rows
through `logprobs`. `token_logprobs` is the same computation for callers outside the step (the weight-sync probe,
tests, benchmarks).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from rlpipe.config import KernelsConfig
from rlpipe.kernels import linear_logprob
from rlpipe.models.packing import (
    PackedLayout,
    bucket_length,
    pack_static,
    packed_length,
    packed_static_token_logprobs,
    packed_token_logprobs,
)
from rlpipe.types import LossInputs, MicroBatch, ModelOutputs, TrainBatch

# A micro-batch's rows [start, stop) of the mini-batch, and whether it is real: a padding pass (False) runs so that
# every rank (or every static step) runs the same passes, with nothing trained.
RowPass = tuple[int, int, bool]
EMPTY_PASS: RowPass = (0, 1, False)


class Forward(Protocol):
    def micro_batches(
        self, rows: TrainBatch, inputs: LossInputs, shares: list[list[RowPass]], rank: int
    ) -> list[MicroBatch]:
        """The micro-batches of rank `rank`'s parts `shares[rank]` of the mini-batch `rows` ([B, T] and [B] tensors
        on the host), whose objective inputs are `inputs`. `shares` holds every rank's parts, so that a variant with
        static shapes takes them from the whole step and every rank compiles the same program."""

    def __call__(self, model, micro: MicroBatch) -> ModelOutputs:
        """The model's outputs for one placed micro-batch (pure tensor code: it runs eagerly and traced)."""


class PaddedForward:
    """Right-padded rows; each micro-batch is cut to its longest row."""

    def __init__(self, temperature: float, kernels: KernelsConfig):
        self.temperature, self.kernels = temperature, kernels

    def micro_batches(
        self, rows: TrainBatch, inputs: LossInputs, shares: list[list[RowPass]], rank: int
    ) -> list[MicroBatch]:
        return [_cut(rows, inputs, part) for part in shares[rank]]

    def __call__(self, model, micro: MicroBatch) -> ModelOutputs:
        router_logits: list[Tensor] = []
        logprobs, entropy = padded_token_logprobs(
            model, micro.input_ids, self.temperature, with_entropy=True, kernels=self.kernels,
            router_logits=router_logits,
        )
        # The router saw every position of the padded rows, row by row.
        return ModelOutputs(logprobs, entropy, router_logits, micro.loss_inputs.mask.reshape(-1))

    def logprobs(self, model, rows: TrainBatch, device: torch.device) -> Tensor:
        """Log-probs [B, T] of the rows (at least their shape; rows and columns beyond it are padding)."""
        return padded_token_logprobs(model, rows.input_ids.to(device), self.temperature, kernels=self.kernels)


class PackedForward:
    """A micro-batch's rows as one row of their real tokens; with `share_prompts`, consecutive rows whose prompts
    are the same tokens run the prompt once."""

    def __init__(self, temperature: float, kernels: KernelsConfig, share_prompts: bool):
        self.temperature, self.kernels, self.share_prompts = temperature, kernels, share_prompts

    def micro_batch(self, rows: TrainBatch, inputs: LossInputs, part: RowPass, width: int | None = None) -> MicroBatch:
        micro = _cut(rows, inputs, part, width)
        micro.lengths = rows.lengths[part[0] : part[1]]
        micro.prompt_lengths = self._prompt_lengths(micro.lengths, micro.loss_inputs.mask)
        return micro

    def micro_batches(
        self, rows: TrainBatch, inputs: LossInputs, shares: list[list[RowPass]], rank: int
    ) -> list[MicroBatch]:
        return [self.micro_batch(rows, inputs, part) for part in shares[rank]]

    def _prompt_lengths(self, lengths: Tensor, mask: Tensor) -> Tensor | None:
        if not self.share_prompts:
            return None
        # A row's prompt ends where its trained tokens start; a row without any keeps to itself.
        return torch.where(mask.any(dim=1), mask.int().argmax(dim=1), lengths)

    def __call__(self, model, micro: MicroBatch) -> ModelOutputs:
        mask = micro.loss_inputs.mask
        # The router sees the real tokens of each row, back to back. Taken before the forward is queued: the
        # selection waits for its count on the host.
        columns = torch.arange(mask.shape[1], device=mask.device)
        router_mask = mask[columns < micro.lengths[:, None].to(mask.device)]
        router_logits: list[Tensor] = []
        logprobs, entropy = packed_token_logprobs(
            model, micro.input_ids, micro.lengths, micro.prompt_lengths, mask, self.temperature, with_entropy=True,
            kernels=self.kernels, router_logits=router_logits,
        )
        return ModelOutputs(logprobs, entropy, router_logits, router_mask)

    def logprobs(self, model, rows: TrainBatch, device: torch.device) -> Tensor:
        """Log-probs [B, T] of the rows' completion tokens (0 elsewhere)."""
        mask = rows.completion_mask
        return packed_token_logprobs(
            model, rows.input_ids.to(device), rows.lengths, self._prompt_lengths(rows.lengths, mask), mask,
            self.temperature, kernels=self.kernels,
        )


class StaticPaddedForward(PaddedForward):
    """Padded rows with static shapes: `micro_batch_size` rows, as many columns as the bucket of `buckets` that
    holds the mini-batch's longest row, and `passes` micro-batches a step (padding passes added)."""

    def __init__(
        self, temperature: float, kernels: KernelsConfig, buckets: list[int], micro_batch_size: int, passes: int
    ):
        super().__init__(temperature, kernels)
        self.buckets, self.micro_batch_size, self.passes = buckets, micro_batch_size, passes

    def micro_batches(
        self, rows: TrainBatch, inputs: LossInputs, shares: list[list[RowPass]], rank: int
    ) -> list[MicroBatch]:
        if not shares[rank]:
            return []
        # The mini-batch's longest row and the pass count are the same on every rank: one program for all.
        width = bucket_length(int(rows.lengths.max()), self.buckets)
        parts = _with_empty_passes(shares[rank], self.passes)
        return [_padded_to(_cut(rows, inputs, part, width), self.micro_batch_size, width) for part in parts]

    def logprobs(self, model, rows: TrainBatch, device: torch.device) -> Tensor:
        # Static shapes here too (a lazy device): each bucket compiles once instead of every new width.
        width = bucket_length(rows.input_ids.shape[1], self.buckets)
        ids = _pad_rows(_fit(rows.input_ids, width), self.micro_batch_size)
        return padded_token_logprobs(model, ids.to(device), self.temperature, kernels=self.kernels)


class StaticPackedForward:
    """Packed rows with static shapes: each micro-batch's rows (cut to the bucket of `buckets` that holds the
    mini-batch's longest row) packed as `packed` packs them, into one row padded for the whole step to the
    smallest of `packed_buckets` that holds the longest packed micro-batch of any rank, with its layout as tensors
    only (`PackedLayout`); the rows' columns are padded to that width too, so it alone decides the graph's shapes.
    `micro_batch_size` rows a pass, `passes` passes a step (padding passes added)."""

    def __init__(
        self, packed: PackedForward, buckets: list[int], packed_buckets: list[int], micro_batch_size: int, passes: int
    ):
        self.packed, self.buckets, self.packed_buckets = packed, buckets, packed_buckets
        self.micro_batch_size, self.passes = micro_batch_size, passes

    def micro_batches(
        self, rows: TrainBatch, inputs: LossInputs, shares: list[list[RowPass]], rank: int
    ) -> list[MicroBatch]:
        if not shares[rank]:
            return []
        width = bucket_length(int(rows.lengths.max()), self.buckets)
        # The packed width shapes the step's program, and TorchTPU compiles the collectives into it without checking
        # that every rank compiled the same one (rlpipe/hardware/tpu_env.py): so it is the bucket of the longest packed
        # micro-batch of any rank, read by each rank from the mini-batch it holds, with no collective to agree on it.
        every_rank = [_with_empty_passes(parts, self.passes) for parts in shares]
        longest = max(self._packed_length(rows, inputs, part) for parts in every_rank for part in parts)
        packed_width = bucket_length(longest, self.packed_buckets)
        micro_batches = [self.packed.micro_batch(rows, inputs, part, width) for part in every_rank[rank]]
        return [self._laid_out(micro, packed_width) for micro in micro_batches]

    def _packed_length(self, rows: TrainBatch, inputs: LossInputs, part: RowPass) -> int:
        micro = self.packed.micro_batch(rows, inputs, part)
        return packed_length(micro.input_ids, micro.lengths, micro.prompt_lengths)

    def _laid_out(self, micro: MicroBatch, width: int) -> MicroBatch:
        rows = self.micro_batch_size
        padded = _padded_to(micro, rows, width)
        prompts = None if micro.prompt_lengths is None else _pad_rows(micro.prompt_lengths, rows)
        padded.layout = pack_static(padded.input_ids, _pad_rows(micro.lengths, rows), prompts, width)
        return padded

    def __call__(self, model, micro: MicroBatch) -> ModelOutputs:
        mask, router_logits = micro.loss_inputs.mask, []
        logprobs, entropy = packed_static_token_logprobs(
            model, micro.layout, micro.input_ids, mask, self.packed.temperature, with_entropy=True,
            kernels=self.packed.kernels, router_logits=router_logits,
        )
        # The router saw the packed row, padding included; shared prompt tokens once.
        return ModelOutputs(logprobs, entropy, router_logits, micro.layout.packed_mask(mask))


def choose_forward(
    learner, kernels: KernelsConfig, *, temperature: float, moe: bool, lazy: bool, micro_batch_size: int, passes: int,
    own_model: bool = True,
) -> tuple[Forward, PaddedForward | PackedForward]:
    """The train step's forward variant for a `learner` config section, the model's `kernels` and whether it is a
    mixture of experts, on a device that records ops (`lazy`) or not; and the variant of the forward-only passes,
    which compile nothing and so keep eager shapes, except on a lazy device. `passes`: micro-batches of a static
    step (its largest mini-batch's). `own_model`: rlpipe's decoder, not a model transformers runs."""
    # On a lazy device every new packed width would compile a program of its own.
    packs = learner.packing and not lazy
    # MoE: router statistics and the balance loss count tokens as run, which must not depend on sharing; the Pallas
    # attention kernel takes segment ids, one sequence per document, not a shared prompt's mask; transformers' masks
    # come from position ids, which cannot say that several sequences read one prompt.
    share_prompts = learner.share_prompts and not moe and kernels.attention == "torch" and own_model
    eager = PackedForward(temperature, kernels, share_prompts) if packs else PaddedForward(temperature, kernels)
    if not (learner.graph or lazy):
        return eager, eager
    buckets = learner.length_buckets
    if packs:
        packed_buckets = learner.packed_buckets or [micro_batch_size * bucket for bucket in buckets]
        return StaticPackedForward(eager, buckets, packed_buckets, micro_batch_size, passes), eager
    static = StaticPaddedForward(temperature, kernels, buckets, micro_batch_size, passes)
    return static, static if lazy else eager


# ------------------------------------------------------------------ log-probs


def padded_token_logprobs(
    model,
    input_ids: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    kernels: KernelsConfig | None = None,
    router_logits: list[Tensor] | None = None,
):
    """Log-prob of each token of the right-padded rows input_ids [B, T] given the ones before it, aligned with
    input_ids (position 0 gets 0), from an rlpipe model through its output projection with `kernels.logprob` (by
    default in vocabulary chunks, so [tokens x vocab] logits never exist). With `with_entropy`, also the policy's
    entropy at each position (with its gradient where the kernel has one: the entropy bonus trains on it). A
    `router_logits` list receives a mixture-of-experts model's router logits, one [B * T, experts] tensor per MoE
    layer."""
    kernels = kernels or KernelsConfig()
    targets = input_ids[:, 1:]
    hidden = model.hidden_states(input_ids, router_logits=router_logits)[:, :-1]
    picked, entropy = linear_logprob(
        hidden.reshape(-1, hidden.shape[-1]),
        model.output_embedding(),
        targets.reshape(-1),
        temperature,
        impl=kernels.logprob,
        chunk=kernels.logprob_chunk,
    )
    picked = F.pad(picked.view(targets.shape), (1, 0))
    if not with_entropy:
        return picked
    return picked, F.pad(entropy.view(targets.shape), (1, 0))


def token_logprobs(
    model,
    input_ids: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    kernels: KernelsConfig | None = None,
    lengths: Tensor | None = None,
    scored: Tensor | None = None,
    router_logits: list[Tensor] | None = None,
    prompt_lengths: Tensor | None = None,
):
    """Log-prob of each token of an rlpipe model's rows given the ones before it: padded, or with `lengths` (real
    tokens per row) packed into one row, `scored` limiting the output projection to the tokens whose log-prob is
    used and `prompt_lengths` letting a group's rows run their prompt once (`packed_token_logprobs`)."""
    if lengths is None:
        return padded_token_logprobs(model, input_ids, temperature, with_entropy, kernels, router_logits)
    return packed_token_logprobs(
        model, input_ids, lengths, prompt_lengths, scored, temperature, with_entropy, kernels, router_logits
    )


# ------------------------------------------------------------------ cutting and padding rows


def _cut(rows: TrainBatch, inputs: LossInputs, part: RowPass, width: int | None = None) -> MicroBatch:
    """Rows [start, stop) and their objective inputs, cut or zero-padded to `width` columns (default: their longest
    row). A padding pass keeps its tokens but has an all-False mask, so it adds nothing."""
    start, stop, real = part
    span = slice(start, stop)
    width = width or int(rows.lengths[span].max())
    loss_inputs = inputs.map_rows(lambda value: _fit(value[span], width) if value.dim() == 2 else value[span])
    if not real:
        loss_inputs.mask = torch.zeros_like(loss_inputs.mask)
    return MicroBatch(_fit(rows.input_ids[span], width), loss_inputs)


def _padded_to(micro: MicroBatch, rows: int, width: int) -> MicroBatch:
    """A micro-batch's ids and objective inputs with `rows` rows and `width` columns (static shapes)."""

    def padded(value: Tensor) -> Tensor:
        return _pad_rows(_fit(value, width) if value.dim() == 2 else value, rows)

    return MicroBatch(padded(micro.input_ids), micro.loss_inputs.map_rows(padded))


def _with_empty_passes(parts: list[RowPass], passes: int) -> list[RowPass]:
    return parts + [EMPTY_PASS] * (passes - len(parts))


def _fit(tensor: Tensor, width: int) -> Tensor:
    """Cut or zero-pad the last dimension of a [B, T] tensor to `width`."""
    if tensor.shape[1] >= width:
        return tensor[:, :width]
    return F.pad(tensor, (0, width - tensor.shape[1]))


def _pad_rows(tensor: Tensor, rows: int) -> Tensor:
    """Pad the first dimension with zeros (masked-out rows) up to `rows`."""
    missing = rows - tensor.shape[0]
    if missing <= 0:
        return tensor
    return torch.cat([tensor, torch.zeros((missing, *tensor.shape[1:]), dtype=tensor.dtype)])
