"""The learner's memory: per chip in the steady step (`learner_side`), and the peaks outside it (`learner_peaks`):
its load per chip and a learner host's RAM.

Learner (M = learner.ranks; SimpleFSDP shards every parameter Shard(0) over M ranks, one rank per chip):
- parameters      P x master_bytes / M                  master = model.dtype
- gradients       P x master_bytes / M                  `.grad` of a sharded parameter is stored in the master dtype;
                                                        the reduce-scatter runs in learner.reduce_dtype
- AdamW moments   2 x P x master_bytes / M              torch AdamW / FunctionalAdamW keep exp_avg and exp_avg_sq
                                                        in the parameter's dtype (8P/M for float32 masters)
- reference model P x master_bytes / M                  only when the objective reads a reference (algo.kl_beta
                                                        > 0) without learner.lora (with it the reference is the
                                                        frozen base, read with adapters off)
- gathered weights only when sharded (M > 1 or param_dtype != model.dtype); U = the largest unit gathered at once:
                  one decoder layer, the input embedding or the output projection. r' = reduce_bytes when the
                  reduce-scatter runs in another dtype than the compute dtype, else 0.
    learner.activation_checkpointing on:   U x (2 x compute_bytes + r')
                  one unit at a time: backward re-runs each layer, and the re-run gathers its weights again, so a
                  layer's gathered copy lives from its (re)computation to its backward only; with it its full
                  gradient in the compute dtype, cast to reduce_dtype for the reduce-scatter when the two differ.
    learner.activation_checkpointing off:  (P - E_in) x compute_bytes + U x (compute_bytes + r')
                  autograd saves every gathered weight a matmul read (the linear ops keep their weight input), so
                  they are all held at the peak, where backward starts; E_in is the untied input embedding, whose
                  lookup keeps only the token ids. Plus one unit's gradient, as above.
- activations     for one micro-batch: n = rows x seq tokens; seq = data.max_prompt_tokens + rollout.max_tokens,
                  padded up to the smallest of learner.length_buckets that holds it where the step's forward has
                  static shapes (rlpipe/training/forward.py `choose_forward`: learner.graph, or a lazy device); rows =
                  train.micro_batch_size there (rows are padded), else min(micro_batch_size, the rank's share of a
                  mini-batch). Always + n x ((4 + a) x h + 4): the final norm and the log-sum-exp kept per token.
    learner.activation_checkpointing on:   L x n x per_token_saved + n x per_token_layer
                  each layer keeps its input (a x h) and, because the fused attention kernels are tagged as seeded
                  (for dropout) and are never recomputed, their output and log-sum-exp (a x q + 4 x heads);
                  per_token_saved = a x (h + q) + 4 x heads. Backward re-runs one layer at a time, holding that
                  layer's full activations (the largest layer kind's per_token_layer) during its recompute.
    learner.activation_checkpointing off:  L x n x per_token_layer
                  per_token_layer (bytes), with a = compute bytes, h = hidden, q = heads x head_dim,
                  kv = kv_heads x head_dim, I = intermediate, E experts, k experts per token, Ie = expert intermediate:
                    2 RMSNorms        2 x (4 + a) x h      each keeps its input in float32 and its output
                    q/k norm (Qwen3)  4 x (q + kv)         float32 inputs
                    attention         a x (q + 2 kv)       q, k, v kept by the (flash) attention kernel; no s x s scores
                    attention output  a x q                the input of o_proj
                    dense MLP         a x 4 I              gate, up, silu(gate), silu(gate) x up
                    MoE MLP           a x (E + k (2 h + 4 Ie))  router logits; per routed copy its input, its output
                                                           (kept for the routing-weight gradient) and gate/up/act/product
- attention scores  model.kernels.attention=torch only, where sdpa forms them: on a packed row (where the step's
                  forward packs: one row of W = rows x seq, or its packed bucket) under its [W, W] mask, or on rows x seq padded rows
                  on a tpu/xla learner: (L' + 1) x rows x heads x W^2 x a (the probabilities each kept layer holds
                  for backward, L' = 1 with activation checkpointing else L, plus the running layer's scores) + W^2
                  (the bool mask). The Pallas kernel (splash) keeps none.
- log-prob path   3 x 4 x n x C + 4 x n x h             model.kernels.logprob: chunked -> C = logprob_chunk (float32
                                                        logits, exponentials and their gradient for one vocabulary
                                                        chunk, plus the float32 hidden-state gradient accumulator);
                                                        reference -> C = vocab; pallas -> C = 0 (blocks live in VMEM)

Peaks outside the steady step (s = the stored dtype's bytes, config.json's "dtype" / "torch_dtype", float32 when
absent; b = master bytes; rb = rollout bytes; R = learner ranks per host, one per chip; E = engines per host =
rollout chips per host / T; a tensor's rows = the ceil(rows / M) of its Shard(0) split one rank owns):
- learner load, per chip: the model is built on `meta` and each rank materialises only its own shards, read from
  the safetensors files. P x b / M (its parameter shard; twice with a reference copy: algo.kl_beta > 0, no LoRA) +
  U x (s + b): the largest unit (as above) on the chip at once as read, in the stored dtype, and as cast to the
  master dtype the parameters are kept in. Compared with the learner's usable HBM, as the step is.
- learner host RAM, per host: the largest of its phases, which do not overlap:
    load        R x rows x (s + b)           each rank holds one tensor's rows it owns as read and as cast, never
                                             a full state dict; rows: the tensor whose share is the largest
    sync        2 x R x P x rb / M           each rank's packed parts of every bucket (the transport keeps them per
                                             bucket for the next version) + the object store's copy (ray.put) until
                                             the version is committed
    checkpoint  R x (rows x b + 10 MB) + K   DCP save moves one shard item at a time through the CPU (its writer
                                             copies up to 10 MB ahead); K = R x P x rb / M, the kept sync buffers
    resume      R x 2 x rows x b             DCP load reads one stored item's bytes and loads them into a tensor
                                             before copying it into the rank's shard (before any sync: no K)
    HF export   R x T x b + S + K            metrics.export: streamed, each rank gathers one whole tensor at a time
                                             (T, the largest) to the CPU; rank 0 holds one safetensors shard
                                             (S = min(P x b, 2 GiB)) until it is written
  Compared with the `resources.limits.memory` of the TPU worker group, in deploy/kuberay/*.yaml, that runs the
  learner's slice (same GKE accelerator, topology, hosts and chips per host; the smallest when several do). The
  export's gather adds one whole tensor (T x b) on each chip, well inside the step's own transients.
"""

