"""The `metrics` section: where every step's metrics go, and what is written at the end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlpipe.config.keys import key

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass
class MetricsConfig:
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = key(
        ["jsonl", "tensorboard"],
        "where every step's metrics go: jsonl (metrics.jsonl, always written), tensorboard, wandb, mlflow",
    )
    tensorboard: bool | None = key(
        None,
        "older switch for TensorBoard: true/false adds it to or drops it from metrics.loggers; null: loggers decide",
    )
    project: str = key("rlpipe", "W&B project and MLflow experiment the run is logged to (the run is named run.name)")
    mlflow_tracking_uri: str | None = key(
        None,
        "MLflow tracking URI (e.g. file:/path/mlruns, http://host:5000); null: MLflow's default (MLFLOW_TRACKING_URI)",
    )
    plot: bool = key(
        True, "write curves.png at the end (reward, accuracy, loss, length, entropy, KL, log-prob gap, step time); "
        "`rlpipe plot RUN_DIR` draws it again"
    )
    export: bool = key(True, "export the trained model as an HF folder at the end")

    @property
    def active_loggers(self) -> list[str]:
        """metrics.loggers with jsonl first and metrics.tensorboard applied, each once."""
        chosen = ["jsonl", *self.loggers]
        if self.tensorboard is not None:
            chosen = [name for name in chosen if name != "tensorboard"] + (["tensorboard"] if self.tensorboard else [])
        return [name for name in TRACKERS if name in chosen]

    def check(self) -> None:
        """Every key's type says all there is to check (metrics.loggers names only known trackers)."""
