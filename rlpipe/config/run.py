"""The `run` section: the run's name, where its outputs go, its seed."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlpipe.config.errors import require
from rlpipe.config.keys import key


@dataclass
class RunConfig:
    name: str = key("grpo", "run name; outputs go to <output_dir>/<name>")
    output_dir: str = key("runs", "parent directory of run directories")
    seed: int = key(0, "seed for the sampler, the learner and the rollout engine")
    overwrite: bool = key(False, "allow reusing a run directory that already holds metrics")
    verbose: bool = key(
        False, "also show vLLM, Ray and transformers INFO on the terminal (always in <run_dir>/logs/run.log)"
    )

    def check(self) -> None:
        require(
            _is_folder_name(self.name),
            f"run.name: {self.name!r} must be one folder name inside run.output_dir (no '/', not '.' or '..'); "
            "group runs with run.output_dir instead",
        )


def _is_folder_name(name: str) -> bool:
    """A single path component: the run directory stays a child of run.output_dir, which an overwrite may empty."""
    return name not in ("", ".", "..") and "/" not in name and os.sep not in name and "\0" not in name
