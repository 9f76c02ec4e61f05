"""Llama-family decoder-only causal LM (Llama, Mistral, Qwen2, Qwen3, and Qwen3-MoE: Qwen3 whose MLP is a sparse
mixture of experts in some or all layers, see rlpipe/models/moe.py) in plain torch.

The module tree mirrors Hugging Face's (`model.layers[i].self_attn.q_proj`, ...), so `state_dict()` names are
exactly the names in HF safetensors files and in vLLM's weight loaders: checkpoints load and weights sync with
no renaming table (mixture-of-experts weights are the one exception: stacked per layer under transformers 5's
in-memory names, which vLLM also loads; files hold them per expert, see moe.py). Numerics follow HF's modeling
code (fp32 RMSNorm statistics, fp32 RoPE tables cast to the activation dtype) so that log-probs agree with HF and
vLLM.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from rlpipe.kernels.attention import causal_attention, document_attention, document_attention_mask, masked_attention
from rlpipe.kernels.rmsnorm import rms_norm
from rlpipe.models.architecture import ROPE_TYPES, SLIDING_ATTENTION, ModelArchitecture
from rlpipe.models.moe import Experts, SparseMoeBlock, TopKRouter

if TYPE_CHECKING:
    from rlpipe.models.packing import PackedLayout

# A packed row's layout: blocks in row order, each a prefix followed by the lengths of the continuations that read
# it. ((5, 3, 4), (7,)) is a 5-token prompt shared by a 3- and a 4-token completion, then a 7-token sequence alone.
Segments = tuple[tuple[int, ...], ...]
# What one attention layer takes for a packed row: its `Segments`, the [W, W] boolean mask of which token may attend
# which (`document_attention_mask`, built from a `PackedLayout`; shapes independent of the layout), or the layout's
# [W] document ids (for a kernel that takes segment ids).
PackedAttention = Segments | torch.Tensor


def rope_inverse_frequencies(config: ModelArchitecture) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] in fp32 on CPU, attention_scaling for cos/sin), computed with the same float
    operations in the same order as transformers so the tables agree bit for bit."""
    dim = config.head_dim
    theta = config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    wavelength_bases = theta**exponents
    inv_freq = 1.0 / wavelength_bases
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(wavelength_bases, dim, theta, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: keep short wavelengths, divide long ones by `factor`, and blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    long_wavelength = original_context / low_freq_factor
    short_wavelength = original_context / high_freq_factor

    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > long_wavelength, inv_freq / factor, inv_freq)
    blend = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_between = ~(wavelength < short_wavelength) & ~(wavelength > long_wavelength)
    return torch.where(in_between, blended, scaled)


