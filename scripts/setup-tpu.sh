#!/usr/bin/env bash
# Creates (or refreshes) .venv-tpu: Python 3.12 with rlpipe and its `tpu` extra (torch 2.13, torch-tpu, libtpu,
# vllm-torchtpu, jax), for the TPU contract lane (scripts/test-tpu-contract.sh), which checks rlpipe's TPU code
# against these packages on a host without a TPU. About 8 GB: PyPI's cp312 torch is the CUDA build.
# Python 3.12 is RLPIPE_PYTHON312, else a python3.12 on PATH, else pyenv's.
# Idempotent: does nothing when the environment matches pyproject.toml and this script.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RLPIPE_TPU_VENV:-$root/.venv-tpu}"
stamp="$venv/.rlpipe-setup"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup-tpu.sh" | sha256sum | cut -d' ' -f1)"
export RLPIPE_TPU_VENV="$venv"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  return 0 2>/dev/null || exit 0
fi

python312=""
for candidate in ${RLPIPE_PYTHON312:-} $(command -v python3.12 || true) \
    $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null || true); do
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    python312="$candidate"
    break
  fi
done
if [ -z "$python312" ]; then
  echo "rlpipe: the TPU contract lane needs Python 3.12 (set RLPIPE_PYTHON312 to its interpreter)" >&2
  exit 2
fi
echo "rlpipe: setting up $venv for the TPU contract lane (a few minutes on first run)" >&2
"$python312" -m venv "$venv"
"$venv/bin/python" -m pip install --disable-pip-version-check --quiet --quiet --progress-bar off -e "$root[tpu,dev]"
echo "$want" > "$stamp"
echo "rlpipe: TPU contract environment ready" >&2
