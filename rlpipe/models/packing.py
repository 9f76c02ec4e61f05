"""Sequence packing: the real tokens of right-padded rows [B, T] as one row, a GRPO group's common prompt once.

One set of rules (`_blocks`), two forms of the result, each with the learner's log-prob pass on it:
- `pack`: exactly the real tokens, the attention layout as python `Segments`; for eager forwards, where every
  batch may have shapes and a structure of its own (`packed_token_logprobs`).
- `pack_static`: the same row padded to a chosen width, the layout as tensors only (`PackedLayout`), so a graph
  captured with static shapes (torch.compile fullgraph, dynamic=False) is specialised on (rows, T, width) alone and
  serves every batch of that shape whatever its lengths and groups; with widths taken from a few length buckets,
  the compiles stay at the number of buckets (`packed_static_token_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from rlpipe.config import KernelsConfig
from rlpipe.kernels import linear_logprob


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length` tokens."""
    fitting = [bucket for bucket in buckets if bucket >= length]
    if not fitting:
        raise ValueError(
            f"sequence length {length} is longer than the largest bucket ({max(buckets)}); buckets: {sorted(buckets)}"
        )
    return min(fitting)


# A packed row's padding tokens form a document of their own, which no real token's document id (>= 0) equals.
PADDING_DOCUMENT = -1


def _blocks(rows: list[list[int]], lengths: list[int], prompt_lengths: list[int] | None) -> list[tuple[int, int, int]]:
    """The packed row's blocks in row order, as (first row, last row + 1, prompt length): consecutive rows whose
    prompts are the same tokens share a block (without `prompt_lengths` every row is a block of its own, all of it
    the block's prompt). A prompt is at least one token and at most the row."""
    # A row of length 0 (padding to a fixed row count) packs to nothing.
    prompts = lengths if prompt_lengths is None else [min(max(1, p), n) for p, n in zip(prompt_lengths, lengths)]
    blocks = []
    first = 0
    while first < len(rows):
        prompt = prompts[first]
        last = first + 1
        while last < len(rows) and prompts[last] == prompt and rows[last][:prompt] == rows[first][:prompt]:
            last += 1
        blocks.append((first, last, prompt))
        first = last
    return blocks


def pack(input_ids: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor | None = None):
    """Right-padded rows [B, T] as one row of their real tokens: ids [1, N], position ids [1, N] (each token's
    position in its own sequence), the row's `Segments` (rlpipe/models/llama.py) and `where` [B, T], each real
    token's index in the packed row (-1 at padding); all on the CPU.

    With `prompt_lengths`, consecutive rows whose prompts are the same tokens (a GRPO group) share one copy: the
    prompt runs once and each row's completion follows it, attending to it — the values a row would get alone,
    with the prompt's tokens computed once per group instead of once per sample."""
    rows, lengths = input_ids.tolist(), lengths.tolist()
    ids, positions, segments = [], [], []
    where = torch.full(input_ids.shape, -1, dtype=torch.long)
    for first, last, prompt in _blocks(rows, lengths, None if prompt_lengths is None else prompt_lengths.tolist()):
        block = [prompt]
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
    return torch.tensor([ids]), torch.tensor([positions]), tuple(segments), where


def packed_token_logprobs(
    model,
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    prompt_lengths: torch.Tensor | None = None,
    scored: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    kernels: KernelsConfig | None = None,
    router_logits: list[torch.Tensor] | None = None,
):
    """Log-prob of each token of the right-padded rows input_ids [B, T] given the ones before it (and with
    `with_entropy` the policy's entropy there, as `padded_token_logprobs` gives it), computed by an rlpipe model on
    the rows packed into one (`pack`), so no padding token is computed: 0 at the first token of each row, at padding,
    and where `scored` ([B, T] bool, e.g. the completion mask) is False; only the scored tokens go through the output
    projection. With
    `prompt_lengths`, rows with the same prompt run it once (see `pack`). A `router_logits` list receives a
    mixture-of-experts model's router logits, one [tokens, experts] tensor per MoE layer, over the real tokens in
    row order."""
    kernels = kernels or KernelsConfig()
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
        index = (rows.to(values.device), columns.to(values.device))
        placed = values.new_zeros(input_ids.shape).index_put(index, values)
        return torch.where(wanted, placed, 0.0)

    return (unpacked(picked), unpacked(entropy)) if with_entropy else unpacked(picked)


def packed_length(input_ids: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor | None = None) -> int:
    """The number of tokens `pack` lays out for these rows (each shared prompt counted once): what a caller of
    `pack_static` rounds up to a bucket to choose the width."""
    rows, lengths = input_ids.tolist(), lengths.tolist()
    blocks = _blocks(rows, lengths, None if prompt_lengths is None else prompt_lengths.tolist())
    continuations = (max(0, lengths[row] - prompt) for first, last, prompt in blocks for row in range(first, last))
    return sum(prompt for _, _, prompt in blocks) + sum(continuations)


