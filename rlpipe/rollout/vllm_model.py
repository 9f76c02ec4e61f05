"""rlpipe's decoder as a vLLM model (`rollout.model_impl: rlpipe`): the rollout engine runs the learner's own code.

vLLM keeps what only it can do — the paged KV cache and its attention kernels over it, scheduling, sampling —
while the embeddings, norms, rotary embedding, q/k/v/o projections, MLP and output projection are the modules of
`rlpipe.models.CausalLM`, with the same Hugging Face parameter names. Differences between the engine's log-probs
and the learner's then come from attention alone (and batching), which is what the agreement benchmark measures.
The norms and expert matmuls run the kernels `model.kernels` names, so a `pallas` choice runs the same Pallas
kernel in the engine as in the learner.

Registered with vLLM under ARCHITECTURE by `register()`: called in-process by the rollout engine, and in vLLM's
worker processes through the `vllm.general_plugins` entry point. The engine selects it, and the kernels, with
`hf_overrides=engine_overrides(...)`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from rlpipe.kernels import register_torchtpu_ops
from rlpipe.models.architecture import ModelArchitecture
from rlpipe.models.llama import CausalLM
from rlpipe.models.moe import stack_expert_weights
from rlpipe.models.registry import model_type_of
from rlpipe.rollout.vllm_worker import vllm_platform

ARCHITECTURE = "RlpipeForCausalLM"
# The engine's hf_overrides entry carrying `model.kernels.rmsnorm` / `.experts` to the model's constructor.
KERNELS_KEY = "rlpipe_kernels"
# Checkpoint entries that are not parameters (rotary tables some exporters write).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def engine_overrides(rmsnorm: str = "torch", experts: str = "torch") -> dict:
    """vLLM's `hf_overrides` for an engine that runs this model with these kernels (`model.kernels`)."""
    return {"architectures": [ARCHITECTURE], KERNELS_KEY: {"rmsnorm": rmsnorm, "experts": experts}}


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, RlpipeForCausalLM)


class RlpipeForCausalLM(CausalLM):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from vllm.model_executor.layers.attention import Attention

        hf_config = vllm_config.model_config.hf_config.to_dict()
        super().__init__(ModelArchitecture.from_hf({**hf_config, "model_type": model_type_of(hf_config)}))
        self.set_kernels(**hf_config.get(KERNELS_KEY, {}))  # attention stays vLLM's (the paged KV cache)
        if vllm_platform() == "torchtpu":  # vLLM compiles the model there, and cannot trace a kernel's registration
            register_torchtpu_ops()
        for index, layer in enumerate(self.model.layers):
            attention = layer.self_attn
            # Named so that the module path equals the prefix vLLM binds this layer's KV cache under.
            attention.attn = Attention(
                self.config.num_heads,
                self.config.head_dim,
                self.config.head_dim**-0.5,
                num_kv_heads=self.config.num_kv_heads,
                cache_config=vllm_config.cache_config,
                per_layer_sliding_window=attention.sliding_window,
                prefix=f"{prefix}model.layers.{index}.self_attn.attn",
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden] for vLLM's flattened batch (all sequences' tokens end to end)."""
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        tokens = x.shape[0]
        cos, sin = self.model.rotary_emb(positions[None], x.dtype)
        for layer in self.model.layers:
            q, k, v = layer.self_attn.rotated_qkv(layer.input_layernorm(x)[None], cos, sin)
            flat = [t[0].transpose(0, 1).reshape(tokens, -1) for t in (q, k, v)]
            x = x + layer.self_attn.o_proj(layer.self_attn.attn(*flat))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.output_embedding())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Through each parameter's `weight_loader`, as vLLM's own models load: its in-place reload swaps in
        loaders that buffer a layer's tensors and apply them once the layer is complete."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded = set()
        per_expert = {}  # checkpoint files hold experts one by one; the model holds them stacked

        def load(name: str, tensor: torch.Tensor) -> None:
            if name not in params:
                raise KeyError(f"rlpipe model in vLLM: checkpoint tensor {name!r} has no parameter here")
            getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor)
            loaded.add(name)

        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue  # a tied model's lm_head is its embedding
            if ".mlp.experts." in name and name.partition(".mlp.experts.")[2][:1].isdigit():
                per_expert[name] = tensor
                continue
            load(name, tensor)
        for name, tensor in stack_expert_weights(per_expert, self.config.num_experts).items():
            load(name, tensor)
        return loaded
