"""Compile TPU kernels at real model shapes for several TPU generations, on a host without a TPU, and print a table
of what compiled and the VMEM each kernel takes (rlpipe/tpu/kernels.py says how).

    python bench/tpu_compile.py [--chips v5e,v5p,v6e] [--models qwen3-8b,qwen3-30b-a3b] [--kernels splash,...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # rlpipe.kernels imports torch; no torch_tpu needed
# Compiling uses no chip, so libtpu's one-process-per-host lock (/tmp/libtpu_lockfile) need not keep two of these
# (or this and a test) from running at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

CHECKOUT = Path(__file__).resolve().parents[1]
if (CHECKOUT / "rlpipe").is_dir() and str(CHECKOUT) not in sys.path:  # `python bench/tpu_compile.py` in a checkout
    sys.path.insert(0, str(CHECKOUT))

from rlpipe.tpu.kernels import CASES, CHIPS, MIB, Result, compile_case, recipe_shapes, topology_devices  # noqa: E402

# Model name -> the recipe whose learner shapes the cases take.
MODELS = {"qwen3-8b": "configs/qwen3-8b-v6e.yaml", "qwen3-30b-a3b": "configs/qwen3-30b-a3b-v6e.yaml"}


def model_shapes(name: str):
    """The shapes of model `name`'s recipe (`MODELS`)."""
    from rlpipe.config.loading import find_recipe, load_config

    return recipe_shapes(load_config(find_recipe(MODELS[name])), name)


def run(chips: list[str], models: list[str], kernels: list[str] | None = None, out=sys.stdout) -> list[Result]:
    results = []
    for model in models:
        shapes = model_shapes(model)
        cases = [case for kind, build in CASES.items() if not kernels or kind in kernels for case in build(shapes)]
        for chip in chips:
            devices = topology_devices(chip)
            for case in cases:
                result = compile_case(case, chip, devices, model)
                results.append(result)
                print(f"  {model} {chip} {case.kernel}: {'compiled' if result.compiled else 'FAILED'} "
                      f"({result.seconds:.1f} s)", file=sys.stderr, flush=True)
    print_table(results, out)
    return results


def _mib(size: int | None) -> str:
    if not size:
        return "-"
    return f"{size / MIB:.2f}" if size >= MIB / 100 else "<0.01"


def print_table(results: list[Result], out=sys.stdout) -> None:
    header = ("kernel", "model", "shapes", "chip", "compiled", "VMEM MiB", "other ops MiB", "seconds")
    rows = [
        (r.case.kernel, r.model, r.case.shapes, r.chip, "yes" if r.compiled else "no", _mib(r.kernel_vmem),
         _mib(r.other_vmem), f"{r.seconds:.1f}")
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    line = "  ".join("{:<%d}" % w for w in widths)
    print(line.format(*header), file=out)
    print(line.format(*("-" * w for w in widths)), file=out)
    for row in rows:
        print(line.format(*row), file=out)
    failures = [r for r in results if not r.compiled]
    if failures:
        print("\nnot compiled:", file=out)
        for r in failures:
            print(f"  {r.case.kernel} {r.model} [{r.case.shapes}] on {r.chip}: {r.error}", file=out)
    print("\nVMEM MiB: the largest scoped VMEM the compiler gave one Mosaic kernel (tpu_custom_call) of the program; "
          "other ops MiB: the same for its other ops (XLA fusions, copies); from the after-codegen HLO's "
          "used_scoped_memory_configs; '-': none reported. seconds: lowering and compiling.", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", default=",".join(CHIPS), help=f"of {', '.join(CHIPS)}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--kernels", default="", help=f"of {', '.join(CASES)} (default: all)")
    args = parser.parse_args(argv)
    chips, models = args.chips.split(","), args.models.split(",")
    kernels = [k for k in args.kernels.split(",") if k]
    for value, known, what in ((chips, CHIPS, "chip"), (models, MODELS, "model"), (kernels, CASES, "kernel")):
        unknown = [v for v in value if v not in known]
        if unknown:
            parser.error(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    run(chips, models, kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
