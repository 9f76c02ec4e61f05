"""The CUDA lane (scripts/device-check.sh). RLPIPE_CHECK_DEVICE=cpu runs the same tests on the CPU at the sizes a CPU
takes in seconds, so that the lane and the script are exercised where no GPU is
(tests/integration/test_device_check.py). Nothing here needs pytest: where it is missing, each module runs itself
(`python -m tests.cuda.test_cuda_learner`)."""

from __future__ import annotations

import os
import sys
import traceback

DEVICE = os.environ.get("RLPIPE_CHECK_DEVICE", "cuda")
NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False)"


def gpu_missing() -> bool:
    import torch

    return DEVICE == "cuda" and not torch.cuda.is_available()


def run_module_tests(namespace: dict, *args) -> int:
    """Every `test_*` function of a module's `namespace`, called with `args`, each told its outcome in a line
    pytest's -v would print; 1 on a failure. A module's `__main__` where pytest is missing."""
    tests = {name: test for name, test in namespace.items() if name.startswith("test_") and callable(test)}
    failed = []
    for name, test in tests.items():
        try:
            test(*args)
            print(f"PASSED {name}", flush=True)
        except Exception:
            traceback.print_exc()
            print(f"FAILED {name}", flush=True)
            failed.append(name)
    print(f"{len(tests) - len(failed)} passed, {len(failed)} failed on {DEVICE}", flush=True)
    return 1 if failed else 0


def skip_without_gpu() -> None:
    """The module's run without pytest, where the GPU it needs is missing: skipped, as pytest would."""
    if gpu_missing():
        print(f"SKIPPED: {NO_GPU}")
        sys.exit(0)