from __future__ import annotations

import math
from pathlib import Path

from rlpipe.algo.objective import build_objective
from rlpipe.config import Config
from rlpipe.hardware.device import backend
from rlpipe.training.forward import PackedForward, StaticPackedForward, StaticPaddedForward, choose_forward
from rlpipe.models.hf import MAX_SHARD_BYTES
from rlpipe.models.packing import bucket_length
from rlpipe.plan.model_size import ModelSize
from rlpipe.plan.parts import DTYPE_BYTES, GIB, MemoryItem, Peak, SidePlan
from rlpipe.plan.pods import host_memory_limit
from rlpipe.plan.synced import synced_params
from rlpipe.hardware.tpu_layout import SliceShare

# torch.distributed.checkpoint's FileSystemWriter copies up to this many bytes to the CPU ahead of writing them.
DCP_COPY_AHEAD = 10_000_000


def _train_forward(cfg: Config):
    """The train step's forward variant the learner's engine chooses for this config (rlpipe/training/forward.py)."""
    forward, _ = choose_forward(
        cfg.learner, cfg.model.kernels, temperature=1.0, moe=False, lazy=backend(cfg.learner.device).lazy,
        micro_batch_size=cfg.train.micro_batch_size, passes=0,
    )
    return forward


def _bucket(length: int, buckets: list[int]) -> int:
    """The bucket the step pads `length` to (rlpipe/models/packing.py); `length` itself where none holds it."""
    try:
        return bucket_length(length, buckets)
    except ValueError:
        return length


def learner_sequence(cfg: Config) -> tuple[int, int]:
    """(rows, tokens per row) of one micro-batch on one rank."""
    longest = cfg.longest_sequence
    forward = _train_forward(cfg)
    if isinstance(forward, (StaticPaddedForward, StaticPackedForward)):  # static shapes: rows and columns padded
        return cfg.train.micro_batch_size, _bucket(longest, forward.buckets)
    mini = cfg.train.mini_batch_size or cfg.samples_per_step
    return min(cfg.train.micro_batch_size, math.ceil(mini / cfg.learner.ranks)), longest


