"""rlpipe.reporting.metrics: metrics.jsonl is strict JSON (non-finite values as null, counted)."""

import io
import json
import math

from rlpipe.reporting.metrics import MetricsLogger


def _strict_records(path) -> list[dict]:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_non_finite_values_are_written_as_null_and_counted(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=2, stream=io.StringIO())
    logger.log(1, {"reward/mean": math.nan, "loss": math.inf, "grad_norm": -math.inf, "accuracy": 0.5})
    logger.log(2, {"reward/mean": 0.25, "loss": 0.1})
    first, second = _strict_records(tmp_path / "metrics.jsonl")
    assert first == {"step": 1, "reward/mean": None, "loss": None, "grad_norm": None, "accuracy": 0.5,
                     "nonfinite_values": 3}
    assert second == {"step": 2, "reward/mean": 0.25, "loss": 0.1, "nonfinite_values": 0}
    assert logger.history == [first, second]  # what checkpoints keep in trainer.json


def test_a_restored_history_is_strict_and_keeps_its_counts(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=3, stream=io.StringIO())
    logger.restore([{"step": 1, "loss": None, "nonfinite_values": 1}, {"step": 2, "loss": math.nan}])
    assert _strict_records(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": None, "nonfinite_values": 1},
        {"step": 2, "loss": None, "nonfinite_values": 1},
    ]


def test_a_sample_scored_0_for_running_out_of_time_counts_as_scored_and_as_a_timeout():
    from rlpipe.reporting.metrics import rollout_metrics
    from rlpipe.types import Completion, Group, Prompt

    completions = [Completion([1], [0.0], str(n), "stop", 0) for n in range(3)]
    group = Group(Prompt(0, "q", [0], {}), completions, rewards=[1.0, 0.0, None], reward_parts={"f": [1.0, 0.0, None]})
    metrics = rollout_metrics([group], 1.0, failures={"f": 1}, timeouts={"f": 1})
    assert metrics["reward/timeouts/f"] == 1.0 and metrics["reward/failures/f"] == 1.0
    assert metrics["reward/unscored"] == 1.0 and metrics["reward/mean"] == 0.5
