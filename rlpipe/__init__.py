"""rlpipe: GRPO post-training for language models, orchestrated by Ray.

The checkout keeps the Ray actors, the rewards, the benchmarks and the recipes in top-level folders (actors/,
rewards/, bench/, configs/), but they are parts of this package: this folder holds a relative symbolic link to each
(rlpipe/actors -> ../actors, ...), so they are rlpipe.actors, rlpipe.rewards, rlpipe.bench and rlpipe/configs/
wherever this folder is found: installed from a wheel (which holds the files themselves), `pip install -e .`, a
checkout on PYTHONPATH or a Ray job whose working_dir is the checkout. Found through this package, nothing of a
user's (a rewards.py beside a recipe, a package named actors) can stand in for them.

From Python (rlpipe/api.py): `rlpipe.train(recipe, reward_funcs=[...], **overrides)` runs post-training and returns
its summary, `rlpipe.load_config(recipe, **overrides)` returns the checked `rlpipe.Config`. They are imported on
first use, so `import rlpipe` stays cheap (no torch, vLLM or Ray).
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

if _TYPE_CHECKING:
    from rlpipe.api import load_config, train
    from rlpipe.config import Config

__all__ = ["Config", "load_config", "train"]


def __getattr__(name: str):
    if name in ("train", "load_config"):
        from rlpipe import api

        return getattr(api, name)
    if name == "Config":
        from rlpipe.config import Config

        return Config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
