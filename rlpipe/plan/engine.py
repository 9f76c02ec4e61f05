"""The rollout engines' memory: per chip of one engine (`rollout_side`), and an engine host's RAM at a sync
(`rollout_peak`).

Rollout (per chip of one engine; T = rollout.tensor_parallel, N = rollout.num_engines):
- weights   (P - P_kv) x rollout_bytes / T + P_kv x rollout_bytes x kv_per_chip / kv_heads
            vLLM splits heads, MLP columns, experts' intermediate dim and the vocabulary over T; the k/v projections
            (P_kv) are split by kv head and replicated when T > kv_heads. The previous version kept for roll-back
            (sync.keep_previous) lives in host memory, not HBM.
- KV cache  ceil(prompts_per_step x group_size / N) sequences x max_model_len tokens x 2 (k, v) x layers x kv_per_chip
            x head_dim x rollout_bytes: every sequence of a step resident at once at full length.
            kv_per_chip = kv_heads / T when T divides kv_heads, else 1 (a head replicated) when kv_heads divides T.
- Engine activations, sampler and compiled-program workspace are not counted; the headroom covers them.

Engine host RAM at a sync, per host (rb = rollout bytes; E = engines per host = rollout chips per host / T):
  E x (P x rb + F x B + P x rb if sync.keep_previous): per engine, the staged version, which is also the one copy
  all its tensor-parallel workers read (staging assembles it in the engine's shared memory,
  rlpipe/weightsync/hostcopy.py; an in-process engine writes from it directly); the buckets in flight, F of them
  (the sender's `BUCKETS_IN_FLIGHT`: the one shipped and those packed ahead) of B = max(sync.bucket_mb MiB, the
  largest tensor in rollout bytes: a tensor is never split); the rollback copy. Compared with the
  `resources.limits.memory` of the worker group that runs the rollout slice (rlpipe/plan/pods.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from rlpipe.config import Config
from rlpipe.config.sync import vllm_lora_rank
from rlpipe.plan.model_size import ModelSize
from rlpipe.plan.parts import DTYPE_BYTES, MemoryItem, Peak, SidePlan
from rlpipe.plan.pods import host_memory_limit
from rlpipe.plan.synced import planned_form, synced_params
from rlpipe.hardware.tpu_layout import SliceShare
from rlpipe.weightsync.sender import BUCKETS_IN_FLIGHT


def kv_heads_per_chip(kv_heads: int, tensor_parallel: int) -> int:
    """vLLM splits kv heads over the tensor-parallel ranks, or replicates one per rank when there are fewer heads."""
    if tensor_parallel <= kv_heads:
        return math.ceil(kv_heads / tensor_parallel)
    return 1


def _lora_buffers(cfg: Config, arch: ModelSize, rb: int, T: int) -> tuple[MemoryItem, ...]:
    """vLLM's buffers for the one adapter an engine serves when syncs send the adapters alone: every targeted layer
    at max_lora_rank (the rank rounded up to a value vLLM takes)."""
    form = planned_form(cfg, arch)
    if not form.adapters:
        return ()
    rank = vllm_lora_rank(form.lora.rank)
    return (MemoryItem("lora_buffers", f"LoRA adapter buffers (max_lora_rank {rank}, 1/{T})",
                 arch.adapter_params(rank, form.lora.target_modules) * rb / T),)


def rollout_peak(cfg: Config, arch: ModelSize, share: SliceShare | None, manifests: Path | None) -> Peak:
    """An engine host's RAM at a sync: the staged version, the buckets in flight, the rollback copy."""
    T = cfg.rollout.tensor_parallel
    rb = DTYPE_BYTES[cfg.rollout.dtype]
    engines = max(1, share.chips_per_host // T) if share is not None else 1
    weights = synced_params(cfg, arch) * rb
    bucket = max(cfg.sync.bucket_mb * 2**20, arch.largest_tensor_params * rb)  # a tensor is never split
    each = f" x {engines} engine{'s' if engines > 1 else ''}"
    parts = [
        MemoryItem("staging", f"staged version ({cfg.rollout.dtype}), the copy its workers read{each}", engines * weights),
        MemoryItem(
            "in_flight",
            f"buckets in flight: {BUCKETS_IN_FLIGHT} of {bucket / 2**20:.0f} MiB{each}",
            engines * BUCKETS_IN_FLIGHT * bucket,
        ),
    ]
    if cfg.sync.keep_previous:
        parts.append(MemoryItem("rollback", f"rollback copy (sync.keep_previous){each}", engines * weights))
    limit, limit_label, missing = host_memory_limit(share, "rollout", manifests)
    title = f"engine host RAM at a sync, per host ({engines} engine{'s' if engines > 1 else ''} x tensor-parallel {T})"
    return Peak("rollout_host", "engine host RAM at a sync", title, tuple(parts), limit, limit_label, missing)


def rollout_side(cfg: Config, arch: ModelSize, rollout_share: SliceShare | None) -> tuple[SidePlan, list[str]]:
    """The engines' memory per chip, and what is wrong with their split of the model's kv heads."""
    problems: list[str] = []
    P = arch.params
    T, N = cfg.rollout.tensor_parallel, cfg.rollout.num_engines
    rb = DTYPE_BYTES[cfg.rollout.dtype]
    kv_chip = kv_heads_per_chip(arch.num_kv_heads, T)
    if arch.num_kv_heads % T and T % arch.num_kv_heads:
        problems.append(
            f"rollout.tensor_parallel: {T} neither divides nor is a multiple of the model's {arch.num_kv_heads} kv heads"
        )
    kv_params = arch.kv_proj_params * arch.num_layers
    weights = (P - kv_params) * rb / T + kv_params * rb * kv_chip / arch.num_kv_heads
    sequences = math.ceil(cfg.samples_per_step / N)
    context = cfg.rollout.max_model_len
    kv = sequences * context * 2 * arch.num_layers * kv_chip * arch.head_dim * rb
    side = SidePlan(
        "rollout",
        f"{N} engine{'s' if N > 1 else ''} x tensor-parallel {T}, {cfg.rollout.dtype}",
        (
            MemoryItem("weights", f"weights ({cfg.rollout.dtype}, 1/{T})", weights),
            MemoryItem("kv_cache", f"KV cache ({sequences} seqs x {context} tokens, {kv_chip} kv heads/chip)", kv),
            *_lora_buffers(cfg, arch, rb, T),
        ),
        rollout_share,
        usable_fraction=min(cfg.rollout.gpu_memory_utilization, 1.0),
    )
    return side, problems
