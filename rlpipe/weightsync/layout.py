"""The sync plan: which learner rank sends which rows of which tensor, in which bucket, and where those rows land
in every tensor-parallel slice of a rollout engine.

Computed once per run from two layouts:
- the learner's: every parameter under its Hugging Face name and full shape, sharded on dim 0 over M ranks the
  way SimpleFSDP stores it (torch.chunk: ceil(n / M) rows a rank, the last ranks may hold fewer or none);
- the engine's: tensor-parallel degree T, the modules vLLM fuses (`packed_modules_mapping`: q/k/v -> qkv_proj,
  gate/up -> gate_up_proj), head counts, and the rollout dtype.

Mixture-of-experts layers: the learner's stacked `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]
land in vLLM's fused MoE parameters `w13_weight` [E, 2I/T, H] (each rank's gate rows, then its up rows) and
`w2_weight` [E, H, I/T]: the same layout, with the expert intermediate dim split over T (vLLM's tensor-parallel
MoE; expert parallelism is not planned). SimpleFSDP shards these on the expert dim, so a learner rank sends whole
experts. The router (`mlp.gate.weight`) is replicated.

Buckets group whole tensors up to a byte budget, so a bucket is complete once every rank's part of it arrived;
inside a bucket each rank packs only the rows it owns, so no learner rank assembles the model. The engine side
assembles rows into Hugging Face tensors and hands them to vLLM's own loader, which fuses and slices for its
tensor-parallel workers; the destinations recorded here are that same placement, computed independently, so a
layout the engine does not expect is caught before any weight is written (and tested against vLLM's layers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rlpipe.models.registry import model_architecture

# vLLM pads the vocabulary of its embedding and output layers to a multiple of this before splitting it.
VOCAB_PADDING = 64


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of tensor `name`, stored at `offset` in one rank's part of a bucket, or at
    `bucket_offset` when every rank writes into one buffer holding the bucket's whole tensors end to end."""

    name: str
    start: int
    stop: int
    offset: int
    nbytes: int
    bucket_offset: int


@dataclass(frozen=True)
class Bucket:
    index: int
    names: tuple[str, ...]
    parts: tuple[tuple[Piece, ...], ...]  # parts[rank]: the pieces that learner rank sends
    tensor_offsets: tuple[int, ...]  # where each of `names` starts in the whole-tensor layout

    def part_bytes(self, rank: int) -> int:
        return sum(piece.nbytes for piece in self.parts[rank])

    @property
    def nbytes(self) -> int:
        return sum(self.part_bytes(rank) for rank in range(len(self.parts)))


@dataclass(frozen=True)
class Destination:
    """Where tensor rows land in one tensor-parallel rank's engine parameter: source [src_start, src_stop) along
    `dim` of the Hugging Face tensor goes to [dst_start, dst_stop) along `dim` of `param` on `tp_rank`."""

    tp_rank: int
    param: str
    dim: int
    src_start: int
    src_stop: int
    dst_start: int
    dst_stop: int
    replicated: bool = False  # every rank holds the whole tensor (norms)