def attention_scores(cfg: Config, arch: ModelSize, rows: int, seq: int, a: int) -> MemoryItem | None:
    """The s x s attention scores of model.kernels.attention=torch where they exist: under a packed row's [W, W]
    mask (where the step packs its rows) and on a TPU or XLA device, whose sdpa is the plain math. None for the
    Pallas kernel, which keeps none."""
    if cfg.model.kernels.attention != "torch":
        return None
    forward = _train_forward(cfg)
    packed = isinstance(forward, (PackedForward, StaticPackedForward))
    if not (packed or cfg.learner.device in ("tpu", "xla")):
        return None
    rows, width = (1, rows * seq) if packed else (rows, seq)
    if isinstance(forward, StaticPackedForward):
        width = _bucket(width, forward.packed_buckets)
    per_layer = rows * arch.num_heads * width * width * a  # the probabilities a layer keeps for backward
    layers = 1 if cfg.learner.activation_checkpointing else arch.num_layers
    # Plus, transient, the layer being run's scores before the softmax; and a packed row's bool mask.
    total = (layers + 1) * per_layer + (width * width if packed else 0)
    kind = f"packed row of {width} under a [W, W] mask" if packed else f"{rows} rows x {width}"
    return MemoryItem("attention_scores", f"attention scores (attention=torch: {kind}; {layers} layers kept)", total)


def _reference_copy(cfg: Config) -> bool:
    """Whether the learner holds a frozen copy of the model as its KL reference: when its objective reads a
    reference (rlpipe/algo/objective.py), unless LoRA trains, where the frozen base is the reference
    (rlpipe/training/learner.py)."""
    objective = build_objective(cfg.algo, max_tokens=cfg.rollout.max_tokens)
    return objective.needs_reference and cfg.learner.lora is None


