"""Model definitions whose state-dict names equal Hugging Face's, and HF folder I/O (safetensors only)."""

from rlpipe.models.hf import (
    load_model,
    load_model_weights,
    load_state_dict,
    read_hf_config,
    save_state_dict,
)
from rlpipe.models.architecture import ModelArchitecture
from rlpipe.models.llama import CausalLM
from rlpipe.models.registry import build_model

__all__ = [
    "CausalLM",
    "ModelArchitecture",
    "build_model",
    "load_model",
    "load_model_weights",
    "load_state_dict",
    "read_hf_config",
    "save_state_dict",
]
