"""The optional packages behind data sources (reasoning-gym, HumanEval, verifiers): imported on use, or one line
naming the extra that installs them. It imports only rlpipe.config, so data.py and verifiers_env.py both use it."""

from __future__ import annotations

import importlib

from rlpipe.config.errors import ConfigError


def optional_source(module: str, source: str, extra: str):
    """The package behind an optional data source, or one line naming the extra that installs it."""
    package = module.partition(".")[0]
    try:
        importlib.import_module(package)  # the package first: a submodule imported already would hide its absence
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != package and not (err.name or "").startswith(f"{package}."):
            raise  # the package is there but something it imports is not: its own error says what
        raise ConfigError(
            f"data.source: {source} needs the {extra!r} extra, which is not installed: pip install 'rlpipe[{extra}]'"
        ) from None
