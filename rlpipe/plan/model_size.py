"""The model's sizes the plan counts with (`ModelSize`): parameter counts, tensor shapes, the Linears LoRA can target
and activations per token, from the Hugging Face `config.json` rlpipe's model classes read (`model.path`'s folder
when it exists here, or a Hub id's snapshot in the Hugging Face cache, else `configs/models/<basename of
model.path>.json`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from rlpipe.config import ConfigError, recipes_dir
from rlpipe.config.learner import is_targeted
from rlpipe.models.architecture import ModelArchitecture
from rlpipe.models.registry import model_architecture, model_type_of

MODELS_DIR = recipes_dir() / "models"


@dataclass
class ModelSize(ModelArchitecture):
    """A model as rlpipe's model classes read its Hugging Face config.json (`ModelArchitecture`, rlpipe/models,
    families' defaults included), with what the arithmetic adds: its name, its model_type, the dtype its files hold,
    and the counts and shapes derived from them."""

    name: str = "model"
    model_type: str = ""
    stored_dtype: str = "float32"  # the dtype config.json says the safetensors hold ("dtype" / "torch_dtype")

    @classmethod
    def from_hf(cls, hf: dict, name: str = "model") -> ModelSize:
        """The architecture rlpipe's model classes read from `hf`, named."""
        config = model_architecture(hf)
        return cls(
            **{f.name: getattr(config, f.name) for f in fields(config)},
            name=name,
            model_type=model_type_of(hf),
            stored_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )

    @property
    def moe_layer_count(self) -> int:
        """How many of the layers have the MoE block (the others a dense MLP)."""
        return len(self.moe_layers)

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
        o = self.q_dim * h + (h if self.o_proj_bias else 0)
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
        return self.hidden_size * self.num_experts + experts * self._mlp_params(self.moe_intermediate_size)

    def layer_params(self, moe: bool, active: bool = False) -> int:
        mlp = self.moe_params(self.experts_per_token if active else self.num_experts) if moe else self.dense_mlp_params
        return self.attention_params + mlp + 2 * self.hidden_size  # + input/post-attention RMSNorm

    def _total(self, active: bool) -> int:
        dense_layers = self.num_layers - self.moe_layer_count
        layers = dense_layers * self.layer_params(False) + self.moe_layer_count * self.layer_params(True, active)
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
        layer = self.layer_params(self.moe_layer_count > 0)
        return max(layer, self.embedding_params, self.output_params)

    @property
    def tensor_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of every kind of weight matrix the model holds (the learner's names: experts stacked)."""
        h, vocab = self.hidden_size, self.vocab_size
        shapes = [(vocab, h), (self.q_dim, h), (self.kv_dim, h), (h, self.q_dim)]
        if not self.tie_word_embeddings:
            shapes.append((vocab, h))
        if self.moe_layer_count < self.num_layers:
            shapes += [(self.intermediate_size, h), (h, self.intermediate_size)]
        if self.moe_layers:
            experts, inner = self.num_experts, self.moe_intermediate_size
            shapes += [(experts, h), (experts, 2 * inner, h), (experts, h, inner)]
        return tuple(shapes)

    @property
    def linear_layers(self) -> tuple[tuple[str, int, int], ...]:
        """(module name, in features, out features) of every nn.Linear of the learner's model (rlpipe/models): the
        layers learner.lora can target. Experts are stacked tensors and the router a plain weight, not Linears."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        moe = set(self.moe_layers)
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
            k, expert = self.experts_per_token, self.moe_intermediate_size
            total += a * (self.num_experts + k * (2 * h + 4 * expert))
        else:
            total += a * 4 * self.intermediate_size
        return total

    def describe(self) -> str:
        kind = (
            f"MoE {self.num_experts} experts, top-{self.experts_per_token} x {self.moe_intermediate_size}"
            if self.num_experts
            else f"MLP {self.intermediate_size}"
        )
        active = f", {self.active_params / 1e9:.2f} B active" if self.num_experts else ""
        return (
            f"{self.params / 1e9:.2f} B parameters{active}; {self.num_layers} layers, hidden {self.hidden_size}, "
            f"{self.num_heads} q / {self.num_kv_heads} kv heads x {self.head_dim}, {kind}, vocab {self.vocab_size}"
            f"{' (tied)' if self.tie_word_embeddings else ''}"
        )


def local_model_folder(model_path: str) -> Path:
    """Where the folder `model_path` names is, or would be, here: a built-in model's in the cache (converted there by
    the first run), a Hub id's snapshot where the Hugging Face cache holds one (nothing is fetched), else the path."""
    if model_path.startswith("builtin:"):
        from rlpipe.models.builtin import cache_dir

        return cache_dir() / "models" / model_path.removeprefix("builtin:")
    local = Path(model_path).expanduser()
    if not (local / "config.json").is_file():
        from rlpipe.models.hub import resolve_hub_model

        cached = resolve_hub_model(model_path, cached_only=True)
        local = Path(cached) if cached else local
    return local


def architecture_source(model_path: str) -> Path:
    """The config.json the plan reads for `model.path`."""
    name = model_path.rstrip("/").rsplit("/", 1)[-1].removeprefix("builtin:").partition("@")[0]
    local = local_model_folder(model_path) / "config.json"
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
