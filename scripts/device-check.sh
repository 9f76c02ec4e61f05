#!/usr/bin/env bash
# One-shot check of the learner on a CUDA GPU, sized to finish within 8 minutes on one H200. It needs only torch,
# numpy, pyyaml, safetensors and transformers (with its tokenizers): no Ray, no vLLM, nothing downloaded. The
# checkout is used in place (PYTHONPATH), so nothing is installed, unless RLPIPE_WHEELS names a folder of wheels
# for missing modules (installed with --no-deps --no-index into a temporary folder). The machine's own torch is
# used: the script prints its version and refuses, in one line, a torch outside the learner's range (2.9 to 2.13,
# rlpipe/hardware/device.py) or one whose Dynamo cannot capture the step; RLPIPE_CHECK_ANY_TORCH=1 runs anyway.
# The parts, in order, each under its own time limit (seconds; the environment variable changes it):
#   1. every tests/cuda module but the kernels' (RLPIPE_CHECK_TESTS_S, 100): test_cuda_learner.py, eager vs
#      captured graph on the GPU (float32, 3 updates, equal to 1e-4), a bf16 mixed-precision step (float32 master
#      weights) that trains, and that step against the float32 step (log-probs within 2 % of their scale, loss
#      within 1e-3, gradient norm within 3 %); test_cuda_written_weights.py, the engine's written-weights check on
#      a GPU parameter (skipped on the CPU);
#   2. tests/cuda/test_cuda_kernels.py (RLPIPE_CHECK_KERNELS_S, 35): the log-prob kernel the learner runs
#      (chunked) against its reference at Qwen3's vocabulary of 151,936, 384 tokens x 1024, values and gradients:
#      float32 to 1e-4 of each output's scale, bf16 to 2 % of the float32 results;
#   3. `rlpipe bench learner --device cuda --preset P --modes M` for each P:M:LIMIT of RLPIPE_CHECK_BENCH, by default
#      qwen3-0.6b:eager,graph:180 (RLPIPE_CHECK_MODES changes its modes) and qwen3-1.7b:eager:110: tokens/s and
#      MFU against the GPU's bf16 matmul peak measured in the same run, and graph against eager. A bench stopped
#      by its limit keeps the modes it measured.
# Worst case 100 + 35 + 180 + 110 s, 5 s of grace each and about 15 s of start-up: under 8 minutes.
# Without pytest each test module runs itself (python -m tests.cuda.MODULE).
# RLPIPE_CHECK_DEVICE=cpu runs the same parts on the CPU instead, at sizes a CPU takes in seconds (the tests/cuda
# modules read it; the bench runs the `tiny` preset, eager): about a minute on 2 cores, so that the script itself is
# tested where there is no GPU (tests/integration/test_device_check.py).
# Not yet run on a GPU: only the CPU run has passed, so the GPU limits above are estimates and there are no GPU
# figures yet.
# Writes $OUT/device-check.json (every figure; "parts" lists each part's key: cuda_tests, kernel_tests,
# bench_learner for the first preset and bench_learner_PRESET for the others, each with its "outcome") and
# $OUT/device-check.log (all output); $OUT defaults to ./device-check-out. Exit status: 0 when every part passed,
# 2 when the check cannot run here (the reason as the JSON's "error", one line), 1 otherwise.
set -uo pipefail  # no -e: a failing part is reported, and the next part still runs
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/device-check-out}"
mkdir -p "$out"
python="${PYTHON:-python}"

# The whole check, its output copied to the log (the body is not indented: its heredocs end at column 0).
check() {
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export RLPIPE_CHECK_DEVICE="${RLPIPE_CHECK_DEVICE:-cuda}"  # the tests/cuda modules read it too
device="$RLPIPE_CHECK_DEVICE"
started=$SECONDS

give_up() {  # a check that cannot run: the reason, in the log and as the JSON
  echo "device-check: $1"
  "$python" -c 'import json, sys; json.dump({"error": sys.argv[1]}, open(sys.argv[2], "w"))' \
    "$1" "$out/device-check.json"
  exit 2
}

# Each part's limit. On the GPU they add up to the 8 minutes; on the CPU they only stop a part that hangs.
case "$device" in
  cuda)
    tests_limit_s="${RLPIPE_CHECK_TESTS_S:-100}"
    kernels_limit_s="${RLPIPE_CHECK_KERNELS_S:-35}"
    benches="${RLPIPE_CHECK_BENCH:-qwen3-0.6b:${RLPIPE_CHECK_MODES:-eager,graph}:180 qwen3-1.7b:eager:110}"
    ;;
  cpu)
    tests_limit_s="${RLPIPE_CHECK_TESTS_S:-300}"
    kernels_limit_s="${RLPIPE_CHECK_KERNELS_S:-120}"
    benches="${RLPIPE_CHECK_BENCH:-tiny:${RLPIPE_CHECK_MODES:-eager}:120}"
    ;;
  *)
    give_up "RLPIPE_CHECK_DEVICE=$device: cuda (the default) or cpu"
    ;;
