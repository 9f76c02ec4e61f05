"""Which model class builds which Hugging Face model_type."""

from collections.abc import Callable

from rlpipe.models.architecture import MODEL_TYPES as LLAMA_FAMILY_TYPES
from rlpipe.models.architecture import ModelArchitecture
from rlpipe.models.llama import CausalLM


def _build_llama_family(hf_config: dict) -> CausalLM:
    return CausalLM(ModelArchitecture.from_hf(hf_config))


MODEL_BUILDERS: dict[str, Callable[[dict], CausalLM]] = {
    model_type: _build_llama_family for model_type in LLAMA_FAMILY_TYPES
}

# For config.json files that name the architecture but omit model_type.
ARCHITECTURE_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def model_type_of(hf_config: dict) -> str | None:
    if hf_config.get("model_type"):
        return hf_config["model_type"]
    for architecture in hf_config.get("architectures") or []:
        if architecture in ARCHITECTURE_MODEL_TYPES:
            return ARCHITECTURE_MODEL_TYPES[architecture]
    return None


def model_architecture(hf_config: dict) -> ModelArchitecture:
    """The model's shapes and settings as rlpipe reads a Hugging Face config.json dict (no weights)."""
    model_type = _checked_model_type(hf_config)
    return ModelArchitecture.from_hf({**hf_config, "model_type": model_type})


def _checked_model_type(hf_config: dict) -> str:
    model_type = model_type_of(hf_config)
    supported = ", ".join(sorted(MODEL_BUILDERS))
    if model_type is None:
        raise ValueError(
            f"config has no model_type and no known architecture ({hf_config.get('architectures')}); "
            f"supported model types: {supported}"
        )
    if model_type not in MODEL_BUILDERS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported}")
    return model_type


def build_model(hf_config: dict) -> CausalLM:
    """A freshly initialised model for a Hugging Face config.json dict. Build it under `torch.device("meta")`
    to get the module tree without allocating weights."""
    model_type = _checked_model_type(hf_config)
    return MODEL_BUILDERS[model_type]({**hf_config, "model_type": model_type})
