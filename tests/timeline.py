"""`--timeline FILE`: where the suite's time goes. One JSON line per test phase (setup, call, teardown) with its
duration, start and end (epoch seconds), outcome, the pytest-xdist worker that ran it and the fixtures it used,
written by the controlling process as the reports arrive; `python -m tests.timeline FILE` sums it by worker, module
and kind of test."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

_out: list = []  # the open file, in the controlling process only


def pytest_addoption(parser):
    parser.addoption("--timeline", default=None, metavar="FILE", help="write every test phase's timing to FILE")


def pytest_configure(config):
    path = config.getoption("timeline")
    if path and not hasattr(config, "workerinput"):  # xdist workers send their reports to the controller
        _out.append(open(path, "w", buffering=1))  # noqa: SIM115 (open for the session; closed at its end)


def pytest_unconfigure(config):
    while _out:
        _out.pop().close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "setup" and item.config.getoption("timeline"):
        outcome.get_result().user_properties.append(("fixtures", sorted(item.fixturenames)))


def pytest_runtest_logreport(report):
    if not _out:
        return
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else "main"
    fixtures = dict(report.user_properties).get("fixtures")
    record = {"test": report.nodeid, "when": report.when, "outcome": report.outcome, "s": round(report.duration, 3),
              "start": round(report.start, 3), "stop": round(report.stop, 3), "worker": worker}
    if fixtures is not None:
        record["fixtures"] = fixtures
    _out[0].write(json.dumps(record) + "\n")


# What a test mostly pays for, judged by what it uses (first match wins).
KINDS = (
    ("TPU contract lane (subprocess pytest, .venv-tpu)", lambda t, f: "test_tpu_contract.py" in t),
    ("xla lane (subprocess pytest, .venv-xla)", lambda t, f: "test_xla_lane.py" in t),
    ("whole runs on hosts in network namespaces", lambda t, f: "hosts" in f),
    ("vLLM engines shared by a module, in-process", lambda t, f: "test_weight_sync.py" in t),
    ("whole runs and role sets on a Ray cluster", lambda t, f: "/integration/" in t),
    ("unit: learner ranks in spawned processes", lambda t, f: any(n in t for n in (
        "learner_group", "learner_reference", "simple_fsdp", "two_rank", "two-rank", "bench_load_memory")),),
    ("unit: compiled (graph) steps in-process", lambda t, f: "graph" in t),
    ("unit: everything else", lambda t, f: True),
)


def summarize(path: str) -> str:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    fixtures = {r["test"].split("@")[0]: r.get("fixtures", []) for r in records if r["when"] == "setup"}
    tests: dict[str, float] = defaultdict(float)
    worker_busy: dict[str, float] = defaultdict(float)
    for r in records:
        tests[r["test"].split("@")[0]] += r["s"]  # without pytest-xdist's group suffix
        worker_busy[r["worker"]] += r["s"]
    start, stop = min(r["start"] for r in records), max(r["stop"] for r in records)
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_module: dict[str, float] = defaultdict(float)
    for test, seconds in tests.items():
        kind = next(name for name, matches in KINDS if matches(test, fixtures.get(test, [])))
        by_kind[kind].append(seconds)
        by_module[test.split("::")[0]] += seconds
    lines = [f"{len(tests)} tests, {stop - start:.0f} s from the first start to the last stop; busy per worker: "
             + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(worker_busy.items())), "", "| kind | tests | seconds |",
             "|---|---|---|"]
    lines += [f"| {kind} | {len(times)} | {sum(times):.0f} |" for kind, times in
              sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))]
    lines += ["", "| module | seconds |", "|---|---|"]
    lines += [f"| {m} | {s:.0f} |" for m, s in sorted(by_module.items(), key=lambda kv: -kv[1])[:25]]
    lines += ["", "| slowest tests | seconds |", "|---|---|"]
    lines += [f"| {t} | {s:.0f} |" for t, s in sorted(tests.items(), key=lambda kv: -kv[1])[:20]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
