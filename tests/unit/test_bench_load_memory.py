"""bench/load_memory.py end to end on a tiny model: each side's ranks load and report (the figures themselves are
what the bench is for; here only that it runs and reports a rank's own memory)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.heavy
def test_the_bench_loads_a_tiny_model_with_two_ranks_on_each_side():
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "load_memory.py"), "--baseline", str(REPO), "--size", "tiny",
         "--ranks", "2"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] == ["2"]]
    sides = {row[1]: float(row[3].rstrip("G")) for row in rows if row[1] in ("before", "after")}
    assert set(sides) == {"before", "after"}
    # A rank's own high-water mark: interpreter and torch, not the bench process it was forked from.
    assert all(0.05 < peak < 2.0 for peak in sides.values()), sides
    assert any("after/before" in line for line in done.stdout.splitlines())
