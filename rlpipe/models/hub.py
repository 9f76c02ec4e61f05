"""Models named by their Hugging Face Hub id: `Qwen/Qwen3-0.6B`, or `Qwen/Qwen3-0.6B@REVISION` (a branch, tag or
commit), resolved before anything starts to a snapshot folder of huggingface_hub's cache (HF_HUB_CACHE, by default
~/.cache/huggingface/hub) — downloaded there when missing, unless the Hub is off limits (HF_HUB_OFFLINE=1), where
only what is cached counts and a missing model is one line with the `hf download` command that fetches it.

Only what rlpipe reads is downloaded: config and tokenizer files and safetensors weights (never .bin/.pth copies
of the same weights, which many repositories also hold). Everything after this works on the folder it returns, as
on any local Hugging Face folder; checkpoints record that folder (its commit is in its path).
"""

from __future__ import annotations

import os

from rlpipe.config import ConfigError, one_line

# The files of a model repository that rlpipe reads: config.json, generation_config.json, the tokenizer
# (tokenizer.json / tokenizer_config.json / vocab.json / merges.txt / tokenizer.model / *.tiktoken, a chat template
# file) and the safetensors weights with their index.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_TRUE = {"1", "ON", "YES", "TRUE"}


def parse_hub_id(path: str) -> tuple[str, str | None] | None:
    """(repository, revision or None) when `path` reads as a Hub model id `org/name[@revision]`, else None. A local
    path is never one: check that it exists first."""
    if not path or path.startswith(("/", ".", "~")) or "\\" in path:
        return None
    repo, at, revision = path.partition("@")
    if repo.count("/") != 1 or (at and not revision):
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return repo, revision or None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, looked up now (its own constant is read once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return value.upper() in _TRUE if value is not None else bool(constants.HF_HUB_OFFLINE)


def download_command(repo: str, revision: str | None) -> str:
    return f"hf download {repo}" + (f" --revision {revision}" if revision else "")


def resolve_hub_model(path: str, key: str = "model.path", cached_only: bool = False) -> str | None:
    """The local snapshot folder of Hub id `path`; None when `path` is not a Hub id, or (`cached_only`) not cached.
    Raises a one-line ConfigError naming `key` when the model cannot be had."""
    parsed = parse_hub_id(path)
    if parsed is None:
        return None
    repo, revision = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = cached_only or hub_offline()
    cache = os.environ.get("HF_HUB_CACHE") or None  # read now, like HF_HUB_OFFLINE; else huggingface_hub's default
    try:
        return snapshot_download(
            repo, revision=revision, cache_dir=cache, allow_patterns=HUB_FILES, local_files_only=offline
        )
    except LocalEntryNotFoundError as err:  # also a cached snapshot known to be incomplete
        if cached_only:
            return None
        where = "with HF_HUB_OFFLINE=1" if offline else f"and the Hub cannot be reached ({_cause(err)})"
        raise ConfigError(
            f"{key}: {path} is not a folder here, nor in the Hugging Face cache {where}; fetch it first: "
            f"{download_command(repo, revision)}"
        ) from None
    except GatedRepoError:
        raise ConfigError(
            f"{key}: {repo} is gated on the Hugging Face Hub: accept its terms on the Hub, then log in (hf auth login) "
            f"or set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"{key}: {repo} has no revision {revision!r} on the Hugging Face Hub") from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key}: {path} is not a folder here, nor a model on the Hugging Face Hub (a private one needs HF_TOKEN)"
        ) from None
    except Exception as err:  # a download cut off, a full disk, an unusable cache folder: huggingface_hub's own types
        raise ConfigError(f"{key}: cannot fetch {path} from the Hugging Face Hub: {one_line(err)}") from None


def _cause(err: BaseException) -> str:
    cause = err.__cause__ or err.__context__
    return type(cause).__name__ if cause is not None else "no connection"
