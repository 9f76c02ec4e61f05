"""The engine's own parameters built from Hugging Face tensors by a sync plan's destinations, done the slow, obvious
way: the oracle the tests check the plan (and vLLM's own fused tensor-parallel layers) against."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from rlpipe.weightsync.layout import VOCAB_PADDING, SyncPlan


def engine_tensors(
    plan: SyncPlan, tensors: Mapping[str, torch.Tensor], tp_rank: int | None = None
) -> dict[str, torch.Tensor]:
    """The engine's own parameters (fused, tensor-parallel sliced) built from Hugging Face tensors by the plan.

    With `tp_rank`, that rank's local parameters. Without, every split parameter as one global array whose blocks
    along the split dim are the ranks' local parameters in rank order (replicated ones once): the layout of a
    parameter sharded over T devices. Vocabulary padding rows are zero."""
    tp = 1 + max(dest.tp_rank for dests in plan.destinations.values() for dest in dests)
    shapes: dict[str, list[int]] = {}
    split_dim: dict[str, int | None] = {}
    extent: dict[str, int] = {}  # a split parameter's local size along its split dim
    for name, dests in plan.destinations.items():
        for dest in dests:
            shapes.setdefault(dest.param, list(plan.shapes[name]) or [1])
            split_dim[dest.param] = None if dest.replicated else dest.dim
            if not dest.replicated:
                extent[dest.param] = max(extent.get(dest.param, 0), dest.dst_stop)
    for param, size in extent.items():
        shapes[param][split_dim[param]] = size
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in shapes and name in plan.shapes:  # vLLM pads the vocabulary before splitting it
            shapes[name][0] = math.ceil(plan.shapes[name][0] / VOCAB_PADDING) * VOCAB_PADDING // tp
    ranks = range(tp) if tp_rank is None else [tp_rank]
    local = {(rank, param): torch.zeros(shape, dtype=plan.torch_dtype) for param, shape in shapes.items() for rank in ranks}
    for name, dests in plan.destinations.items():
        source = tensors[name].reshape(shapes[dests[0].param]) if not plan.shapes[name] else tensors[name]
        for dest in dests:
            if dest.tp_rank in ranks:
                rows = dest.dst_stop - dest.dst_start
                local[(dest.tp_rank, dest.param)].narrow(dest.dim, dest.dst_start, rows).copy_(
                    source.narrow(dest.dim, dest.src_start, dest.src_stop - dest.src_start)
                )
    if tp_rank is not None:
        return {param: local[(tp_rank, param)] for param in shapes}
    return {
        param: local[(0, param)] if split_dim[param] is None else torch.cat([local[(r, param)] for r in ranks], split_dim[param])
        for param in shapes
    }
