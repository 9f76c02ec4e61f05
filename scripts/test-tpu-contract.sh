#!/usr/bin/env bash
# The TPU contract lane alone (scripts/test.sh runs it too): sets up .venv and .venv-tpu if needed, then checks that
# every extra resolves for its Python and runs tests/tpu_contract (rlpipe's TPU code against the installed
# torch-tpu and vllm-torchtpu, on a host without a TPU). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/setup.sh"
. "$root/scripts/setup-tpu.sh"
cd "$root"
export RLPIPE_REQUIRE_TPU_ENV=1
exec "$RLPIPE_VENV/bin/python" -m pytest tests/integration/test_tpu_contract.py -p no:cacheprovider "$@"
