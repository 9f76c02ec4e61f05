#!/usr/bin/env bash
# Sets up the environment if needed, then runs the test suite (unit + integration, all on CPU).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/setup.sh"
cd "$root"
# Two pytest-xdist workers: much of the suite waits on one core (process and engine start-up, compiles), so two
# workers keep both busy. Tests that must not overlap share one worker (see tests/conftest.py). Arguments given
# to this script come later and win (`-n 0` runs in one process).
exec "$RLPIPE_VENV/bin/python" -m pytest tests -n "${RLPIPE_TEST_WORKERS:-2}" --dist loadgroup "$@"
