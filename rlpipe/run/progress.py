"""How far a run got: the controller keeps a `RunProgress` up to date as steps finish and checkpoints are written,
and whoever reports a run that stopped (`rlpipe train`, auto-resume) reads from it the step reached, the last
checkpoint and the steps lost between them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlpipe.training.checkpoint import CHECKPOINTS


def holds_steps(run_dir: Path) -> bool:
    """Whether `run_dir` holds a run's logged steps (its metrics.jsonl): a new run there needs run.overwrite=true."""
    return (run_dir / "metrics.jsonl").exists()


@dataclass
class RunProgress:
    """The step a run reached and its newest checkpoint, as the controller last recorded them."""

    run_dir: Path | None = None  # None: the run stopped before its directory was prepared
    total_steps: int = 0
    step: int = 0  # the last step trained and logged; a resumed run starts at its checkpoint's
    checkpoint: Path | None = None  # the newest checkpoint: the last one written, or the one the run resumed from
    checkpoint_step: int = 0

    def begin(self, run_dir: Path, total_steps: int, checkpoint: Path | None = None, step: int = 0) -> None:
        """A run (or an automatic restart) starts in `run_dir`, from `checkpoint` at `step` or from the beginning."""
        self.run_dir, self.total_steps = Path(run_dir), total_steps
        self.step, self.checkpoint, self.checkpoint_step = step, checkpoint, step

    def saved(self, checkpoint: Path, step: int) -> None:
        self.checkpoint, self.checkpoint_step = checkpoint, step

    def lost_steps(self) -> tuple[int, int] | None:
        """The first and last step trained since the last checkpoint (None: none)."""
        first = self.checkpoint_step + 1
        return (first, self.step) if self.step >= first else None

    def own_checkpoint(self) -> bool:
        """Whether the last checkpoint is among the run's own, where `--resume` (its latest) finds it; one of another
        run (`--resume PATH` branched off it, and this run wrote none yet) has to be named."""
        if self.checkpoint is None or self.run_dir is None:
            return False
        return self.checkpoint.parent.resolve() == (self.run_dir / CHECKPOINTS).resolve()

    def must_overwrite(self) -> bool:
        """Whether starting the run again from the beginning needs run.overwrite=true."""
        return self.run_dir is not None and holds_steps(self.run_dir)

    def where(self) -> str:
        """Where the run stopped and what it lost, e.g. "stopped after step 7 of 20; last checkpoint: step 5
        (runs/x/checkpoints/step_000005): steps 6-7 are lost"."""
        if self.run_dir is None:
            return "stopped before the run started"
        reached = f"stopped after step {self.step} of {self.total_steps}" if self.step else "stopped before step 1"
        if self.checkpoint is None:
            return f"{reached}; no checkpoint yet" + (f": {self.lost_in_words()}" if self.lost_steps() else "")
        return f"{reached}; last checkpoint: step {self.checkpoint_step} ({self.checkpoint}): {self.lost_in_words()}"

    def lost_in_words(self) -> str:
        lost = self.lost_steps()
        if lost is None:
            return "no step is lost"
        return f"{steps_in_words(*lost)} {'is' if lost[0] == lost[1] else 'are'} lost"


def steps_in_words(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"
