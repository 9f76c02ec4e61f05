#!/usr/bin/env bash
# Sets up the environment if needed, then runs `rlpipe train` (default: configs/default.yaml) with any arguments.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec "$RLPIPE_VENV/bin/rlpipe" train "$@"