@dataclass(frozen=True)
class EngineLayout:
    tensor_parallel: int
    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    moe_intermediate_size: int = 0  # 0: no mixture-of-experts layers
    # Where the engine keeps a MoE layer's fused expert weights, relative to `mlp.experts.` (vLLM 0.32 nests them
    # in a `routed_experts` module, other versions hold `w13_weight` directly; rlpipe's model in vLLM holds
    # `gate_up_proj` / `down_proj`). The layout is the same in every case.
    expert_params: tuple[str, str] = ("w13_weight", "w2_weight")
    fused: Mapping[str, Sequence[str]] = field(
        default_factory=lambda: {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    )

    @classmethod
    def from_hf_config(
        cls, hf_config: dict, tensor_parallel: int, dtype: str, fused=None, engine_params: Sequence[str] = ()
    ) -> EngineLayout:
        """The layout for a Hugging Face config, read by rlpipe's one parser (`model_architecture`), so the learner
        and the plan agree on every default; `fused` and `engine_params` are what the engine's model reports (its
        packed modules and parameter names), when known."""
        arch = model_architecture(hf_config)
        extra = {} if fused is None else {"fused": {k: tuple(v) for k, v in fused.items()}}
        if arch.num_experts:
            extra["moe_intermediate_size"] = arch.moe_intermediate_size
            found = [name.partition(".mlp.experts.")[2] for name in engine_params if ".mlp.experts." in name]
            w13 = next((name for name in found if name.endswith("w13_weight")), None)
            w2 = next((name for name in found if name.endswith("w2_weight")), None)
            if w13 and w2:
                extra["expert_params"] = (w13, w2)
            elif "gate_up_proj" in found:  # rlpipe's model inside vLLM holds the learner's stacked tensors
                extra["expert_params"] = ("gate_up_proj", "down_proj")
        return cls(
            tensor_parallel=tensor_parallel,
            dtype=dtype,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            intermediate_size=arch.intermediate_size,
            vocab_size=arch.vocab_size,
            tied_embeddings=arch.tie_word_embeddings,
            **extra,
        )


@dataclass(frozen=True)
class SyncPlan:
    learner_ranks: int
    dtype: str
    shapes: Mapping[str, tuple[int, ...]]
    buckets: tuple[Bucket, ...]
    destinations: Mapping[str, tuple[Destination, ...]]

    @property
    def nbytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def engine_params(self) -> set[str]:
        return {dest.param for dests in self.destinations.values() for dest in dests}


def shard_rows(rows: int, rank: int, ranks: int) -> tuple[int, int]:
    """The rows of a dim-0 Shard that `rank` holds: torch.chunk's split, as DTensor uses it."""
    chunk = math.ceil(rows / ranks) if rows else 0
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk)


