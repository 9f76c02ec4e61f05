#!/usr/bin/env bash
# Sets up the environment if needed, then runs the test suite (unit + integration, all on CPU).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/setup.sh"
cd "$root"
exec "$RLPIPE_VENV/bin/python" -m pytest tests "$@"
