"""Which model class builds which Hugging Face model_type: rlpipe's decoder for its own families, transformers'
AutoModelForCausalLM for the others (rlpipe/models/transformers_lm.py), as model.impl chooses."""

from collections.abc import Callable
from dataclasses import replace

from torch import nn

from rlpipe.models.architecture import MODEL_TYPES as LLAMA_FAMILY_TYPES
from rlpipe.models.architecture import ModelArchitecture, transformers_architecture
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


MODEL_IMPLS = ("auto", "rlpipe", "transformers")


def model_architecture(hf_config: dict) -> ModelArchitecture:
    """The model's shapes and settings as rlpipe reads a Hugging Face config.json dict (no weights): its own
    families' in full, another family's as transformers reads it (`transformers_architecture`)."""
    model_type = model_type_of(hf_config)
    if model_type is None:
        raise ValueError(
            f"config has no model_type and no known architecture ({hf_config.get('architectures')}); "
            f"supported model types: {', '.join(sorted(MODEL_BUILDERS))} and the causal LMs transformers knows"
        )
    if model_type not in MODEL_BUILDERS:
        return transformers_architecture({**hf_config, "model_type": model_type})
    return ModelArchitecture.from_hf({**hf_config, "model_type": model_type})


def implementation(hf_config: dict, impl: str = "auto") -> str:
    """Whose code runs the model (model.impl): rlpipe's for its own families under `auto`, transformers' for every
    other family and wherever `impl` asks for it. Raises ValueError in one line where `impl` asks for rlpipe's code
    for a family it does not have."""
    if impl not in MODEL_IMPLS:
        raise ValueError(f"model.impl: {impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    own = model_type_of(hf_config) in MODEL_BUILDERS
    if impl == "rlpipe" and not own:
        raise ValueError(f"model.impl: rlpipe has no model code for model_type {model_type_of(hf_config)!r} (it has "
                         f"{', '.join(sorted(MODEL_BUILDERS))}); use auto or transformers")
    return "rlpipe" if own and impl != "transformers" else "transformers"


def build_model(hf_config: dict, impl: str = "auto") -> nn.Module:
    """A freshly initialised model for a Hugging Face config.json dict, in the code `impl` chooses
    (`implementation`). Build it under `torch.device("meta")` to get the module tree without allocating weights."""
    if implementation(hf_config, impl) == "transformers":
        from rlpipe.models.transformers_lm import build_transformers_model

        architecture = model_architecture(hf_config)
        if architecture.num_experts:
            raise ValueError("model.impl: transformers: a mixture of experts runs on rlpipe's own model code only")
        return build_transformers_model(hf_config, replace(architecture, implementation="transformers"))
    model_type = model_type_of(hf_config)
    return MODEL_BUILDERS[model_type]({**hf_config, "model_type": model_type})
