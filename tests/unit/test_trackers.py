"""rlpipe.reporting.trackers: what W&B (offline) and MLflow (a local file store) record equals metrics.jsonl; a tracker listed
but not installed stops the run at start-up."""

import io
import json
import math
import struct

import pytest

from rlpipe.config import Config, ConfigError, MetricsConfig, load_config
from rlpipe.reporting.metrics import MetricsLogger
from rlpipe.reporting.trackers import check_trackers_installed, flat_params, open_trackers

STEPS = [
    {"reward/mean": 0.5, "loss": 1.25, "accuracy": 0.25},
    {"reward/mean": math.nan, "loss": 0.75, "accuracy": 0.5},  # NaN: null in metrics.jsonl, not sent to trackers
]


def _log_steps(cfg: Config, run_dir) -> list[dict]:
    """Logs STEPS through the configured trackers; returns metrics.jsonl's finite values per step."""
    run_dir.mkdir(parents=True)
    logger = MetricsLogger(run_dir, len(STEPS), open_trackers(cfg, run_dir), stream=io.StringIO())
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(step, metrics)
    logger.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if v is not None and k not in ("nonfinite_values",)} for r in records]


# ---------------------------------------------------------------- config


def test_loggers_default_to_jsonl_and_tensorboard():
    assert MetricsConfig().active_loggers == ["jsonl", "tensorboard"]


def test_jsonl_is_always_on_and_the_tensorboard_switch_still_works():
    assert MetricsConfig(loggers=["mlflow"]).active_loggers == ["jsonl", "mlflow"]
    assert MetricsConfig(tensorboard=False).active_loggers == ["jsonl"]
    assert MetricsConfig(loggers=["jsonl"], tensorboard=True).active_loggers == ["jsonl", "tensorboard"]


def test_an_unknown_logger_is_a_config_error():
    with pytest.raises(ConfigError, match=r"metrics.loggers\[1\]: 'neptune' is not one of"):
        load_config(None, ["metrics.loggers=[jsonl, neptune]"])


def test_a_listed_tracker_that_is_not_installed_is_named(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    with pytest.raises(ConfigError) as info:
        check_trackers_installed(MetricsConfig(loggers=["jsonl", "mlflow"]))
    assert str(info.value) == (
        "metrics.loggers: mlflow is listed but the mlflow package is not installed "
        "(pip install 'rlpipe[mlflow]', or remove mlflow from metrics.loggers)"
    )


def test_config_params_are_flat_dotted_text():
    params = flat_params({"train": {"lr": 1e-6, "betas": [0.9, 0.99]}, "run": {"name": "x"}, "empty": {}})
    assert params == {"train.lr": "1e-06", "train.betas": "[0.9, 0.99]", "run.name": "x", "empty": "{}"}


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, ["metrics.loggers=[tensorboard]"])
    expected = _log_steps(cfg, tmp_path / "run")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    for key in ("loss", "reward/mean"):
        logged = {e.step: pytest.approx(e.value) for e in events.Scalars(key)}
        assert logged == {r["step"]: r[key] for r in expected if key in r}


# ---------------------------------------------------------------- W&B, offline


def _wandb_records(path):
    """The records of a .wandb transaction log: W&B's 7-byte file header, then LevelDB-log framed protobuf
    `Record`s (wandb.proto's schema) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = header, b""
    while position + header <= len(data):
        if block - position % block < header:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + header])
        chunk = data[position + header : position + header + length]
        position += header + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full | first, or middle | last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


@pytest.mark.heavy
def test_wandb_offline_run_holds_the_metrics_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = load_config(None, ["metrics.loggers=[wandb]", "metrics.project=rlpipe-tests", "run.name=wandb-run"])
    expected = _log_steps(cfg, tmp_path / "run")

    (log,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, names = [], {}, []
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append({"step": record.history.step.num, **{k: v for k, v in items.items() if not k.startswith("_")}})
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            names.append((record.run.project, record.run.display_name))
    assert history == expected
    assert ("rlpipe-tests", "wandb-run") in names
    assert config["train"]["lr"] == cfg.train.lr and config["run"]["name"] == "wandb-run"


# ---------------------------------------------------------------- MLflow, local file store


def test_mlflow_file_store_holds_the_metrics_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this opt-in
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    cfg = load_config(None, ["metrics.loggers=[mlflow]", f"metrics.mlflow_tracking_uri={uri}", "run.name=mlflow-run"])
    expected = _log_steps(cfg, tmp_path / "run")

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlpipe").experiment_id])
    assert run.info.run_name == "mlflow-run" and run.info.status == "FINISHED"
    logged: dict[int, dict] = {}
    for key in ("reward/mean", "loss", "accuracy"):
        for point in client.get_metric_history(run.info.run_id, key):
            logged.setdefault(point.step, {"step": point.step})[key] = point.value
    assert [logged[step] for step in sorted(logged)] == expected
    assert run.data.params["train.lr"] == str(cfg.train.lr)
    assert run.data.params["run.name"] == "mlflow-run"
