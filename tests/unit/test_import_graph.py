"""Dependencies go one way: no import cycle among the modules of rlpipe/, actors/, rewards/ and bench/ (imports inside
functions and under TYPE_CHECKING included), nor at run time between rlpipe's subpackages and top-level modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"


def test_no_module_imports_itself_through_another():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_cycle_between_subpackages_at_run_time():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rooms", "--runtime-only"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
