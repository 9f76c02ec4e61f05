"""The architecture of a Llama-family model (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE): `ModelArchitecture`, the
shapes and settings rlpipe's decoder (rlpipe/models/llama.py) is built from, read from a Hugging Face config.json dict
with each family's defaults, as transformers reads it. Plain data: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# HF fills these from the config class when config.json omits them; the values differ per family.
_DEFAULT_MAX_POSITION_EMBEDDINGS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768, "qwen3_moe": 32768}
# Qwen3-MoE's config class defaults, used when config.json omits a key (as transformers does).
_QWEN3_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
_QWEN3_FAMILY = ("qwen3", "qwen3_moe")
_QWEN3_DEFAULT_HEAD_DIM = 128
_SILU_NAMES = ("silu", "swish")  # HF's ACT2FN maps both names to SiLU
_REQUIRED_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


@dataclass
class ModelArchitecture:
    """Architecture of one Llama-family model; `from_hf` reads it from a Hugging Face config.json dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None  # None: plain multi-head attention (as many kv heads as query heads)
    head_dim: int | None = None  # None: hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE, else HF's scaling parameters with a "rope_type", e.g. {"rope_type": "linear", "factor": 2.0}
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # One of FULL_ATTENTION / SLIDING_ATTENTION per layer; empty means every layer attends to the full prefix.
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    # Mixture of experts (0 experts: dense). Layer i has the sparse MLP when i is not in mlp_only_layers and
    # (i + 1) is a multiple of decoder_sparse_step, as in transformers' Qwen3-MoE; other layers keep the dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Weight of the load-balancing loss in training; transformers adds it only with output_router_logits, so a
    # config without that flag reads as 0. A training setting, not architecture, hence left out of comparisons.
    router_aux_loss_coef: float = field(default=0.0, compare=False)
    # Only shapes fresh (untrained) weights, so two configs describing the same architecture compare equal.
    initializer_range: float = field(default=0.02, compare=False)
    # Whose code the model runs: rlpipe's decoder (rlpipe/models/llama.py), or transformers' for a family rlpipe does
    # not implement (`from_transformers`: only the shapes the run's plumbing reads are kept).
    implementation: str = "rlpipe"

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if not self.layer_types:
            self.layer_types = (FULL_ATTENTION,) * self.num_layers
        self.layer_types = tuple(self.layer_types)
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") == "default":
            self.rope_scaling = None
        if self.implementation == "transformers":  # transformers' code checks its own settings
            return

        if self.hidden_act not in _SILU_NAMES:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}: only 'silu' is implemented")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown_layer_types = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown_layer_types:
            raise ValueError(f"unsupported layer types {sorted(unknown_layer_types)}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        _validate_rope_scaling(self.rope_scaling)
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), got {self.experts_per_token}"
                )
            if self.moe_intermediate_size < 1:
                raise ValueError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def is_moe_layer(self, layer_index: int) -> bool:
        return (
            self.num_experts > 0
            and layer_index not in self.mlp_only_layers
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(index for index in range(self.num_layers) if self.is_moe_layer(index))

    @classmethod
    def from_hf(cls, hf_config: dict) -> ModelArchitecture:
        """Read a Hugging Face config.json dict, in the transformers 5 layout (`rope_parameters`) or the older
        one (top-level `rope_theta` + `rope_scaling`)."""
        model_type = hf_config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")

        def required(key: str):
            if hf_config.get(key) is None:
                raise ValueError(f"{model_type} config is missing {key!r}")
            return hf_config[key]

        hidden_size = required("hidden_size")
        num_heads = required("num_attention_heads")
        num_layers = required("num_hidden_layers")
        max_position_embeddings = hf_config.get(
            "max_position_embeddings", _DEFAULT_MAX_POSITION_EMBEDDINGS[model_type]
        )
        default_head_dim = _QWEN3_DEFAULT_HEAD_DIM if model_type == "qwen3" else hidden_size // num_heads
        moe = _moe_settings(hf_config) if model_type == "qwen3_moe" else {}
        rope_theta, rope_scaling = _rope_settings(hf_config, max_position_embeddings)
        attention_bias = bool(hf_config.get("attention_bias", False))
        sliding_window, layer_types = _attention_windows(hf_config, model_type, num_layers)

        return cls(
            vocab_size=required("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=required("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
            head_dim=hf_config.get("head_dim") or default_head_dim,
            rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes biases on q/k/v only; Llama and Qwen3 put `attention_bias` on all four projections.
            qkv_bias=model_type == "qwen2" or (model_type in ("llama", *_QWEN3_FAMILY) and attention_bias),
            o_proj_bias=model_type in ("llama", *_QWEN3_FAMILY) and attention_bias,
            mlp_bias=model_type == "llama" and bool(hf_config.get("mlp_bias", False)),
            qk_norm=model_type in _QWEN3_FAMILY,
            sliding_window=sliding_window,
            layer_types=layer_types,
            hidden_act=hf_config.get("hidden_act", "silu"),
            initializer_range=hf_config.get("initializer_range", 0.02),
            **moe,
        )


# A family's logits transformed after the output projection, which rlpipe's log-prob kernels (a plain projection
# divided by the temperature) do not apply: config key -> the value that leaves the logits alone.
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logits_scaling": 1.0, "logit_scale": 1.0}


def transformers_config(hf_config: dict):
    """transformers' config object of a config.json dict: its model_type's config class, whose defaults fill what
    the file omits."""
    from transformers import AutoConfig

    return AutoConfig.for_model(hf_config["model_type"], **{k: v for k, v in hf_config.items() if k != "model_type"})


def transformers_architecture(hf_config: dict) -> ModelArchitecture:
    """The shapes of a decoder-only text model that transformers implements and rlpipe's decoder does not, read
    through transformers' config class for its model_type (whose defaults fill what config.json omits). Raises
    ValueError in one line for a model transformers cannot run as a causal LM or that rlpipe's learner cannot train
    through it (mixture of experts; logits transformed after the projection)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = hf_config.get("model_type")
    try:
        config = transformers_config(hf_config)
    except (ValueError, KeyError) as err:
        raise ValueError(f"unsupported model_type {model_type!r}: neither rlpipe's model code "
                         f"({', '.join(MODEL_TYPES)}) nor transformers knows it ({' '.join(str(err).split())[:160]})"
                         ) from None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or config.get_text_config() is not config:
        raise ValueError(f"model_type {model_type!r} is not a decoder-only text model transformers runs as a causal "
                         "LM (AutoModelForCausalLM)")
    experts = next((getattr(config, name) for name in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(config, name, None)), None)
    if experts:
        raise ValueError(f"model_type {model_type!r}: a mixture of experts ({experts} experts) runs only on rlpipe's "
                         "own model code (qwen3_moe)")
    for name, neutral in _LOGIT_TRANSFORMS.items():
        if getattr(config, name, neutral) not in (neutral, None):
            raise ValueError(f"model_type {model_type!r}: its {name} ({getattr(config, name)}) changes the logits "
                             "after the output projection, which rlpipe's log-prob kernels do not apply")
    heads = config.num_attention_heads
    return ModelArchitecture(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "intermediate_size", None) or 0,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 2048,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        hidden_act=str(getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or ""),
        initializer_range=getattr(config, "initializer_range", 0.02),
        implementation="transformers",
    )


def _moe_settings(hf_config: dict) -> dict:
    """The mixture-of-experts fields of a Qwen3-MoE config.json (transformers writes the expert count as
    `num_local_experts`, Qwen's own configs as `num_experts`)."""

    def setting(*keys: str):
        for key in keys:
            if hf_config.get(key) is not None:
                return hf_config[key]
        return _QWEN3_MOE_DEFAULTS[keys[0]]

    return dict(
        num_experts=setting("num_experts", "num_local_experts"),
        experts_per_token=setting("num_experts_per_tok"),
        moe_intermediate_size=setting("moe_intermediate_size"),
        norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
        decoder_sparse_step=hf_config.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(hf_config.get("mlp_only_layers") or ()),
        router_aux_loss_coef=(
            float(hf_config.get("router_aux_loss_coef", 0.001)) if hf_config.get("output_router_logits") else 0.0
        ),
    )


def _rope_settings(hf_config: dict, max_position_embeddings: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config.json layout, with HF's precedence and defaults."""
    # transformers 5 folds a legacy `rope_scaling` into `rope_parameters` and lets it win over an existing one.
    parameters = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
    if any(isinstance(value, dict) for value in parameters.values()):
        raise ValueError("per-layer-type rope parameters are not supported")
    partial_rotary_factor = parameters.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if partial_rotary_factor != 1.0:
        raise ValueError(f"partial_rotary_factor={partial_rotary_factor} is not supported")

    rope_theta = float(parameters.pop("rope_theta", None) or hf_config.get("rope_theta") or 10000.0)
    rope_type = parameters.pop("rope_type", None) or parameters.get("type") or "default"
    parameters.pop("type", None)
    parameters.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return rope_theta, None
    if rope_type in ("llama3", "yarn"):
        parameters.setdefault("original_max_position_embeddings", max_position_embeddings)
    if rope_type == "yarn" and parameters.get("factor") is None:
        parameters["factor"] = max_position_embeddings / parameters["original_max_position_embeddings"]
    return rope_theta, {"rope_type": rope_type, **parameters}


def _validate_rope_scaling(rope_scaling: dict | None) -> None:
    if rope_scaling is None:
        return
    rope_type = rope_scaling.get("rope_type")
    if rope_type == "dynamic":
        raise ValueError(
            "unsupported rope type 'dynamic': Hugging Face rescales it per batch while vLLM uses one fixed table, "
            "so learner and rollout log-probs would disagree"
        )
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    missing = [key for key in _REQUIRED_ROPE_KEYS.get(rope_type, ()) if rope_scaling.get(key) is None]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in its rope parameters")


def _attention_windows(hf_config: dict, model_type: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) the way each family's HF attention applies them."""
    window = hf_config.get("sliding_window")
    if (model_type == "mistral" or (model_type == "qwen3_moe" and hf_config.get("use_sliding_window"))) and window:
        return window, (SLIDING_ATTENTION,) * num_layers
    if model_type in ("qwen2", "qwen3") and hf_config.get("use_sliding_window") and window:
        layer_types = hf_config.get("layer_types") or [
            SLIDING_ATTENTION if index >= hf_config.get("max_window_layers", 28) else FULL_ATTENTION
            for index in range(num_layers)
        ]
        return window, tuple(layer_types)
    return None, (FULL_ATTENTION,) * num_layers