esac

missing() {  # the modules of "$@" that this python cannot find
  "$python" - "$@" <<'EOF'
import importlib.util, sys
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken install counts as missing
        return False
print(" ".join(name for name in sys.argv[1:] if not found(name)))
EOF
}

echo "== environment (device: $device)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
required="torch numpy yaml safetensors transformers tokenizers"
absent="$(missing $required pytest)"
if [ -n "$absent" ] && [ -n "${RLPIPE_WHEELS:-}" ] && [ -d "$RLPIPE_WHEELS" ]; then
  echo "installing from $RLPIPE_WHEELS for: $absent"
  "$python" -m pip install --quiet --no-deps --no-index --target "$scratch/site" "$RLPIPE_WHEELS"/*.whl
  export PYTHONPATH="$PYTHONPATH:$scratch/site"
fi
absent_required="$(missing $required)"
if [ -n "$absent_required" ]; then
  give_up "missing python modules: $absent_required (yaml is pip's pyyaml); pass their wheels as RLPIPE_WHEELS=FOLDER"
fi
"$python" - "$scratch/environment.json" "$(missing ray vllm pytest)" "$device" "${RLPIPE_CHECK_ANY_TORCH:-0}" \
  "$scratch/refused" <<'EOF'
import json, sys
import torch
from rlpipe.hardware.device import captured_step_unsupported, torch_unsupported
absent, device, any_torch, refused = sys.argv[2].split(), sys.argv[3], sys.argv[4] == "1", sys.argv[5]
info = {
    "torch": torch.__version__, "cuda": torch.version.cuda, "gpu_visible": torch.cuda.is_available(),
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    # The learner needs none of these; reported to show what the machine had.
    **{f"{name}_importable": name not in absent for name in ("ray", "vllm", "pytest")},
}
json.dump(info, open(sys.argv[1], "w"))
print(info)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
problem = torch_unsupported() or captured_step_unsupported()
if problem and any_torch:
    print(f"device-check: {problem}; running anyway (RLPIPE_CHECK_ANY_TORCH=1)")
elif problem:
    open(refused, "w").write(f"{problem}; RLPIPE_CHECK_ANY_TORCH=1 runs the check anyway")
    sys.exit(4)
if device == "cuda" and not info["gpu_visible"]:
    open(refused, "w").write(
        f"torch {torch.__version__} sees no CUDA GPU; nothing to check (RLPIPE_CHECK_DEVICE=cpu checks on the CPU)")
    sys.exit(3)
EOF
probe_rc=$?
if [ -s "$scratch/refused" ]; then
  give_up "$(cat "$scratch/refused")"
elif [ "$probe_rc" != 0 ]; then
  give_up "the environment probe failed (exit $probe_rc; its error is above)"
fi

parts=()
run() {  # KEY LIMIT COMMAND...: one part under its limit, its output in the log and in $scratch/KEY.log
  local key="$1" limit="$2"
  shift 2
  parts+=("$key")
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$scratch/$key.log"
  echo "${PIPESTATUS[0]}" >"$scratch/$key.rc"
}

test_modules() {  # KEY LIMIT MODULE...: tests/cuda modules, with pytest where it is installed
  local key="$1" limit="$2"
  shift 2
  if [ -z "$(missing pytest)" ]; then
    run "$key" "$limit" "$python" -m pytest -v -p no:cacheprovider -rfEs "${@/#/tests/cuda/}"
  else
    echo "(pytest is missing: running each module directly)"
    # One module after another under the part's one limit; the last line counts them as pytest's would (a module
    # that skips itself exits 0, so it counts as passed).
    run "$key" "$limit" bash -c 'failed=0
      for module in "${@:2}"; do "$1" -m "tests.cuda.${module%.py}" || failed=$((failed + 1)); done
      echo "modules: $(($# - 1 - failed)) passed, $failed failed"; [ "$failed" = 0 ]' _ "$python" "$@"
  fi
}

kernel_module=test_cuda_kernels.py
learner_modules="$(echo $(cd tests/cuda && ls test_*.py | grep -vx "$kernel_module"))"
echo "== 1. tests/cuda: $learner_modules on $device (limit ${tests_limit_s}s)"
test_modules cuda_tests "$tests_limit_s" $learner_modules

echo "== 2. tests/cuda/$kernel_module on $device (limit ${kernels_limit_s}s)"
test_modules kernel_tests "$kernels_limit_s" "$kernel_module"

for bench in $benches; do
  IFS=: read -r preset modes limit <<<"$bench"
  limit="${limit:-${RLPIPE_CHECK_BENCH_S:-120}}"
  # The first preset keeps the key the report always had.
  key="bench_learner"
  [ "${#parts[@]}" -gt 2 ] && key="bench_learner_$preset"
  echo "$preset" >"$scratch/$key.preset"
  echo "== 3. rlpipe bench learner --device $device --preset $preset --modes $modes (limit ${limit}s)"
  run "$key" "$limit" "$python" -m rlpipe.cli bench learner --device "$device" --preset "$preset" --modes "$modes" \
    --out "$scratch/$key.json"
done

echo "== summary ($((SECONDS - started))s)"
"$python" - "$scratch" "$out/device-check.json" "$device" "$((SECONDS - started))" "${parts[@]}" <<'EOF'
import json, os, re, sys
scratch, target, device, seconds, parts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]

def read(name):
    path = os.path.join(scratch, name)
    return open(path, errors="replace").read() if os.path.exists(path) else None

def last_line(key):
    lines = [line.strip() for line in (read(f"{key}.log") or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""

def outcome(rc, summary=None):
    if rc == 0 and summary is not None and not re.search(r"\b[1-9]\d* passed", summary):
        return "failed (no test passed)"  # every test skipped counts as nothing checked
    return "passed" if rc == 0 else "timed out" if rc in (124, 137) else f"failed (exit {rc})"

report = {"device": device, "environment": json.loads(read("environment.json") or "{}"), "seconds": seconds,
          "parts": parts}
for key in parts:
    rc = int((read(f"{key}.rc") or "1").strip())
    if key.startswith("bench_learner"):
        figures = json.loads(read(f"{key}.json") or "null")
        report[key] = {"exit_code": rc, "outcome": outcome(rc), "preset": read(f"{key}.preset").strip(),
                       "figures": figures}
    else:
        report[key] = {"exit_code": rc, "outcome": outcome(rc, last_line(key)), "summary": last_line(key)}
json.dump(report, open(target, "w"), indent=2)
env = report["environment"]
print(f"GPU {env.get('gpu')}, torch {env.get('torch')} (CUDA {env.get('cuda')}); ray importable: "
      f"{env.get('ray_importable')}, vllm importable: {env.get('vllm_importable')}")
print(f"cuda tests on {device}: {report['cuda_tests']['outcome']} -- {report['cuda_tests']['summary']}")
print(f"log-prob kernel on {device}: {report['kernel_tests']['outcome']} -- {report['kernel_tests']['summary']}")
for key in parts:
    if not key.startswith("bench_learner"):
        continue
    part, bench = report[key], report[key]["figures"]
    precision = "bf16 mixed precision" if device == "cuda" else "float32"
    print(f"bench learner ({part['preset']} shape, {precision}): {part['outcome']}")
    if bench:
        print(f"  peak: {bench['peak']}: {bench['peak_gflops'] / 1e3:.3f} TFLOP/s; modes measured "
              f"{len(bench['rows'])} of {len(bench['modes'])}")
        for row in bench["rows"]:
            print(f"  {row['mode']:>8}: {row['tokens_per_s']:9.0f} tokens/s  MFU {100 * row['mfu']:5.1f}%  "
                  f"{row['speed_vs_baseline']:.2f}x {bench['baseline']}  first step {row['first_step_seconds']:.1f}s")
print(f"figures: {target}")
sys.exit(0 if all(report[key]["outcome"] == "passed" for key in parts) else 1)
EOF
}

check 2>&1 | tee "$out/device-check.log"
exit "${PIPESTATUS[0]}"
