"""The `eval` section: how often the held-out set (data.eval_size rows, data.eval_split or data.eval_path) is
evaluated during training, and how many sampled completions per prompt give mean@k and pass@k beside the greedy
accuracy (rlpipe/run/evaluation.py)."""

from __future__ import annotations

from dataclasses import dataclass

from rlpipe.config.errors import require
from rlpipe.config.keys import key
from rlpipe.config.rollout import MAX_TEMPERATURE


@dataclass
class EvalConfig:
    every: int = key(0, "evaluate the held-out set every this many steps (0: before and after training only)")
    samples_per_prompt: int = key(
        0, "k sampled completions per held-out prompt for mean@k and pass@k, beside the greedy one (0 or 1: greedy only)"
    )
    temperature: float | None = key(None, "sampling temperature of those k completions (null: rollout.temperature)")

    @property
    def sampled(self) -> bool:
        """Whether the evaluation samples k > 1 completions per prompt besides the greedy one."""
        return self.samples_per_prompt > 1

    def check(self) -> None:
        require(self.every >= 0, f"eval.every: must be >= 0 (0: before and after training only), got {self.every}")
        require(self.samples_per_prompt >= 0, f"eval.samples_per_prompt: must be >= 0, got {self.samples_per_prompt}")
        require(
            self.temperature is None or 0 < self.temperature <= MAX_TEMPERATURE,
            f"eval.temperature: must be above 0 and at most {MAX_TEMPERATURE:g} (sampled completions), or null, "
            f"got {self.temperature}",
        )
