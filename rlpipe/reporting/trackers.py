"""Experiment trackers that receive every step's metrics besides metrics.jsonl: TensorBoard, W&B, MLflow.

Each is one small class with `log(step, metrics)` and `close()`; only finite numbers are sent (metrics.jsonl keeps
the rest as null)."""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path

from rlpipe.usercode.callables import readable
from rlpipe.config import Config, ConfigError, MetricsConfig

# The module each optional tracker needs, and the rlpipe extra that installs it.
_REQUIRED_MODULES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
# MLflow takes at most 100 params per batch call.
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_PARAM_VALUE_LIMIT = 6000


def finite_numbers(metrics: dict) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """The config as dotted keys with text values, as trackers store params."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, name + "."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return flat


def check_trackers_installed(cfg: MetricsConfig) -> None:
    """A tracker listed in metrics.loggers whose library is missing stops the run before anything starts."""
    for name in cfg.active_loggers:
        module, extra = _REQUIRED_MODULES.get(name, (None, None))
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"metrics.loggers: {name} is listed but the {module} package is not installed "
                f"(pip install 'rlpipe[{extra}]', or remove {name} from metrics.loggers)"
            )


def open_trackers(cfg: Config, run_dir: Path) -> list:
    opened = []
    for name in cfg.metrics.active_loggers:
        if name == "tensorboard":
            opened.append(TensorBoardTracker(run_dir))
        elif name == "wandb":
            opened.append(WandbTracker(cfg, run_dir))
        elif name == "mlflow":
            opened.append(MlflowTracker(cfg))
    return opened


class TensorBoardTracker:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        for key, value in finite_numbers(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named after run.name in project metrics.project; its files go under <run_dir>/wandb. Offline
    (WANDB_MODE=offline) it writes there only; `wandb sync` uploads it later."""

    def __init__(self, cfg: Config, run_dir: Path):
        import wandb

        self.run = wandb.init(
            project=cfg.metrics.project,
            name=cfg.run.name,
            dir=str(run_dir),
            config=readable(cfg.to_dict()),  # functions passed by value by name, never their code
            settings=wandb.Settings(console="off"),  # rlpipe prints its own step line
        )

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(finite_numbers(metrics), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before W&B's service process has written the run's last records; teardown waits
        # for it, so the offline files are complete when the run ends.
        wandb.teardown()


class MlflowTracker:
    """An MLflow run named after run.name in experiment metrics.project, at metrics.mlflow_tracking_uri (default:
    MLflow's own, MLFLOW_TRACKING_URI); the config is logged as params."""

    def __init__(self, cfg: Config):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=cfg.metrics.mlflow_tracking_uri)
        experiment = self.client.get_experiment_by_name(cfg.metrics.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.metrics.project)
        self.run_id = self.client.create_run(experiment_id, run_name=cfg.run.name).info.run_id
        params = [Param(k, v[:_MLFLOW_PARAM_VALUE_LIMIT]) for k, v in flat_params(readable(cfg.to_dict())).items()]
        for start in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + _MLFLOW_PARAMS_PER_BATCH])

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [Metric(key, value, now, step) for key, value in finite_numbers(metrics).items()]
        self.client.log_batch(self.run_id, metrics=values)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
