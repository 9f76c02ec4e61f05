"""The scorer role's memory (a host's RAM): each model's weights in scorer.dtype — reward models and judges — and
what it holds to score: one forward pass of scorer.batch_size samples of the run's longest sequence for a reward
model (the hidden states of a layer and, as eager attention holds them, its attention scores), a judge engine's KV
cache (scorer.kv_cache_gib). Read from the models' config.json and safetensors headers, where their folders are here
(a built-in model once converted, a Hub id once in the Hugging Face cache). A distillation teacher counts as a judge:
its weights and its engine's KV cache."""

from __future__ import annotations

import json
import math

from rlpipe.config import Config
from rlpipe.plan.model_size import local_model_folder
from rlpipe.plan.parts import DTYPE_BYTES, GIB, MemoryItem, Peak
from rlpipe.rewards.specs import JUDGE, is_model_reward, model_reward_name


def scorer_peak(cfg: Config) -> Peak | None:
    """The scorer actor's peak, or None where no entry of reward.functions is scored by a model."""
    models = {}  # folder or Hub id -> whether a judge serves it
    for function in cfg.reward.functions:
        if is_model_reward(function.name):
            models.setdefault(function.name, False)
        elif function.name == JUDGE and isinstance(function.kwargs.get("model"), str):
            models[function.kwargs["model"]] = True
    if cfg.algo.distill_teacher is not None:  # a vLLM engine, as a judge's
        models[cfg.algo.distill_teacher] = True
    if not models:
        return None
    dtype_bytes = DTYPE_BYTES[cfg.scorer.dtype]
    batch, tokens = cfg.scorer.batch_size, cfg.longest_sequence
    parts, unread, activations = [], [], 0.0
    for name, judged in models.items():
        folder = local_model_folder(name)
        if not (folder / "config.json").is_file():
            unread.append(name)
            continue
        from rlpipe.models.checks import stored_tensors

        params = sum(math.prod(tensor.shape) for tensor in stored_tensors(folder).values())
        parts.append(MemoryItem(f"weights:{name}", f"{model_reward_name(name)} weights", params * dtype_bytes))
        if judged:
            parts.append(MemoryItem(f"kv_cache:{name}", f"{model_reward_name(name)} KV cache (vLLM engine)",
                                    cfg.scorer.kv_cache_gib * GIB))
            continue
        config = json.loads((folder / "config.json").read_text())
        text = config.get("text_config", config)
        hidden = text.get("hidden_size", 0)
        width = 2 * hidden + text.get("intermediate_size", 4 * hidden)
        scores = text.get("num_attention_heads", 0) * tokens * tokens
        activations = max(activations, batch * (tokens * width + scores) * dtype_bytes)
    if activations:
        parts.append(MemoryItem("activations", f"one forward of {batch} x {tokens} tokens (at most)", activations))
    missing = "a CPU host's RAM; nothing here states its limit"
    if unread:
        missing += f"; not counted: {', '.join(unread)} (not here yet: no folder, converted model or cached snapshot)"
    return Peak("scorer_host", "the scorer's host RAM", "scorer host RAM (models that score, one batch)", tuple(parts),
                None, missing=missing)
