#!/usr/bin/env bash
# Sets up the environments if needed, then runs the test suite (unit + integration, all on CPU).
# .venv is the main environment; .venv-xla holds the torch_xla learner (torch 2.9, scripts/setup-xla.sh), which the
# suite runs `rlpipe train` and tests/xla with; .venv-tpu (Python 3.12, the `tpu` extra, scripts/setup-tpu.sh) the
# TPU contract lane. RLPIPE_XLA=0 / RLPIPE_TPU_CONTRACT=0 leave them out (their tests are then skipped).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# --fast: the everyday tier (docs/testing.md): the unit tests not marked heavy and one whole run, in .venv alone.
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
  export RLPIPE_XLA=0 RLPIPE_TPU_CONTRACT=0
fi

# Room on disk first: a build that runs out of it midway leaves a broken environment behind. Sizes measured on a
# fresh machine (GB): .venv 5; .venv-xla and .venv-tpu 8 each (PyPI's torch for them is the CUDA build, with its
# nvidia-* libraries); the suite's own files (compiled kernels, runs) about 2. Built environments need nothing.
need_gb=2
for lane in ".venv:1:${RLPIPE_VENV:-$root/.venv}:5" "xla:${RLPIPE_XLA:-1}:${RLPIPE_XLA_VENV:-$root/.venv-xla}:8" \
    "tpu:${RLPIPE_TPU_CONTRACT:-1}:${RLPIPE_TPU_VENV:-$root/.venv-tpu}:8"; do
  IFS=: read -r _ wanted venv_dir size <<<"$lane"
  if [ "$wanted" != 0 ] && [ ! -f "$venv_dir/.rlpipe-setup" ]; then need_gb=$((need_gb + size)); fi
done
free_gb="$(df -Pk "$root" | awk 'NR == 2 {print int($4 / 1048576)}')"
if [ "$free_gb" -lt "$need_gb" ]; then
  echo "rlpipe: only $free_gb GB free on the disk of $root; the environments still to build and the tests need about" \
       "$need_gb GB (free some, or leave a lane out: RLPIPE_XLA=0, RLPIPE_TPU_CONTRACT=0)" >&2
  exit 1
fi

# The three environments are independent: own folders, and only .venv builds packages from source, so no two
# builds write one entry of pip's wheel cache (its HTTP cache writes atomically). A pip process works on one core
# and waits on downloads much of the time, so .venv-xla and .venv-tpu build in the background while .venv builds,
# each in its own process group, stopped if this script ends before it does; the suite starts once all are ready.
background=()
trap 'for group in "${background[@]}"; do kill -- "-$group" 2>/dev/null || true; done' EXIT
if [ "${RLPIPE_XLA:-1}" != 0 ]; then
  export RLPIPE_XLA_VENV="${RLPIPE_XLA_VENV:-$root/.venv-xla}"
  setsid -w bash "$root/scripts/setup-xla.sh" &
  xla_setup=$!
  background+=("$xla_setup")
fi
if [ "${RLPIPE_TPU_CONTRACT:-1}" != 0 ]; then
  export RLPIPE_TPU_VENV="${RLPIPE_TPU_VENV:-$root/.venv-tpu}"
  setsid -w bash "$root/scripts/setup-tpu.sh" &
  tpu_setup=$!
  background+=("$tpu_setup")
fi
. "$root/scripts/setup.sh"
if [ -n "${xla_setup:-}" ]; then
  wait "$xla_setup"  # a failed build stops the script here (set -e)
  export RLPIPE_REQUIRE_XLA_ENV=1  # built: its tests must run, not skip
fi
if [ -n "${tpu_setup:-}" ]; then
  tpu_status=0
  wait "$tpu_setup" || tpu_status=$?
  if [ "$tpu_status" = 0 ]; then
    export RLPIPE_REQUIRE_TPU_ENV=1
  elif [ "$tpu_status" = 2 ]; then  # no Python 3.12 on this machine: say so loudly, run everything else
    echo "rlpipe: WARNING: no Python 3.12 here, so the TPU contract lane is skipped (RLPIPE_PYTHON312 names one)" >&2
  else
    exit "$tpu_status"
  fi
fi
trap - EXIT
cd "$root"
# Two pytest-xdist workers: much of the suite waits on one core (process and engine start-up, compiles), so two
# workers keep both busy. Tests that must not overlap share one worker (see tests/conftest.py). Arguments given
# to this script come later and win (`-n 0` runs in one process).
if [ "$fast" = 1 ]; then
  exec "$RLPIPE_VENV/bin/python" -m pytest tests/unit "tests/integration/test_terminal.py::test_the_terminal_shows_rlpipes_lines_and_the_log_file_the_rest" \
    -m "not slow and not heavy" -n "${RLPIPE_TEST_WORKERS:-2}" --dist loadgroup "$@"
fi
exec "$RLPIPE_VENV/bin/python" -m pytest tests -n "${RLPIPE_TEST_WORKERS:-2}" --dist loadgroup "$@"
