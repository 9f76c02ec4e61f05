"""Models of the families rlpipe's decoder does not implement, run by transformers' own modeling code
(`model.impl: transformers`, or `auto` for such a family): `AutoModelForCausalLM` with rlpipe's model interface added.

The module tree is transformers' own, so its parameter names are the checkpoint's and vLLM's loaders' (the weight
sync and checkpoints use them as they are). It is built with its parameters on `meta` and its buffers (RoPE tables,
embedding scales: computed, never stored) on the host, then loaded as rlpipe's models are, a rank reading only its
rows (rlpipe/models/hf.py `CheckpointWeights`). The learner reads log-probs through rlpipe's chunked kernel on the
final hidden states (`hidden_states` + `output_embedding`), so no [tokens, vocabulary] logits tensor exists.

Packed rows (learner.packing) reach transformers as position ids that restart at each sequence, from which its
masking builds the block-diagonal causal mask (`find_packed_sequence_indices`): no token attends across sequences.
A GRPO group's shared prompt (learner.share_prompts) needs a mask position ids cannot express, so these models run
each sequence whole (rlpipe/training/forward.py). The captured step (learner.graph) and the Pallas kernels are
rlpipe's decoder's alone and are refused for these models before anything starts.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from rlpipe.models.architecture import ModelArchitecture, transformers_config


class TransformersLM:
    """rlpipe's model interface on a transformers causal LM (mixed into its class by `build_transformers_model`)."""

    architecture: ModelArchitecture

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segments=None,
        router_logits: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, T, H] of right-padded rows, or of one packed row whose sequences stand alone
        (`segments` as rlpipe/models/packing.py's `pack` gives them, `position_ids` restarting at each)."""
        if segments is not None and (not isinstance(segments, tuple) or any(len(block) != 1 for block in segments)):
            raise ValueError("a transformers model runs packed sequences whole: shared prompts and tensor layouts "
                             "(learner.share_prompts, learner.graph) are rlpipe's decoder's")
        output = self.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return output.last_hidden_state

    def output_embedding(self) -> torch.Tensor:
        """The output projection's weight [V, H] (the input embedding where the two are tied)."""
        return self.get_output_embeddings().weight

    def set_kernels(self, rmsnorm: str = "torch", attention: str = "torch", experts: str = "torch"):
        chosen = {"rmsnorm": rmsnorm, "attention": attention}
        other = {name: impl for name, impl in chosen.items() if impl != "torch"}
        if other:
            name, impl = next(iter(other.items()))
            raise ValueError(f"model.kernels.{name}: {impl} runs in rlpipe's own model code only; a model transformers "
                             "runs (model.impl) uses torch")
        return self

    def state_dict(self, *args, **kwargs):
        """transformers' state dict without the second name of a tied parameter (lm_head.weight of a model whose
        output projection is its input embedding): the names a checkpoint folder holds, as rlpipe's models give them."""
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        seen: set[int] = set()
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                state.pop(prefix + name, None)
            seen.add(id(param))
        return state

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """learner.activation_checkpointing: transformers' gradient checkpointing of each decoder layer."""
        if enabled:
            self.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self.is_gradient_checkpointing:
            self.gradient_checkpointing_disable()


@functools.cache
def _with_interface(model_class: type) -> type:
    return type(model_class.__name__, (TransformersLM, model_class), {"__module__": model_class.__module__})


def build_transformers_model(hf_config: dict, architecture: ModelArchitecture) -> nn.Module:
    """transformers' causal LM for `hf_config`, with rlpipe's interface, in float32 (the learner casts as its dtype
    says): parameters on `meta` (the caller loads them, as rlpipe's models are loaded), buffers computed on the
    host."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = transformers_config(hf_config)
    # Attention through torch's SDPA, for which transformers builds a packed row's masks from its position ids.
    config._attn_implementation = "sdpa"
    try:
        with torch.device("cpu"), init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, TypeError, ImportError, NotImplementedError) as err:
        first = " ".join(str(err).split()).split(". ")[0]
        raise ValueError(f"transformers cannot build model_type {hf_config['model_type']!r} for the learner ({first})"
                         ) from None
    model.tie_weights()  # again: the empty-weights context gave each name a parameter of its own
    model.__class__ = _with_interface(type(model))
    model.architecture = architecture
    return model
