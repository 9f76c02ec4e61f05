"""`rlpipe plan`: per-chip memory of the learner and the rollout engines against the TPU slices' HBM, and the
peaks outside the steady step (the learner's load per chip, a learner host's RAM, an engine host's RAM at a sync)
against the chip's HBM and the pod memory limits of the deploy manifests.

Pure arithmetic on the config and the model's Hugging Face `config.json` (from `model.path` when that folder
exists here, or a Hub id's snapshot in the Hugging Face cache, else `configs/models/<basename of model.path>.json`);
no model is built and nothing is allocated.
Figures are bytes per chip, or per host for host RAM; the printed table shows GiB (2**30 bytes).

Learner (M = learner.ranks; SimpleFSDP shards every parameter Shard(0) over M ranks, one rank per chip):
- parameters      P x master_bytes / M                  master = model.dtype
- gradients       P x master_bytes / M                  `.grad` of a sharded parameter is stored in the master dtype;
                                                        the reduce-scatter runs in learner.reduce_dtype
- AdamW moments   2 x P x master_bytes / M              torch AdamW / FunctionalAdamW keep exp_avg and exp_avg_sq
                                                        in the parameter's dtype (8P/M for float32 masters)
- reference model P x master_bytes / M                  only when algo.kl_beta > 0 without learner.lora (with it
                                                        the reference is the frozen base, read with adapters off)
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
                  padded up to the smallest of learner.length_buckets that holds it when learner.graph; rows =
                  train.micro_batch_size with the graph (rows are padded), else min(micro_batch_size, the rank's share
                  of a mini-batch). Always + n x ((4 + a) x h + 4): the final norm and the log-sum-exp kept per token.
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
- attention scores  model.kernels.attention=torch only, where sdpa forms them: on a packed row (learner.packing,
                  one row of W = rows x seq, or its packed bucket) under its [W, W] mask, or on rows x seq padded rows
                  on a tpu/xla learner: (L' + 1) x rows x heads x W^2 x a (the probabilities each kept layer holds
                  for backward, L' = 1 with activation checkpointing else L, plus the running layer's scores) + W^2
                  (the bool mask). The Pallas kernel (splash) keeps none.
- log-prob path   3 x 4 x n x C + 4 x n x h             model.kernels.logprob: chunked -> C = logprob_chunk (float32
                                                        logits, exponentials and their gradient for one vocabulary
                                                        chunk, plus the float32 hidden-state gradient accumulator);
                                                        reference -> C = vocab; pallas -> C = 0 (blocks live in VMEM)

Rollout (per chip of one engine; T = rollout.tensor_parallel, N = rollout.num_engines):
- weights   (P - P_kv) x rollout_bytes / T + P_kv x rollout_bytes x kv_per_chip / kv_heads
            vLLM splits heads, MLP columns, experts' intermediate dim and the vocabulary over T; the k/v projections
            (P_kv) are split by kv head and replicated when T > kv_heads. The previous version kept for roll-back
            (sync.keep_previous) lives in host memory, not HBM.
- KV cache  ceil(prompts_per_step x group_size / N) sequences x max_model_len tokens x 2 (k, v) x layers x kv_per_chip
            x head_dim x rollout_bytes: every sequence of a step resident at once at full length.
            kv_per_chip = kv_heads / T when T divides kv_heads, else 1 (a head replicated) when kv_heads divides T.
- Engine activations, sampler and compiled-program workspace are not counted; the headroom covers them.

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
- engine host RAM at a sync, per host: E x (P x rb + 3 x B + P x rb if sync.keep_previous): per engine, the
  staged version, which is also the one copy all its tensor-parallel workers read (staging assembles it in the
  engine's shared memory, rlpipe/weightsync/hostcopy.py; an in-process engine writes from it directly); the
  buckets in flight, 3 (the one shipped and the two the sender packs ahead) of B = max(sync.bucket_mb MiB, the
  largest tensor in rollout bytes: a tensor is never split); the rollback copy. Compared with the rollout slice's
  worker group limit, found the same way.
- /dev/shm of a learner host and of an engine host: the staged versions and rollback copies engines keep there, and
  Ray's object store at its capacity, against the worker group's /dev/shm sizeLimit (rlpipe/plan_limits.py).
  A slice whose hosts both roles share, or one no manifest runs, gets a note instead of a verdict.
  Not counted on hosts: the interpreters, libraries and runtimes of the processes, Ray's own memory.

Fit: a side fits when its total <= a usable share of the chip's HBM: USABLE_FRACTION (90%) for the learner (the
rest for the compiler's temporaries, collectives' buffers and the runtime), rollout.gpu_memory_utilization for the
rollout (the share vLLM claims for weights plus KV cache); a peak when it is <= what it is compared with. The
plan is OK (exit 0) when both sides and every peak fit and no problem was found (slice sizes against learner.ranks
and num_engines x tensor_parallel, chip counts TPUs start on, topology, kv-head split, context length); a side
without a TPU slice (placement.<role>.tpu null) is shown without a verdict. A peak that does not fit is named, with by how much, on
the last line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rlpipe.config import Config, ConfigError, recipes_dir
from rlpipe.config.learner import is_targeted
from rlpipe.config.sync import vllm_lora_rank
from rlpipe.device import TpuSlice, backend
from rlpipe.tpu_layout import SliceShare, slice_problems, slice_shares
from rlpipe.models.hf import MAX_SHARD_BYTES
from rlpipe.plan_limits import GIB, LimitCheck, Part, Peak, _keyed, limit_checks, shm_peaks
from rlpipe.pod_limits import pod_memory_limit
from rlpipe.models.registry import model_architecture, model_type_of

USABLE_FRACTION = 0.9
MODELS_DIR = recipes_dir() / "models"

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# torch.distributed.checkpoint's FileSystemWriter copies up to this many bytes to the CPU ahead of writing them.
DCP_COPY_AHEAD = 10_000_000
# Buckets of one sender in flight at a sync: the one being shipped and the two packed ahead of it
# (rlpipe/weightsync/sender.py packs two ahead).
BUCKETS_IN_FLIGHT = 3


# ------------------------------------------------------------------ architecture


@dataclass(frozen=True)
class ModelSize:
    """What the arithmetic needs from a Hugging Face config.json of a model rlpipe builds (rlpipe/models)."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    moe_layers: int = 0  # how many of the layers have the MoE block (the others a dense MLP)
    moe_layer_indices: tuple[int, ...] = ()  # which ones
    max_position_embeddings: int | None = None
    stored_dtype: str = "float32"  # the dtype config.json says the safetensors hold ("dtype" / "torch_dtype")

    @classmethod
    def from_hf(cls, hf: dict, name: str = "model") -> ModelSize:
        """The shapes rlpipe's model classes read from `hf` (rlpipe/models parses it, families' defaults included)."""
        config = model_architecture(hf)
        return cls(
            name=name,
            model_type=model_type_of(hf),
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            tie_word_embeddings=config.tie_word_embeddings,
            qk_norm=config.qk_norm,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_proj_bias,
            mlp_bias=config.mlp_bias,
            num_experts=config.num_experts,
            experts_per_token=config.experts_per_token,
            expert_intermediate_size=config.moe_intermediate_size,
            moe_layers=len(config.moe_layers),
            moe_layer_indices=tuple(sorted(config.moe_layers)),
            max_position_embeddings=config.max_position_embeddings,
            stored_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )

    # --- shapes
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    # --- parameter counts
    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def output_params(self) -> int:
        """The output projection (lm_head); 0 when tied to the input embedding."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def kv_proj_params(self) -> int:
        """k_proj + v_proj of one layer."""
        return 2 * (self.hidden_size * self.kv_dim + (self.kv_dim if self.qkv_bias else 0))

    @property
    def attention_params(self) -> int:
        h = self.hidden_size
        q = h * self.q_dim + (self.q_dim if self.qkv_bias else 0)
        o = self.q_dim * h + (h if self.o_bias else 0)
        norms = 2 * self.head_dim if self.qk_norm else 0
        return q + self.kv_proj_params + o + norms

    def _mlp_params(self, intermediate: int) -> int:
        h = self.hidden_size
        return 3 * h * intermediate + ((2 * intermediate + h) if self.mlp_bias else 0)

    @property
    def dense_mlp_params(self) -> int:
        return self._mlp_params(self.intermediate_size)

    def moe_params(self, experts: int) -> int:
        """Router plus `experts` expert MLPs of one MoE layer."""
        return self.hidden_size * self.num_experts + experts * self._mlp_params(self.expert_intermediate_size)

    def layer_params(self, moe: bool, active: bool = False) -> int:
        mlp = self.moe_params(self.experts_per_token if active else self.num_experts) if moe else self.dense_mlp_params
        return self.attention_params + mlp + 2 * self.hidden_size  # + input/post-attention RMSNorm

    def _total(self, active: bool) -> int:
        dense_layers = self.num_layers - self.moe_layers
        layers = dense_layers * self.layer_params(False) + self.moe_layers * self.layer_params(True, active)
        return self.embedding_params + self.output_params + layers + self.hidden_size  # + final norm

    @property
    def params(self) -> int:
        return self._total(active=False)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (MoE: only its experts)."""
        return self._total(active=True)

    @property
    def largest_unit_params(self) -> int:
        """The largest piece gathered at once: a decoder layer, the input embedding or the output projection."""
        layer = self.layer_params(self.moe_layers > 0)
        return max(layer, self.embedding_params, self.output_params)

    @property
    def tensor_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of every kind of weight matrix the model holds (the learner's names: experts stacked)."""
        h, vocab = self.hidden_size, self.vocab_size
        shapes = [(vocab, h), (self.q_dim, h), (self.kv_dim, h), (h, self.q_dim)]
        if not self.tie_word_embeddings:
            shapes.append((vocab, h))
        if self.moe_layers < self.num_layers:
            shapes += [(self.intermediate_size, h), (h, self.intermediate_size)]
        if self.moe_layers:
            experts, inner = self.num_experts, self.expert_intermediate_size
            shapes += [(experts, h), (experts, 2 * inner, h), (experts, h, inner)]
        return tuple(shapes)

    @property
    def linear_layers(self) -> tuple[tuple[str, int, int], ...]:
        """(module name, in features, out features) of every nn.Linear of the learner's model (rlpipe/models): the
        layers learner.lora can target. Experts are stacked tensors and the router a plain weight, not Linears."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        moe = set(self.moe_layer_indices) if self.moe_layer_indices else set(range(self.num_layers - self.moe_layers,
                                                                                      self.num_layers))
        layers = []
        for index in range(self.num_layers):
            stem = f"model.layers.{index}"
            layers += [(f"{stem}.self_attn.q_proj", h, q), (f"{stem}.self_attn.k_proj", h, kv),
                       (f"{stem}.self_attn.v_proj", h, kv), (f"{stem}.self_attn.o_proj", q, h)]
            if index not in moe:
                inner = self.intermediate_size
                layers += [(f"{stem}.mlp.gate_proj", h, inner), (f"{stem}.mlp.up_proj", h, inner),
                           (f"{stem}.mlp.down_proj", inner, h)]
        if not self.tie_word_embeddings:
            layers.append(("lm_head", h, self.vocab_size))
        return tuple(layers)

    def adapter_params(self, rank: int, targets: list[str]) -> int:
        """Parameters of rank-`rank` LoRA adapters (A: rank x in, B: out x rank) on the Linears `targets` names."""
        return sum(rank * (n_in + n_out) for name, n_in, n_out in self.linear_layers if is_targeted(name, targets))

    def largest_targeted_params(self, targets: list[str]) -> int:
        """The largest weight among the Linears `targets` names (what one LoRA merge works on)."""
        return max((n_in * n_out for name, n_in, n_out in self.linear_layers if is_targeted(name, targets)), default=0)

    def largest_adapter_params(self, rank: int, targets: list[str]) -> int:
        return max((rank * max(n_in, n_out) for name, n_in, n_out in self.linear_layers if is_targeted(name, targets)),
                   default=0)

    @property
    def largest_tensor_params(self) -> int:
        return max(math.prod(shape) for shape in self.tensor_shapes)

    def largest_rows_params(self, ranks: int) -> int:
        """The most elements one of `ranks` ranks owns of a single tensor: its rows of a Shard(0) split."""
        return max(math.ceil(shape[0] / ranks) * math.prod(shape[1:]) for shape in self.tensor_shapes)

    # --- activations
    def activation_bytes_per_token_layer(self, compute_bytes: int, moe: bool) -> int:
        a, h = compute_bytes, self.hidden_size
        total = 2 * (4 + a) * h  # input + post-attention RMSNorm: float32 input, compute-dtype output
        if self.qk_norm:
            total += 4 * (self.q_dim + self.kv_dim)
        total += a * (self.q_dim + 2 * self.kv_dim)  # q, k, v kept by attention
        total += a * self.q_dim  # attention output, o_proj's input
        if moe:
            k, expert = self.experts_per_token, self.expert_intermediate_size
            total += a * (self.num_experts + k * (2 * h + 4 * expert))
        else:
            total += a * 4 * self.intermediate_size
        return total

    def describe(self) -> str:
        kind = (
            f"MoE {self.num_experts} experts, top-{self.experts_per_token} x {self.expert_intermediate_size}"
            if self.num_experts
            else f"MLP {self.intermediate_size}"
        )
        active = f", {self.active_params / 1e9:.2f} B active" if self.num_experts else ""
        return (
            f"{self.params / 1e9:.2f} B parameters{active}; {self.num_layers} layers, hidden {self.hidden_size}, "
            f"{self.num_heads} q / {self.num_kv_heads} kv heads x {self.head_dim}, {kind}, vocab {self.vocab_size}"
            f"{' (tied)' if self.tie_word_embeddings else ''}"
        )


def architecture_source(model_path: str) -> Path:
    """The config.json the plan reads for `model.path`."""
    name = model_path.rstrip("/").rsplit("/", 1)[-1].removeprefix("builtin:").partition("@")[0]
    if model_path.startswith("builtin:"):  # converted once into the cache by the first run
        from rlpipe.models.builtin import cache_dir

        local = cache_dir() / "models" / name / "config.json"
    else:
        local = Path(model_path) / "config.json"
        if not local.is_file():  # a Hub id: its snapshot when the Hugging Face cache holds one (nothing is fetched)
            from rlpipe.models.hub import resolve_hub_model

            cached = resolve_hub_model(model_path, cached_only=True)
            local = Path(cached) / "config.json" if cached else local
    if local.is_file():
        return local
    shipped = MODELS_DIR / f"{name}.json"
    if shipped.is_file():
        return shipped
    raise ConfigError(
        f"model.path: no {local} here and no {shipped.relative_to(MODELS_DIR.parent.parent)}; download the model "
        f"folder to {model_path}, or save its Hugging Face config.json as configs/models/{name}.json"
    )


def load_architecture(model_path: str) -> tuple[ModelSize, Path]:
    """The model's sizes from its config.json, every field checked first (rlpipe/models/checks.py)."""
    from rlpipe.models.checks import ModelFileError, check_config

    source = architecture_source(model_path)
    try:
        hf = json.loads(source.read_text())
        check_config(hf, source)
        return ModelSize.from_hf(hf, name=source.parent.name if source.name == "config.json" else source.stem), source
    except ModelFileError as err:
        raise ConfigError(f"model.path: {err}") from None
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model.path: {source}: {err}") from None
    except OSError as err:
        raise ConfigError(f"model.path: {source}: unreadable ({err.strerror})") from None


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class SidePlan:
    role: str  # "learner" | "rollout"
    summary: str
    parts: tuple[Part, ...]
    share: SliceShare | None  # the chips of a TPU slice this side runs on
    usable_fraction: float = USABLE_FRACTION

    @property
    def slice(self) -> TpuSlice | None:
        return None if self.share is None else self.share.tslice

    @property
    def total_bytes(self) -> float:
        return sum(part.bytes for part in self.parts)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def usable_bytes(self) -> float | None:
        return None if self.slice is None else self.usable_fraction * self.slice.hbm_bytes

    @property
    def fits(self) -> bool | None:
        """None when no TPU slice is configured for this role."""
        return None if self.slice is None else self.total_bytes <= self.usable_bytes

    def part(self, key: str) -> Part:
        return _keyed(self.parts, key)


@dataclass(frozen=True)
class MemoryPlan:
    model: ModelSize
    source: Path
    learner: SidePlan
    rollout: SidePlan
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    peaks: tuple[Peak, ...] = ()

    @property
    def ok(self) -> bool:
        return (
            self.learner.fits is not False
            and self.rollout.fits is not False
            and all(peak.fits is not False for peak in self.peaks)
            and not self.problems
        )

    def peak(self, key: str) -> Peak:
        return _keyed(self.peaks, key)

    def checks(self) -> list[LimitCheck]:
        """Every limit, one (name, passed, reason) each (rlpipe/plan_limits.py)."""
        return limit_checks(self)


def plan_checks(cfg: Config, manifests: Path | None = None) -> list[LimitCheck]:
    """The plan's limits for a resolved config, one `LimitCheck(name, passed, reason)` each: chip counts and slice
    layout, HBM per chip, the learner's load, each host's pod memory and /dev/shm against deploy/kuberay (or
    `manifests`). `passed` is None where nothing here says the limit (no slice, no manifest)."""
    return plan(cfg, manifests=manifests).checks()


def kv_heads_per_chip(kv_heads: int, tensor_parallel: int) -> int:
    """vLLM splits kv heads over the tensor-parallel ranks, or replicates one per rank when there are fewer heads."""
    if tensor_parallel <= kv_heads:
        return math.ceil(kv_heads / tensor_parallel)
    return 1


def learner_sequence(cfg: Config) -> tuple[int, int]:
    """(rows, tokens per row) of one micro-batch on one rank."""
    longest = cfg.longest_sequence
    if cfg.learner.graph:
        fitting = [b for b in sorted(cfg.learner.length_buckets) if b >= longest]
        return cfg.train.micro_batch_size, (fitting[0] if fitting else longest)
    mini = cfg.train.mini_batch_size or cfg.samples_per_step
    return min(cfg.train.micro_batch_size, math.ceil(mini / cfg.learner.ranks)), longest


def attention_scores(cfg: Config, arch: ModelSize, rows: int, seq: int, a: int) -> Part | None:
    """The s x s attention scores of model.kernels.attention=torch where they exist: under a packed row's [W, W]
    mask (learner.packing on a non-lazy device) and on a TPU or XLA device, whose sdpa is the plain math. None for
    the Pallas kernel, which keeps none."""
    if cfg.model.kernels.attention != "torch":
        return None
    packed = cfg.learner.packing and not backend(cfg.learner.device).lazy
    if not (packed or cfg.learner.device in ("tpu", "xla")):
        return None
    rows, width = (1, rows * seq) if packed else (rows, seq)
    buckets = cfg.learner.packed_buckets
    if packed and cfg.learner.graph and buckets:
        width = min((b for b in buckets if b >= width), default=width)
    per_layer = rows * arch.num_heads * width * width * a  # the probabilities a layer keeps for backward
    layers = 1 if cfg.learner.activation_checkpointing else arch.num_layers
    # Plus, transient, the layer being run's scores before the softmax; and a packed row's bool mask.
    total = (layers + 1) * per_layer + (width * width if packed else 0)
    kind = f"packed row of {width} under a [W, W] mask" if packed else f"{rows} rows x {width}"
    return Part("attention_scores", f"attention scores (attention=torch: {kind}; {layers} layers kept)", total)


# ------------------------------------------------------------------ host memory against the deploy manifests


def _host_limit(share: SliceShare | None, role: str, manifests: Path | None) -> tuple[float | None, str, str]:
    """(limit bytes, what it is, why there is none) for one host of `role`."""
    if share is None:
        return None, "", f"no placement.{role}.tpu, so no deploy manifest to compare against"
    limit = pod_memory_limit(share, manifests, role)
    if isinstance(limit, str):
        return None, "", limit
    return limit.bytes, f"{limit.bytes / GIB:.0f} GiB pod limit ({limit.manifest}, group {limit.group})", ""


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
    load = [Part("load_shard", f"parameter shard ({master}, 1/{M})", P * b / M)]
    if models == 2:
        load.append(Part("load_reference", f"reference model shard ({master}, 1/{M})", P * b / M))
    load.append(
        Part(
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
    limit, limit_label, missing = _host_limit(share, "learner", manifests)
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
        Part(
            "host_load",
            f"load: {R} x one tensor's rows ({rows / 1e6:.1f} M params), {stored} read + {master} cast",
            R * rows * (s + b),
        ),
        Part(
            "host_sync",
            f"sync: {R} x packed parts ({cfg.rollout.dtype}, 1/{M}) + object-store copies"
            + (f" + {R} x one merged tensor's rows (float32)" if merging else "")
            + (" (the LoRA adapters alone)" if synced != P else ""),
            2 * kept + merging,
        ),
        Part(
            "host_checkpoint",
            f"checkpoint (DCP): {R} x one {'adapter' if lora is not None else 'shard'} item ({master}) + 10 MB, "
            "+ sync buffers",
            R * (item * b + DCP_COPY_AHEAD) + kept,
        ),
        Part("host_resume", f"resume (DCP): {R} x one stored item ({master}) read + loaded", R * 2 * rows * b),
    )
    if cfg.metrics.export:
        largest, shard = arch.largest_rows_params(1), min(P * b, MAX_SHARD_BYTES)
        phases += (
            Part(
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


def synced_params(cfg: Config, arch: ModelSize) -> int:
    """Parameters a weight sync sends: the whole model, or learner.lora's adapters where they go alone
    (`Config.lora_sync`)."""
    lora = cfg.learner.lora
    if lora is not None and cfg.lora_sync(moe=arch.moe_layers > 0)[0] == "adapters":
        return arch.adapter_params(lora.rank, lora.target_modules)
    return arch.params


def _reference_copy(cfg: Config) -> bool:
    """Whether the learner holds a frozen copy of the model as its KL reference: with a KL term, unless LoRA
    trains, where the frozen base is the reference (rlpipe/learner.py)."""
    return cfg.algo.kl_beta > 0 and cfg.learner.lora is None


def _lora_buffers(cfg: Config, arch: ModelSize, rb: int, T: int) -> tuple[Part, ...]:
    """vLLM's buffers for the one adapter an engine serves when syncs send the adapters alone: every targeted layer
    at max_lora_rank (the rank rounded up to a value vLLM takes)."""
    lora = cfg.learner.lora
    if synced_params(cfg, arch) == arch.params:
        return ()
    rank = vllm_lora_rank(lora.rank)
    return (Part("lora_buffers", f"LoRA adapter buffers (max_lora_rank {rank}, 1/{T})",
                 arch.adapter_params(rank, lora.target_modules) * rb / T),)


def rollout_peak(cfg: Config, arch: ModelSize, share: SliceShare | None, manifests: Path | None) -> Peak:
    """An engine host's RAM at a sync: the staged version, the buckets in flight, the rollback copy."""
    T = cfg.rollout.tensor_parallel
    rb = DTYPE_BYTES[cfg.rollout.dtype]
    engines = max(1, share.chips_per_host // T) if share is not None else 1
    weights = synced_params(cfg, arch) * rb
    bucket = max(cfg.sync.bucket_mb * 2**20, arch.largest_tensor_params * rb)  # a tensor is never split
    each = f" x {engines} engine{'s' if engines > 1 else ''}"
    parts = [
        Part("staging", f"staged version ({cfg.rollout.dtype}), the copy its workers read{each}", engines * weights),
        Part(
            "in_flight",
            f"buckets in flight: {BUCKETS_IN_FLIGHT} of {bucket / 2**20:.0f} MiB{each}",
            engines * BUCKETS_IN_FLIGHT * bucket,
        ),
    ]
    if cfg.sync.keep_previous:
        parts.append(Part("rollback", f"rollback copy (sync.keep_previous){each}", engines * weights))
    limit, limit_label, missing = _host_limit(share, "rollout", manifests)
    title = f"engine host RAM at a sync, per host ({engines} engine{'s' if engines > 1 else ''} x tensor-parallel {T})"
    return Peak("rollout_host", "engine host RAM at a sync", title, tuple(parts), limit, limit_label, missing)


def plan(cfg: Config, arch: ModelSize | None = None, manifests: Path | None = None) -> MemoryPlan:
    """The memory plan of a resolved config (its model read by `load_architecture` unless given; pod memory
    limits read from the KubeRay manifests in `manifests`, deploy/kuberay unless given)."""
    source = Path("<given>")
    if arch is None:
        arch, source = load_architecture(cfg.model.path)
    problems: list[str] = []
    notes: list[str] = []
    P = arch.params
    shares = slice_shares(cfg.placement)
    learner_share, rollout_share = shares.get("learner"), shares.get("rollout")

    # --- learner
    M = cfg.learner.ranks
    master = cfg.model.dtype
    compute = cfg.learner.param_dtype or master
    reduce = cfg.learner.reduce_dtype
    b, a, r = DTYPE_BYTES[master], DTYPE_BYTES[compute], DTYPE_BYTES[reduce]
    lora = cfg.learner.lora
    if lora is None:
        parts = [
            Part("parameters", f"parameters ({master}, 1/{M})", P * b / M),
            Part("gradients", f"gradients ({master}, 1/{M})", P * b / M),
            Part("optimizer", f"AdamW moments (2 x {master}, 1/{M})", 2 * P * b / M),
        ]
    else:
        # The frozen base has no gradient and no optimizer state. Adapters are counted whole on every rank (lora_A
        # is replicated; lora_B's rows are sharded, a bound).
        A = arch.adapter_params(lora.rank, lora.target_modules)
        parts = [
            Part("parameters", f"base parameters, frozen ({master}, 1/{M})", P * b / M),
            Part("adapters", f"LoRA adapters, rank {lora.rank} ({A / 1e6:.2f} M params, {master})", A * b),
            Part("gradients", f"adapter gradients ({master})", A * b),
            Part("optimizer", f"AdamW moments of the adapters (2 x {master})", 2 * A * b),
        ]
    if _reference_copy(cfg):
        parts.append(Part("reference", f"reference model ({master}, 1/{M})", P * b / M))
    sharded = M > 1 or compute != master
    recompute = cfg.learner.activation_checkpointing
    if sharded:
        unit = arch.largest_unit_params
        gradient = a + (r if r != a else 0)  # the unit's full gradient, and its reduce-dtype cast when different
        if lora is not None:
            gradient = 0  # the frozen base unit has none
        if recompute:
            parts.append(
                Part("gathered", f"gathered unit + its gradient ({unit / 1e6:.0f} M params, transient)", unit * (a + gradient))
            )
        else:
            kept = P - (0 if arch.tie_word_embeddings else arch.embedding_params)
            parts.append(
                Part(
                    "gathered",
                    f"gathered weights, all kept for backward ({kept / 1e9:.2f} B params), + a unit gradient",
                    kept * a + unit * gradient,
                )
            )
    rows, seq = learner_sequence(cfg)
    tokens = rows * seq
    layer_kinds = [(moe, count) for moe, count in ((False, arch.num_layers - arch.moe_layers), (True, arch.moe_layers)) if count]
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
    parts.append(Part("activations", label, activations))
    scores = attention_scores(cfg, arch, rows, seq, a)
    if scores is not None:
        parts.append(scores)
    impl = cfg.model.kernels.logprob
    chunk = {"chunked": min(cfg.model.kernels.logprob_chunk, arch.vocab_size), "reference": arch.vocab_size}.get(impl, 0)
    parts.append(
        Part("logprob", f"log-prob path ({impl}, {chunk} vocab columns)", 3 * 4 * tokens * chunk + 4 * tokens * arch.hidden_size)
    )
    learner = SidePlan(
        "learner",
        f"{M} rank{'s' if M > 1 else ''}, master {master}, compute {compute}, reduce {reduce}",
        tuple(parts),
        learner_share,
    )

    # --- rollout
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
    rollout = SidePlan(
        "rollout",
        f"{N} engine{'s' if N > 1 else ''} x tensor-parallel {T}, {cfg.rollout.dtype}",
        (
            Part("weights", f"weights ({cfg.rollout.dtype}, 1/{T})", weights),
            Part("kv_cache", f"KV cache ({sequences} seqs x {context} tokens, {kv_chip} kv heads/chip)", kv),
            *_lora_buffers(cfg, arch, rb, T),
        ),
        rollout_share,
        usable_fraction=min(cfg.rollout.gpu_memory_utilization, 1.0),
    )

    # --- consistency
    for role, share in (("learner", learner_share), ("rollout", rollout_share)):
        if share is None:
            notes.append(f"{role}: no placement.{role}.tpu, so no HBM to compare against")
    problems.extend(slice_problems(cfg))
    limit = arch.max_position_embeddings
    if limit and context > limit:
        problems.append(f"rollout.max_model_len {context} exceeds the model's max_position_embeddings {limit}")

    # --- peaks outside the steady step
    usable = learner.usable_bytes
    usable_label = ""
    if usable is not None:
        usable_label = f"{usable / GIB:.2f} usable ({learner.usable_fraction:.0%} of {learner.slice.hbm_gib})"
    load_peak, host_peak = learner_peaks(cfg, arch, learner_share, usable, usable_label, manifests)
    adapters_only = synced_params(cfg, arch) != P
    shm = shm_peaks(cfg, synced_params(cfg, arch) * rb, adapters_only, shares, manifests)
    peaks = (load_peak, host_peak, rollout_peak(cfg, arch, rollout_share, manifests), *shm)
    for peak in peaks:
        if peak.fits is None and peak.missing and peak.key != "learner_load":
            notes.append(f"{peak.name}: {peak.missing}")
    return MemoryPlan(arch, source, learner, rollout, tuple(problems), tuple(notes), peaks)


# ------------------------------------------------------------------ printing


def _side_lines(side: SidePlan, width: int) -> list[str]:
    share = side.share
    where = " (no TPU slice)"
    if share is not None:
        last = share.first_chip + share.chips - 1
        chips = f"chips {share.first_chip}-{last}" if share.shared else f"{share.chips} chips"
        where = f" on {share.tslice.pod_type} ({chips} x {share.tslice.hbm_gib} GiB HBM)"
    lines = [f"{side.role}{where}: {side.summary}"]
    lines += [f"  {part.label:<{width}} {part.gib:9.2f}" for part in side.parts]
    total = f"  {'total per chip':<{width}} {side.total_gib:9.2f}"
    if side.fits is None:
        lines.append(total)
    else:
        usable = side.usable_bytes / GIB
        verdict = "fits" if side.fits else f"DOES NOT FIT (over by {side.total_gib - usable:.2f} GiB)"
        share = f"{side.usable_fraction:.0%} of {side.slice.hbm_gib}"
        lines.append(f"{total}  of {usable:.2f} usable ({share}): {verdict}")
    return lines


def _peak_lines(peak: Peak, width: int) -> list[str]:
    lines = [peak.title]
    lines += [f"  {part.label:<{width}} {part.gib:9.2f}" for part in peak.parts]
    total = f"  {'peak' if peak.largest_part else 'total':<{width}} {peak.total_gib:9.2f}"
    if peak.fits is None:
        lines.append(total)
    else:
        verdict = "fits" if peak.fits else f"DOES NOT FIT (over by {peak.over_gib:.2f} GiB)"
        lines.append(f"{total}  of {peak.limit_label}: {verdict}")
    return lines


def format_plan(result: MemoryPlan) -> str:
    parts = [part for side in (result.learner, result.rollout) for part in side.parts]
    parts += [part for peak in result.peaks for part in peak.parts]
    width = max(max(len(part.label) for part in parts), len("total per chip"))
    lines = [
        f"model {result.model.name} ({result.model.model_type}, from {result.source}): {result.model.describe()}",
        f"{'memory per chip (host RAM: per host)':<{width + 2}} {'GiB':>9}",
        *_side_lines(result.learner, width),
        *_side_lines(result.rollout, width),
    ]
    for peak in result.peaks:
        lines += _peak_lines(peak, width)
    if result.problems:
        lines.append("problems:")
        lines += [f"  - {problem}" for problem in result.problems]
    if result.notes:
        lines.append("notes:")
        lines += [f"  - {note}" for note in result.notes]
    failing = [side.role for side in (result.learner, result.rollout) if side.fits is False]
    if result.ok:
        lines.append("plan: OK")
    else:
        why = [f"{role} does not fit" for role in failing]
        why += [
            f"{peak.name} over by {peak.over_gib:.2f} GiB" for peak in result.peaks if peak.fits is False
        ]
        why += ["see problems"] if result.problems else []
        lines.append(f"plan: NOT OK ({'; '.join(why)})")
    return "\n".join(lines)
