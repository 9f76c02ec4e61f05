#!/usr/bin/env bash
# One-shot check of the learner on a CUDA GPU, sized to finish within 8 minutes on one H200. It needs only torch,
# numpy, pyyaml, safetensors and transformers (with its tokenizers): no Ray, no vLLM, nothing downloaded. The
# checkout is used in place (PYTHONPATH), so nothing is installed, unless RLPIPE_WHEELS names a folder of wheels
# for missing modules (installed with --no-deps --no-index into a temporary folder).
#   (a) tests/cuda: eager vs captured graph on the GPU (float32, 3 updates, equal to 1e-4), and a bf16
#       mixed-precision step (float32 master weights);
#   (b) `rlpipe bench learner --device cuda --preset qwen3-0.6b --modes eager,graph`: tokens/s and MFU against
#       the GPU's bf16 matmul peak measured in the same run, and graph against eager.
# Writes $OUT/device-check.json (every figure) and $OUT/device-check.log (all output); $OUT defaults to
# ./device-check-out. Exit status: 0 when every part passed.
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
# Each part's limit; with start-up and the summary the whole stays under 8 minutes.
tests_limit_s="${RLPIPE_CHECK_TESTS_S:-140}"
bench_limit_s="${RLPIPE_CHECK_BENCH_S:-290}"
modes="${RLPIPE_CHECK_MODES:-eager,graph}"
started=$SECONDS

give_up() {  # a check that cannot run: the reason, in the log and as the JSON
  echo "device-check: $1"
  "$python" -c 'import json, sys; json.dump({"error": sys.argv[1]}, open(sys.argv[2], "w"))' "$1" "$out/device-check.json"
  exit 2
}

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

echo "== environment"
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
"$python" - "$scratch/environment.json" "$(missing ray vllm pytest)" <<'EOF'
import json, sys
import torch
absent = sys.argv[2].split()
info = {
    "torch": torch.__version__, "cuda": torch.version.cuda, "gpu_visible": torch.cuda.is_available(),
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    # The learner needs none of these; reported to show what the machine had.
    **{f"{name}_importable": name not in absent for name in ("ray", "vllm", "pytest")},
}
json.dump(info, open(sys.argv[1], "w"))
print(info)
sys.exit(0 if info["gpu_visible"] else 3)
EOF
if [ $? = 3 ]; then
  give_up "torch sees no CUDA GPU; nothing to check"
fi

echo "== (a) tests/cuda (limit ${tests_limit_s}s)"
if [ -z "$(missing pytest)" ]; then
  timeout -k 10 "$tests_limit_s" "$python" -m pytest -v -p no:cacheprovider -rfEs tests/cuda 2>&1 | tee "$scratch/tests.log"
else  # the module runs its tests itself
  echo "(pytest is missing: running the module directly)"
  timeout -k 10 "$tests_limit_s" "$python" -m tests.cuda.test_cuda_learner 2>&1 | tee "$scratch/tests.log"
fi
tests_rc=${PIPESTATUS[0]}

echo "== (b) rlpipe bench learner --device cuda --preset qwen3-0.6b --modes $modes (limit ${bench_limit_s}s)"
timeout -k 10 "$bench_limit_s" "$python" -m rlpipe.cli bench learner --device cuda --preset qwen3-0.6b \
  --modes "$modes" --out "$scratch/bench.json" 2>&1 | tee "$scratch/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== summary ($((SECONDS - started))s)"
"$python" - "$scratch" "$out/device-check.json" "$tests_rc" "$bench_rc" "$((SECONDS - started))" <<'EOF'
import json, os, sys
scratch, target, tests_rc, bench_rc, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def last_line(name):
    path = os.path.join(scratch, name)
    lines = [line.strip() for line in open(path, errors="replace") if line.strip()] if os.path.exists(path) else []
    return lines[-1] if lines else ""

def outcome(rc):
    return "passed" if rc == 0 else "timed out" if rc in (124, 137) else f"failed (exit {rc})"

def read_json(name):
    path = os.path.join(scratch, name)
    return json.load(open(path)) if os.path.exists(path) else None

bench = read_json("bench.json")
report = {
    "environment": read_json("environment.json") or {},
    "seconds": seconds,
    "cuda_tests": {"exit_code": tests_rc, "outcome": outcome(tests_rc), "summary": last_line("tests.log")},
    "bench_learner": {"exit_code": bench_rc, "outcome": outcome(bench_rc), "figures": bench},
}
json.dump(report, open(target, "w"), indent=2)
env = report["environment"]
print(f"GPU {env.get('gpu')}, torch {env.get('torch')} (CUDA {env.get('cuda')}); ray importable: "
      f"{env.get('ray_importable')}, vllm importable: {env.get('vllm_importable')}")
print(f"cuda tests: {outcome(tests_rc)} -- {report['cuda_tests']['summary']}")
print(f"bench learner (qwen3-0.6b shape, bf16 mixed precision): {outcome(bench_rc)}")
if bench:
    print(f"  peak: {bench['peak']}: {bench['peak_gflops'] / 1e3:.1f} TFLOP/s; modes measured "
          f"{len(bench['rows'])} of {len(bench['modes'])}")
    for row in bench["rows"]:
        print(f"  {row['mode']:>8}: {row['tokens_per_s']:9.0f} tokens/s  MFU {100 * row['mfu']:5.1f}%  "
              f"{row['speed_vs_baseline']:.2f}x {bench['baseline']}  first step {row['first_step_seconds']:.1f}s")
print(f"figures: {target}")
EOF
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
}

check 2>&1 | tee "$out/device-check.log"
exit "${PIPESTATUS[0]}"