def learner_side(cfg: Config, arch: ModelSize, learner_share: SliceShare | None) -> SidePlan:
    """The learner's memory per chip in the steady step."""
    P = arch.params
    M = cfg.learner.ranks
    master = cfg.model.dtype
    compute = cfg.learner.param_dtype or master
    reduce = cfg.learner.reduce_dtype
    b, a, r = DTYPE_BYTES[master], DTYPE_BYTES[compute], DTYPE_BYTES[reduce]
    lora = cfg.learner.lora
    if lora is None:
        parts = [
            MemoryItem("parameters", f"parameters ({master}, 1/{M})", P * b / M),
            MemoryItem("gradients", f"gradients ({master}, 1/{M})", P * b / M),
            MemoryItem("optimizer", f"AdamW moments (2 x {master}, 1/{M})", 2 * P * b / M),
        ]
    else:
        # The frozen base has no gradient and no optimizer state. Adapters are counted whole on every rank (lora_A
        # is replicated; lora_B's rows are sharded, a bound).
        A = arch.adapter_params(lora.rank, lora.target_modules)
        parts = [
            MemoryItem("parameters", f"base parameters, frozen ({master}, 1/{M})", P * b / M),
            MemoryItem("adapters", f"LoRA adapters, rank {lora.rank} ({A / 1e6:.2f} M params, {master})", A * b),
            MemoryItem("gradients", f"adapter gradients ({master})", A * b),
            MemoryItem("optimizer", f"AdamW moments of the adapters (2 x {master})", 2 * A * b),
        ]
    if _reference_copy(cfg):
        parts.append(MemoryItem("reference", f"reference model ({master}, 1/{M})", P * b / M))
    sharded = M > 1 or compute != master
    recompute = cfg.learner.activation_checkpointing
    if sharded:
        unit = arch.largest_unit_params
        gradient = a + (r if r != a else 0)  # the unit's full gradient, and its reduce-dtype cast when different
        if lora is not None:
            gradient = 0  # the frozen base unit has none
        if recompute:
            parts.append(
                MemoryItem("gathered", f"gathered unit + its gradient ({unit / 1e6:.0f} M params, transient)", unit * (a + gradient))
            )
        else:
            kept = P - (0 if arch.tie_word_embeddings else arch.embedding_params)
            parts.append(
                MemoryItem(
                    "gathered",
                    f"gathered weights, all kept for backward ({kept / 1e9:.2f} B params), + a unit gradient",
                    kept * a + unit * gradient,
                )
            )
    rows, seq = learner_sequence(cfg)
    tokens = rows * seq
    layer_kinds = [(moe, count) for moe, count in ((False, arch.num_layers - arch.moe_layer_count), (True, arch.moe_layer_count)) if count]
    final = (4 + a) * arch.hidden_size + 4  # final norm, and the log-sum-exp kept per token
    if recompute:
        # Each layer keeps its input and the attention kernel's output and log-sum-exp; one layer is re-run at a time.
        saved = a * (arch.hidden_size + arch.q_dim) + 4 * arch.num_heads
        widest = max(arch.activation_bytes_per_token_layer(a, moe) for moe, _ in layer_kinds)
        label = f"activations ({rows} x {seq} tokens, {arch.num_layers} layers, recomputed)"
        activations = tokens * (arch.num_layers * saved + widest + final)
    else:
        per_token = sum(arch.activation_bytes_per_token_layer(a, moe) * count for moe, count in layer_kinds)
        label = f"activations ({rows} x {seq} tokens, {arch.num_layers} layers)"
        activations = tokens * (per_token + final)
    parts.append(MemoryItem("activations", label, activations))
    scores = attention_scores(cfg, arch, rows, seq, a)
    if scores is not None:
        parts.append(scores)
    impl = cfg.model.kernels.logprob
    chunk = {"chunked": min(cfg.model.kernels.logprob_chunk, arch.vocab_size), "reference": arch.vocab_size}.get(impl, 0)
    parts.append(
        MemoryItem("logprob", f"log-prob path ({impl}, {chunk} vocab columns)", 3 * 4 * tokens * chunk + 4 * tokens * arch.hidden_size)
    )
    return SidePlan(
        "learner",
        f"{M} rank{'s' if M > 1 else ''}, master {master}, compute {compute}, reduce {reduce}",
        tuple(parts),
        learner_share,
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def learner_peaks(
    cfg: Config, arch: ModelSize, share: SliceShare | None, usable: float | None, usable_label: str,
    manifests: Path | None,
) -> tuple[Peak, Peak]:
    """The learner's load per chip and its RAM per host."""
    P, M = arch.params, cfg.learner.ranks
    master, stored = cfg.model.dtype, arch.stored_dtype
    b, s = DTYPE_BYTES[master], DTYPE_BYTES.get(stored, 4)
    rb = DTYPE_BYTES[cfg.rollout.dtype]
    models = 2 if _reference_copy(cfg) else 1  # the frozen reference model is loaded too
    unit = arch.largest_unit_params
    load = [MemoryItem("load_shard", f"parameter shard ({master}, 1/{M})", P * b / M)]
    if models == 2:
        load.append(MemoryItem("load_reference", f"reference model shard ({master}, 1/{M})", P * b / M))
    load.append(
        MemoryItem(
            "load_unit",
            f"one unit read ({stored}) + {master} cast ({unit / 1e6:.0f} M params)",
            unit * (s + b),
        )
    )
    load_peak = Peak(
        "learner_load",
        "learner load per chip",
        f"learner load, per chip: {M} rank{'s' if M > 1 else ''} built on meta, each reading its own shards",
        tuple(load),
        usable,
        usable_label,
        missing="" if usable is not None else "no placement.learner.tpu, so no HBM to compare against",
    )

    R = share.chips_per_host if share is not None else M  # ranks per host: one per chip
    rows = arch.largest_rows_params(M)
    limit, limit_label, missing = host_memory_limit(share, "learner", manifests)
    lora = cfg.learner.lora
    synced = synced_params(cfg, arch)
    kept = R * synced * rb / M  # each rank's packed parts of every bucket, reused by every later version
    # With merged LoRA weights each rank merges W + scaling * B A one tensor's rows at a time for the sync, in
    # float32 (the weight and the product), then cast; a checkpoint holds only the adapters.
    merging = 0
    if lora is not None and synced == P:
        merging = R * math.ceil(arch.largest_targeted_params(lora.target_modules) / M) * (8 + b)
    item = arch.largest_adapter_params(lora.rank, lora.target_modules) if lora is not None else rows
    phases = (
        MemoryItem(
            "host_load",
            f"load: {R} x one tensor's rows ({rows / 1e6:.1f} M params), {stored} read + {master} cast",
            R * rows * (s + b),
        ),
        MemoryItem(
            "host_sync",
            f"sync: {R} x packed parts ({cfg.rollout.dtype}, 1/{M}) + object-store copies"
            + (f" + {R} x one merged tensor's rows (float32)" if merging else "")
            + (" (the LoRA adapters alone)" if synced != P else ""),
            2 * kept + merging,
        ),
        MemoryItem(
            "host_checkpoint",
            f"checkpoint (DCP): {R} x one {'adapter' if lora is not None else 'shard'} item ({master}) + 10 MB, "
            "+ sync buffers",
            R * (item * b + DCP_COPY_AHEAD) + kept,
        ),
        MemoryItem("host_resume", f"resume (DCP): {R} x one stored item ({master}) read + loaded", R * 2 * rows * b),
    )
    if cfg.metrics.export:
        largest, shard = arch.largest_rows_params(1), min(P * b, MAX_SHARD_BYTES)
        phases += (
            MemoryItem(
                "host_export",
                f"HF export (streamed): {R} x one whole tensor ({master}) + a {_gib(shard)} shard, + sync buffers",
                R * largest * b + shard + kept,
            ),
        )
    host_peak = Peak(
        "learner_host",
        "learner host RAM",
        f"learner host RAM, per host ({R} rank{'s' if R > 1 else ''}): the largest phase",
        phases,
        limit,
        limit_label,
        missing,
        largest_part=True,
    )
    return load_peak, host_peak

