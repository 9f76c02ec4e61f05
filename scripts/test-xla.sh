#!/usr/bin/env bash
# The PyTorch/XLA lane, opt-in (not part of scripts/test.sh or .ci/run): sets up .venv-xla if needed (torch 2.9.0 +
# torch_xla 2.9.0, see scripts/setup-xla.sh), then runs tests/xla on XLA's CPU client (PJRT_DEVICE=CPU).
# Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/setup-xla.sh"
cd "$root"
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
# rlpipe is not installed in this environment (see setup-xla.sh): the checkout is the package.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$RLPIPE_XLA_VENV/bin/python" -m pytest tests/xla -p no:cacheprovider "$@"