def plan_sync(
    shapes: Mapping[str, Sequence[int]], learner_ranks: int, engine: EngineLayout, bucket_bytes: int
) -> SyncPlan:
    """Plan the transfer of every tensor in `shapes` (Hugging Face names, full shapes)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    itemsize = torch.empty(0, dtype=getattr(torch, engine.dtype)).element_size()
    shapes = {name: tuple(shape) for name, shape in shapes.items()}
    if engine.tied_embeddings:
        shapes.pop("lm_head.weight", None)  # the engine derives it from the embedding

    # A sync is a pipeline (the next bucket is packed while the engine checks this one) that fills while the first
    # bucket is packed and drains while the last is checked. Both ends are kept short: tensors larger than a bucket
    # (embeddings, the output layer) travel in the middle, and the first and last buckets get a quarter budget.
    sizes = {name: math.prod(shape) * itemsize for name, shape in shapes.items()}
    fitting = [name for name in shapes if sizes[name] <= bucket_bytes]
    oversized = [name for name in shapes if sizes[name] > bucket_bytes]
    order = fitting[: len(fitting) // 2] + oversized + fitting[len(fitting) // 2 :]
    end_budget = max(1, bucket_bytes // 4)
    bucket_names: list[list[str]] = [[]]
    filled = 0
    for name in order:
        if bucket_names[-1] and filled + sizes[name] > (end_budget if len(bucket_names) == 1 else bucket_bytes):
            bucket_names.append([])
            filled = 0
        bucket_names[-1].append(name)
        filled += sizes[name]
    tail: list[str] = []
    if sum(sizes[name] for name in bucket_names[-1]) > end_budget:  # a long last bucket gives up a short end of its own
        tail_bytes = 0
        while len(bucket_names[-1]) > 1 and tail_bytes + sizes[bucket_names[-1][-1]] <= end_budget:
            tail.insert(0, bucket_names[-1].pop())
            tail_bytes += sizes[tail[0]]
    if tail:
        bucket_names.append(tail)

    buckets = []
    for index, names in enumerate(bucket_names):
        tensor_offsets = [0]
        for name in names:
            tensor_offsets.append(tensor_offsets[-1] + math.prod(shapes[name]) * itemsize)
        parts = []
        for rank in range(learner_ranks):
            pieces, offset = [], 0
            for name, tensor_offset in zip(names, tensor_offsets):
                shape = shapes[name]
                if not shape:  # a 0-dim tensor is replicated on every rank; rank 0 sends it
                    start, stop = (0, 1) if rank == 0 else (0, 0)
                    row_bytes = itemsize
                else:
                    start, stop = shard_rows(shape[0], rank, learner_ranks)
                    row_bytes = math.prod(shape[1:]) * itemsize
                if stop > start:
                    nbytes = (stop - start) * row_bytes
                    pieces.append(Piece(name, start, stop, offset, nbytes, tensor_offset + start * row_bytes))
                    offset += nbytes
            parts.append(tuple(pieces))
        buckets.append(Bucket(index, tuple(names), tuple(parts), tuple(tensor_offsets[:-1])))

    destinations = {name: tuple(_destinations(name, shape, engine)) for name, shape in shapes.items()}
    return SyncPlan(learner_ranks, engine.dtype, shapes, tuple(buckets), destinations)


def _destinations(name: str, shape: tuple[int, ...], engine: EngineLayout) -> list[Destination]:
    """vLLM's placement of one Hugging Face tensor over T tensor-parallel ranks."""
    tp = engine.tensor_parallel
    module_path, _, leaf = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    fused_into = next((fused for fused, parts in engine.fused.items() if module in parts), None)
    dests = []
    if module == "experts" and leaf in ("gate_up_proj", "down_proj"):
        return _expert_destinations(f"{module_path}.", leaf, engine)
    for rank in range(tp):
        if fused_into == "qkv_proj" or (fused_into is None and module in ("q_proj", "k_proj", "v_proj")):
            # Query heads split evenly; key/value heads split too, or each replicated over T / kv ranks.
            q_rows = engine.num_heads // tp * engine.head_dim
            kv_heads_here = max(1, engine.num_kv_heads // tp)
            kv_rows = kv_heads_here * engine.head_dim
            if module == "q_proj":
                src, rows, dst = rank * q_rows, q_rows, 0
            else:
                # With fewer kv heads than ranks, kv head h is shared by ranks h * T/kv ... (h + 1) * T/kv - 1.
                first_head = rank * engine.num_kv_heads // tp
                src, rows = first_head * engine.head_dim, kv_rows
                dst = q_rows + (kv_rows if module == "v_proj" else 0)
            param = f"{parent}.{fused_into}.{leaf}" if fused_into else name
            if not fused_into:
                dst = 0
            dests.append(Destination(rank, param, 0, src, src + rows, dst, dst + rows))
        elif fused_into == "gate_up_proj" or (fused_into is None and module in ("gate_proj", "up_proj")):
            rows = engine.intermediate_size // tp
            dst = rows if (module == "up_proj" and fused_into) else 0
            param = f"{parent}.{fused_into}.{leaf}" if fused_into else name
            dests.append(Destination(rank, param, 0, rank * rows, (rank + 1) * rows, dst, dst + rows))
        elif module in ("o_proj", "down_proj") and leaf == "weight":
            # Row-parallel: the input dimension (dim 1) is split.
            cols = shape[1] // tp
            dests.append(Destination(rank, name, 1, rank * cols, (rank + 1) * cols, 0, cols))
        elif module in ("embed_tokens", "lm_head"):
            padded = math.ceil(engine.vocab_size / VOCAB_PADDING) * VOCAB_PADDING
            per_rank = padded // tp
            start = min(shape[0], rank * per_rank)
            stop = min(shape[0], start + per_rank)
            dests.append(Destination(rank, name, 0, start, stop, 0, stop - start))
        else:  # norms, biases of row-parallel layers: replicated whole
            rows = shape[0] if shape else 1
            dests.append(Destination(rank, name, 0, 0, rows, 0, rows, replicated=True))
    return dests


def _expert_destinations(prefix: str, leaf: str, engine: EngineLayout) -> list[Destination]:
    """Stacked expert weights into vLLM's fused MoE parameters, the expert intermediate dim split over T."""
    tp = engine.tensor_parallel
    rows = engine.moe_intermediate_size // tp
    w13, w2 = engine.expert_params
    dests = []
    for rank in range(tp):
        if leaf == "gate_up_proj":  # dim 1 holds gate [0, I) then up [I, 2I); each rank keeps its slice of both
            gate_src = rank * rows
            up_src = engine.moe_intermediate_size + rank * rows
            dests.append(Destination(rank, prefix + w13, 1, gate_src, gate_src + rows, 0, rows))
            dests.append(Destination(rank, prefix + w13, 1, up_src, up_src + rows, rows, 2 * rows))
        else:  # down_proj [E, H, I]: row-parallel, the intermediate (input) dim is split
            dests.append(Destination(rank, prefix + w2, 2, rank * rows, (rank + 1) * rows, 0, rows))
    return dests
