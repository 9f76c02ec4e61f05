"""rlpipe: GRPO post-training for language models, orchestrated by Ray.

The checkout keeps the Ray actors, the rewards and the benchmarks in top-level folders (actors/, rewards/, bench/),
but they are parts of this package: installed (a wheel, or `pip install -e .`), pyproject.toml's package-dir
mapping makes them rlpipe.actors, rlpipe.rewards and rlpipe.bench, so that nothing of a user's (a rewards.py beside
a recipe, a package named actors) can stand in for them. Run straight from a checkout (PYTHONPATH, a Ray job whose
working_dir is the checkout) nothing installs that mapping, so this module does: those three names resolve to the
folders beside this very rlpipe/ folder, never to a same-named package elsewhere on sys.path.

From Python (rlpipe/api.py): `rlpipe.train(recipe, reward_funcs=[...], **overrides)` runs post-training and returns
its summary, `rlpipe.load_config(recipe, **overrides)` returns the checked `rlpipe.Config`. They are imported on
first use, so `import rlpipe` stays cheap (no torch, vLLM or Ray).
"""

import os as _os
import sys as _sys
from typing import TYPE_CHECKING as _TYPE_CHECKING

if _TYPE_CHECKING:
    from rlpipe.api import load_config, train
    from rlpipe.config import Config

__all__ = ["Config", "load_config", "train"]

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_CHECKOUT_PARTS = ("actors", "rewards", "bench")


class _CheckoutParts:
    """A meta-path finder for rlpipe.<part> where <part> lives beside rlpipe/ rather than inside it."""

    def __init__(self, folders: dict[str, str]):
        self.folders = folders

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        from importlib.util import spec_from_file_location

        return spec_from_file_location(
            fullname, _os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )


def _map_checkout_parts() -> None:
    root = _os.path.dirname(_HERE)
    folders = {
        f"{__name__}.{part}": _os.path.join(root, part)
        for part in _CHECKOUT_PARTS
        if not _os.path.isdir(_os.path.join(_HERE, part))  # installed from a wheel: the part is inside rlpipe/
        and _os.path.isfile(_os.path.join(root, part, "__init__.py"))
    }
    if folders and not any(getattr(finder, "folders", None) == folders for finder in _sys.meta_path):
        # First, ahead of an editable install's finder: this rlpipe's own parts, whichever checkout that names.
        _sys.meta_path.insert(0, _CheckoutParts(folders))


_map_checkout_parts()


def __getattr__(name: str):
    if name in ("train", "load_config"):
        from rlpipe import api

        return getattr(api, name)
    if name == "Config":
        from rlpipe.config import Config

        return Config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
