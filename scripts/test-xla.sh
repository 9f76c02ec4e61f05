#!/usr/bin/env bash
# The torch_xla learner's tests alone (scripts/test.sh runs them too, through tests/integration): sets up .venv-xla
# if needed (torch 2.9.0 + torch_xla 2.9.0, see scripts/setup-xla.sh), runs tests/xla on XLA's CPU client
# (PJRT_DEVICE=CPU), then reports the xla learner's measured step time and XLA counts (`rlpipe bench learner`, a
# tiny model; RLPIPE_XLA_REPORT=0 skips it). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/setup-xla.sh"
cd "$root"
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
python="$RLPIPE_XLA_VENV/bin/python"
"$python" -m pytest tests/xla -p no:cacheprovider "$@"
if [ "${RLPIPE_XLA_REPORT:-1}" != 0 ]; then
  echo "rlpipe: xla learner report (one step = one XLA program; times measured on this machine)"
  "$python" -m rlpipe.cli bench learner --layers 2 --hidden 128 --seq 64 --batch 4 --steps 5 \
    --modes eager,xla-graph,xla-graph-m2 2>&1 | grep -v -e sharding_propagation -e '^$'
fi