def _yarn_inverse_frequencies(
    wavelength_bases: torch.Tensor, dim: int, theta: float, scaling: dict
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp linearly between the dimensions where
    the original context holds `beta_fast` and `beta_slow` rotations; cos/sin get scaled by `attention_factor`."""
    factor = scaling["factor"]
    original_context = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def dimension_for_rotations(rotations: float) -> float:
        return (dim * math.log(original_context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    ramp_start = dimension_for_rotations(beta_fast)
    ramp_end = dimension_for_rotations(beta_slow)
    if scaling.get("truncate", True):
        ramp_start, ramp_end = math.floor(ramp_start), math.ceil(ramp_end)
    ramp_start, ramp_end = max(ramp_start, 0), min(ramp_end, dim - 1)
    if ramp_start == ramp_end:
        ramp_end += 0.001  # a zero-width ramp would divide by zero

    dimension_index = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((dimension_index - ramp_start) / (ramp_end - ramp_start), 0, 1)
    extrapolation_weight = 1 - ramp
    extrapolated = 1.0 / wavelength_bases
    interpolated = 1.0 / (factor * wavelength_bases)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.impl = "torch"  # see rlpipe/kernels/rmsnorm.py; CausalLM.set_kernels sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.impl)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelArchitecture) -> None:
        super().__init__()
        # A plain attribute, not a buffer: `.to(dtype)`, `to_empty()` and meta-device construction must never
        # touch it, since it has to stay the fp32 values HF computes on CPU.
        self.inv_freq, self.attention_scaling = rope_inverse_frequencies(config)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B or 1, T, head_dim] in `dtype`."""
        inv_freq = self.inv_freq.to(position_ids.device)
        angles = position_ids[..., None].float() * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated by pairing dimension i with i + D/2 (HF's "rotate_half" layout)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelArchitecture, sliding_window: int | None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.sliding_window = sliding_window
        self.impl = "torch"  # see rlpipe/kernels/attention.py; CausalLM.set_kernels sets it
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, heads, T, D] and k, v [B, kv heads, T, D]: projected, normed (Qwen3), rotated."""
        batch, length, _ = x.shape
        per_head = (batch, length, -1, self.head_dim)
        q = self.q_proj(x).view(per_head)
        k = self.k_proj(x).view(per_head)
        v = self.v_proj(x).view(per_head)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: PackedAttention | None = None
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.rotated_qkv(x, cos, sin)
        if segments is None:
            out = causal_attention(q, k, v, self.sliding_window, self.impl)
        elif isinstance(segments, torch.Tensor) and segments.dtype == torch.bool:  # [W, W], window included
            out = masked_attention(q, k, v, segments, self.impl)
        elif isinstance(segments, torch.Tensor):  # [W] document ids
            out = document_attention(q, k, v, segments, self.sliding_window, self.impl)
        else:
            out = torch.cat(list(self._packed_attention(q, k, v, segments)), dim=2)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def _packed_attention(self, q, k, v, segments: Segments):
        """Attention over a packed row, block by block: a block's prefix attends within itself, and each of the
        continuations after it attends to the prefix and to itself — no score across blocks or between
        continuations is computed."""
        start = 0
        for prefix, *continuations in segments:
            shared = slice(start, start + prefix)
            k_prefix, v_prefix = k[:, :, shared], v[:, :, shared]
            yield causal_attention(q[:, :, shared], k_prefix, v_prefix, self.sliding_window, self.impl)
            start += prefix
            for length in continuations:
                own = slice(start, start + length)
                k_seen, v_seen = torch.cat([k_prefix, k[:, :, own]], dim=2), torch.cat([v_prefix, v[:, :, own]], dim=2)
                yield causal_attention(q[:, :, own], k_seen, v_seen, self.sliding_window, self.impl)
                start += length


class MLP(nn.Module):
    def __init__(self, config: ModelArchitecture) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchitecture, layer_index: int) -> None:
        super().__init__()
        is_sliding = config.layer_types[layer_index] == SLIDING_ATTENTION
        self.self_attn = Attention(config, config.sliding_window if is_sliding else None)
        self.mlp = SparseMoeBlock(config) if config.is_moe_layer(layer_index) else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: PackedAttention | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output and, for a mixture-of-experts layer, its router logits [tokens, experts]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segments)
        if isinstance(self.mlp, SparseMoeBlock):
            out, router_logits = self.mlp.routed(self.post_attention_layernorm(x))
            return x + out, router_logits
        return x + self.mlp(self.post_attention_layernorm(x)), None


def _save_seeded_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """What a checkpointed layer keeps: the outputs of ops tagged as drawing random numbers (here the fused
    attention kernels, tagged for their dropout), so a recompute never re-draws them (the compiled step's
    rematerialisation refuses seeded ops); everything else, the weights' all-gathers included, is recomputed."""
    seeded = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
    return CheckpointPolicy.MUST_SAVE if seeded else CheckpointPolicy.PREFER_RECOMPUTE


_RECOMPUTE_ALL_BUT_SEEDED = functools.partial(create_selective_checkpoint_contexts, _save_seeded_ops)


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    # learner.activation_checkpointing: while grad is enabled each layer runs under torch.utils.checkpoint, so
    # autograd keeps only the layer's input (and the attention kernel's output, see _save_seeded_ops) and backward
    # re-runs the layer. Under SimpleFSDP that re-run reads the weights again, i.e. all-gathers them again, so no
    # gathered layer weight is kept from forward to backward.
    activation_checkpointing = False

    def __init__(self, config: ModelArchitecture) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        segments: Segments | PackedLayout | None = None,
        router_logits: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        if segments is None or isinstance(segments, tuple):
            per_layer = [segments] * len(self.layers)
        elif self.layers[0].self_attn.impl == "torch":
            per_layer = self._attention_masks(segments, position_ids[0])
        else:  # a kernel that takes document ids: no [W, W] tensor (the layout shares no prompt, see PackedLayout)
            per_layer = [segments.document] * len(self.layers)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for layer, layer_segments in zip(self.layers, per_layer):
            if recompute:
                x, logits = checkpoint(
                    layer, x, cos, sin, layer_segments, use_reentrant=False, context_fn=_RECOMPUTE_ALL_BUT_SEEDED
                )
            else:
                x, logits = layer(x, cos, sin, layer_segments)
            # Collected here, outside the checkpointed call, so a recompute in backward never appends twice.
            if router_logits is not None and logits is not None:
                router_logits.append(logits)
        return self.norm(x)

    def _attention_masks(self, layout: PackedLayout, positions: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's [W, W] attention mask over the packed row `layout` describes: built once per distinct
        sliding window and shared by the layers that have it (and, as plain tensors, passed through checkpoint)."""
        by_window: dict[int | None, torch.Tensor] = {}
        masks = []
        for layer in self.layers:
            window = layer.self_attn.sliding_window
            if window not in by_window:
                by_window[window] = document_attention_mask(layout.document, layout.sequence, positions, window)
            masks.append(by_window[window])
        return masks


class CausalLM(nn.Module):
    """Decoder-only LM over right-padded batches (padding only follows real tokens, so causal attention alone
    keeps it from influencing them and no attention mask is taken) or over packed rows: one row holding several
    sequences back to back, laid out as `segments` describe (python `Segments`, or a `PackedLayout` of tensors,
    rlpipe/models/packing.py), with position ids restarting at each."""

    def __init__(self, config: ModelArchitecture) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        # Tied models have no lm_head at all, so state_dict() matches HF checkpoints, which omit it.
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fresh weights as HF initialises them: N(0, initializer_range) matrices, zero biases, unit norms."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            if isinstance(module, (Experts, TopKRouter)):
                for param in module.parameters(recurse=False):
                    param.normal_(0.0, std)

    @property
    def architecture(self) -> ModelArchitecture:
        """What the run's plumbing reads of any model it trains (rlpipe/models/transformers_lm.py has the same)."""
        return self.config

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """learner.activation_checkpointing (see DecoderStack)."""
        self.model.activation_checkpointing = enabled

    def set_kernels(self, rmsnorm: str = "torch", attention: str = "torch", experts: str = "torch") -> CausalLM:
        """Choose the implementation of the ops that have several (rlpipe/kernels; config `model.kernels`)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.impl = rmsnorm
            if isinstance(module, Attention):
                module.impl = attention
            if isinstance(module, Experts):
                module.impl = experts
        return self

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segments: Segments | PackedLayout | None = None,
        router_logits: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, T, H], the input of the output projection. With `segments` (B = 1) the row
        is packed: several sequences, or continuations of a shared prefix, back to back, with `position_ids` giving
        each token's position in its own sequence. `segments` is either the python `Segments` (attention runs
        block by block; a compiled graph specialises on them) or a `PackedLayout` (rlpipe/models/packing.py: attention
        runs over the whole row, with the torch implementation under a [W, W] mask built from its tensors, with
        the Pallas kernel by its document ids; a compiled graph depends on W alone; padding attends only to
        padding). With a `router_logits` list, every mixture-of-experts layer appends its router logits
        [B * T, experts] to it, in layer order."""
        return self.model(input_ids, position_ids, segments, router_logits)

    def output_embedding(self) -> torch.Tensor:
        """The output projection's weight [V, H]: lm_head, or the input embedding when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] for token ids [B, T]; position_ids default to 0..T-1 for every row."""
        return F.linear(self.hidden_states(input_ids, position_ids), self.output_embedding())