@dataclass
class PackedLayout:
    """A packed row padded to a fixed width W, for rows [B, T]; tensors only, so a captured graph depends on its
    shapes, never on the batch's structure. `hidden_states(input_ids, position_ids, layout)` of an rlpipe model
    runs it (rlpipe/models/llama.py), attending as `document` and `sequence` say:
    token i may attend token j iff document[i] == document[j], j <= i, and sequence[j] in (0, sequence[i]).
    Packed without prompt lengths, every document is one sequence (sequence 0 throughout), so `document` alone says
    it, which is all a segment-id attention kernel takes."""

    input_ids: torch.Tensor  # [1, W]: the packed tokens, then padding (token 0)
    position_ids: torch.Tensor  # [1, W]: each token's position in its own sequence (0 at padding); drives RoPE
    document: torch.Tensor  # [W]: the block (shared prompt and its continuations) of each token; PADDING_DOCUMENT
    sequence: torch.Tensor  # [W]: 0 on a block's prompt (and on padding), k on its k-th continuation
    token_index: torch.Tensor  # [B, T]: the packed index of each real token of the rows, -1 at padding
    source: torch.Tensor  # [W]: the packed index of the token before each packed token in its own sequence (the
    # hidden state that predicts it); 0 where there is none (a sequence's first token, padding), a valid index all
    # the same so the gather needs no mask. A shared prompt token has one predecessor whichever row reads it.

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def predicted(self) -> torch.Tensor:
        """[B, T] bool: the real tokens with a token before them, the ones whose log-prob the packed row gives."""
        return _predicted(self.token_index)

    def packed_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """[W] bool: the packed positions holding a real token that `mask` ([B, T] bool) marks, e.g. the completion
        tokens among the W positions a mixture-of-experts layer's router logits cover. A shared prompt token is
        marked when any of its rows marks it."""
        marked = (mask.to(self.token_index.device) & (self.token_index >= 0)).int()
        index = torch.where(self.token_index >= 0, self.token_index, 0)
        counts = torch.zeros(self.width, dtype=torch.int32, device=index.device)
        return counts.index_add(0, index.reshape(-1), marked.reshape(-1)) > 0

    def to(self, device: torch.device | str) -> PackedLayout:
        return PackedLayout(**{field.name: getattr(self, field.name).to(device) for field in fields(self)})


def _predicted(token_index: torch.Tensor) -> torch.Tensor:
    columns = torch.arange(token_index.shape[1], device=token_index.device)
    return (token_index >= 0) & (columns >= 1)


def pack_static(
    input_ids: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor | None, width: int
) -> PackedLayout:
    """`pack`'s row (the same tokens in the same order) padded to `width` tokens, as a `PackedLayout` on
    input_ids' device. Runs on the host. The caller picks the width, typically
    `bucket_length(packed_length(input_ids, lengths, prompt_lengths), buckets)`."""
    ids, positions, segments, where = pack(input_ids, lengths, prompt_lengths)
    used = ids.shape[1]
    if used > width:
        raise ValueError(
            f"the packed row has {used} tokens, more than its width {width}; choose a width of at least "
            f"packed_length(...) = {used}, e.g. bucket_length({used}, buckets)"
        )
    document = torch.full((width,), PADDING_DOCUMENT, dtype=torch.long)
    sequence = torch.zeros(width, dtype=torch.long)
    start = 0
    for block, (prompt, *continuations) in enumerate(segments):
        document[start : start + prompt + sum(continuations)] = block
        start += prompt
        for number, length in enumerate(continuations, start=1):
            sequence[start : start + length] = number
            start += length
    source = torch.zeros(width, dtype=torch.long)
    predicted = _predicted(where)
    source[where[predicted]] = torch.nn.functional.pad(where[:, :-1], (1, 0))[predicted]
    layout = PackedLayout(
        input_ids=torch.nn.functional.pad(ids, (0, width - used), value=0),
        position_ids=torch.nn.functional.pad(positions, (0, width - used), value=0),
        document=document,
        sequence=sequence,
        token_index=where,
        source=source,
    )
    return layout.to(input_ids.device)


def packed_static_token_logprobs(
    model,
    layout: PackedLayout,
    input_ids: torch.Tensor,
    scored: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    kernels: KernelsConfig | None = None,
    router_logits: list[torch.Tensor] | None = None,
):
    """Log-prob of each token of the rows input_ids [B, T] given the ones before it (and with `with_entropy` the
    policy's entropy there, as `padded_token_logprobs` gives it), computed on their packed row `layout` with shapes
    fixed by (B, T, W): 0 at the first token of each row, at padding, and where `scored` ([B, T] bool) is False.
    What `packed_token_logprobs` gives, as pure tensor code (no data-dependent shape), so a captured graph holds it.
    The output projection runs once per packed position (W of them, a shared prompt's tokens once for the group),
    and each row reads its tokens' values back by index.
    A `router_logits` list receives a mixture-of-experts model's router logits, one [W, experts] tensor per MoE
    layer, over the packed row as run (padding included); `layout.packed_mask(scored)` marks its completion tokens."""
    kernels = kernels or KernelsConfig()
    hidden = model.hidden_states(layout.input_ids, layout.position_ids, layout, router_logits)[0]
    # Packed token p is scored from the hidden state of the token before it in its sequence, `source[p]`.
    picked, entropy = linear_logprob(
        hidden.index_select(0, layout.source), model.output_embedding(), layout.input_ids[0], temperature,
        impl=kernels.logprob, chunk=kernels.logprob_chunk,
    )
    index = torch.where(layout.token_index >= 0, layout.token_index, 0).reshape(-1)
    wanted = layout.predicted()
    if scored is not None:
        wanted = wanted & scored

    def unpacked(values: torch.Tensor) -> torch.Tensor:
        return torch.where(wanted, values.index_select(0, index).view(input_ids.shape), 0.0)

    return (unpacked(picked), unpacked(entropy)) if with_entropy else unpacked(picked)
