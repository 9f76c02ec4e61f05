"""The `metrics` section: where every step's metrics go, and what is written at the end."""

from __future__ import annotations

from dataclasses import dataclass
import re
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
# A model repository's id on the Hub: ORG/NAME (huggingface_hub's own check is finer; this one refuses the
# obvious before a run starts).
HUB_REPO_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}"


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
    push_to_hub: str | None = key(
        None, "ORG/NAME: push that export (with its model card) to this Hugging Face Hub model repository at the "
        "end, through huggingface_hub (token: HF_TOKEN or `hf auth login`; endpoint: HF_ENDPOINT); null: no push"
    )
    push_private: bool = key(
        False, "create the metrics.push_to_hub repository as private; false: the namespace's default visibility"
    )

    @property
    def active_loggers(self) -> list[str]:
        """metrics.loggers with jsonl first and metrics.tensorboard applied, each once."""
        chosen = ["jsonl", *self.loggers]
        if self.tensorboard is not None:
            chosen = [name for name in chosen if name != "tensorboard"] + (["tensorboard"] if self.tensorboard else [])
        return [name for name in TRACKERS if name in chosen]

    def check(self) -> None:
        """metrics.loggers names only known trackers (its type says so); a push needs an export and a repo id."""
        if self.push_to_hub is not None:
            require(
                re.fullmatch(HUB_REPO_ID, self.push_to_hub) is not None,
                f"metrics.push_to_hub: {self.push_to_hub!r} is not a Hub repository id ORG/NAME (letters, digits, "
                f"'-', '_', '.')",
            )
            require(self.export, "metrics.push_to_hub: needs metrics.export=true (the export is what is pushed)")
