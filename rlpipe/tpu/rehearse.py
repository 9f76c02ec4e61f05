"""`rlpipe rehearse RECIPE`: everything a TPU recipe's start does that needs no chip, in the order a real start does
it, on a host with the `tpu` extra installed and no TPU. One line per check, then a summary; exit 1 when any fails.

1. plan: the recipe's per-chip, per-host and per-pod memory and chip counts against every limit a start meets
   (`rlpipe plan`'s figures and refusals);
2. environments: each actor's TPU environment, as rlpipe derives it from the recipe's slices, fed through the TPU
   packages' own binding and launch code;
3. engines: the rollout engines' settings through vLLM-TorchTPU's own config validation;
4. learner step: the learner's step compiled by TorchTPU's backend on fake `tpu` tensors at the recipe's shapes, its
   real kernels in the graph (rlpipe/tpu/step.py says how far that goes without a chip);
5. kernels: the step's kernels, forward and backward, compiled for the learner's TPU generation by libtpu's compiler
   (rlpipe/tpu/kernels.py).
What stays for the slice: running anything on a chip (compiled programs, collectives over ICI, vLLM's KV cache).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The packages of the `tpu` extra a rehearsal drives.
TPU_PACKAGES = ("torch_tpu", "vllm_torchtpu", "jax", "libtpu")
# The learner's TPU generation (rlpipe/hardware/device.py's names) -> its name in JAX's compile-only topologies.
COMPILE_CHIPS = {"v5litepod": "v5e", "v5p": "v5p", "v6e": "v6e"}


@dataclass
class Check:
    what: str
    passed: bool | None  # None: nothing here states this limit (`why` says so)
    why: str
    seconds: float = 0.0
    details: dict | None = None  # what the check measured, for `--json`

    def line(self) -> str:
        verdict = {True: "ok", False: "FAILED", None: "n/a"}[self.passed]
        return f"{verdict:6} {self.what} ({self.seconds:.1f} s): {self.why}"


def missing_tpu_packages() -> list[str]:
    return [name for name in TPU_PACKAGES if importlib.util.find_spec(name) is None]


def _timed(what: str, run: Callable[[], tuple]) -> Check:
    started = time.perf_counter()
    details = None
    try:
        passed, why, *rest = run()
        details = rest[0] if rest else None
    except Exception as error:  # noqa: BLE001 (a check that raises has failed; the rehearsal goes on)
        passed, why = False, _one_line(error)
    return Check(what, passed, why, time.perf_counter() - started, details)


def _one_line(error: Exception) -> str:
    """An error in one line: its type and its most telling line (pydantic's sit below a summary)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = next((line for line in lines if line.lower().startswith("value error")), lines[0] if lines else "")
    return f"{type(error).__name__}: {telling}"


def learner_generation(cfg) -> str:
    from rlpipe.hardware.tpu_layout import slice_shares

    shares = slice_shares(cfg.placement)
    if "learner" not in shares:
        raise ValueError("placement.learner.tpu: names no TPU slice, so this recipe has no TPU start to rehearse")
    return shares["learner"].tslice.generation


# ------------------------------------------------------------------ the checks


def plan_checks(cfg) -> list[Check]:
    """`rlpipe plan`'s limits, a check each."""
    from rlpipe.plan import plan_checks as limits

    started = time.perf_counter()
    found = limits(cfg)
    seconds = (time.perf_counter() - started) / max(1, len(found))
    return [Check(f"plan: {limit.name}", limit.passed, limit.reason, seconds) for limit in found]


def check_engines(cfg) -> tuple[bool, str]:
    """The engines' settings through vLLM-TorchTPU's config validation, on the model's own config.json, on a host
    presented as the rollout's (its single-host preparation scans the chips for an engine of several)."""
    from unittest import mock

    from vllm.engine.arg_utils import EngineArgs

    from rlpipe.config.rollout import torchtpu_refusal
    from rlpipe.plan import architecture_source
    from rlpipe.tpu.hosts import tpu_host
    from rlpipe.hardware.tpu_layout import slice_shares

    refused = torchtpu_refusal(cfg.rollout, cfg.sync)
    if refused:
        return False, refused
    rollout, share = cfg.rollout, slice_shares(cfg.placement)["rollout"]
    with (tempfile.TemporaryDirectory(prefix="rlpipe-engine-") as folder,
          tpu_host(share.tslice.generation, share.tslice.chips_per_host),
          mock.patch.dict(os.environ)):  # the platform's preparation writes the engine's layout into the process
        shutil.copy(architecture_source(cfg.model.path), Path(folder) / "config.json")
        config = EngineArgs(
            model=folder, skip_tokenizer_init=True, load_format="dummy", dtype=rollout.dtype,
            max_model_len=rollout.max_model_len, tensor_parallel_size=rollout.tensor_parallel,
            gpu_memory_utilization=rollout.gpu_memory_utilization, logprobs_mode=rollout.logprobs_mode(),
            worker_extension_cls="rlpipe.rollout.vllm_worker.WeightWriter",
        ).create_engine_config()
    return True, (
        f"{rollout.num_engines} engine(s) of {config.parallel_config.tensor_parallel_size} chip(s), "
        f"{config.model_config.dtype} weights, {config.model_config.max_model_len} tokens a sequence"
    )


def check_step(cfg, generation: str) -> tuple[bool, str]:
    from rlpipe.tpu.step import compile_recipe_step

    report = compile_recipe_step(cfg, generation)
    forward, update = report.forward, report.update
    whole = [graph for graph in (forward, update)
             if graph.dynamo_graphs == 1 and graph.graph_breaks == 0 and graph.stopped_at_chip]
    kernels = ", ".join(f"{name} x{count}" for name, count in sorted(forward.kernels.items())) or "none"
    collectives = {**forward.collectives, **{f"{k} (update)": v for k, v in update.collectives.items()}}
    width = f"packed row {report.packed_width}" if report.packed_width else "padded rows"
    why = (
        f"{report.layers} layers, rank 0 of {report.ranks}, {report.micro_batches} pass(es) of a {width}: forward and "
        f"loss {forward.dynamo_graphs} graph(s), {forward.graph_breaks} break(s); update {update.dynamo_graphs} "
        f"graph(s); kernels {kernels}; collectives {json.dumps(collectives)}; backward traced on CPU tensors only "
        "(autograd needs a chip)"
    )
    return len(whole) == 2, why, dataclasses.asdict(report)


def check_kernels(cfg, generation: str) -> tuple[bool, str]:
    from rlpipe.tpu.kernels import compile_case, recipe_cases, recipe_shapes, topology_devices

    chip = COMPILE_CHIPS.get(generation)
    if chip is None:
        return False, f"no compile-only topology here for TPU {generation}"
    devices = topology_devices(chip)
    results = [compile_case(case, chip, devices) for case in recipe_cases(cfg, recipe_shapes(cfg))]
    failed = [f"{r.case.kernel} [{r.case.shapes}]: {r.error}" for r in results if not r.compiled]
    if failed:
        return False, "; ".join(failed)
    vmem = max((r.kernel_vmem or 0 for r in results), default=0) / 2**20
    why = (f"{len(results)} programs for {chip} ({', '.join(r.case.kernel for r in results)}); largest kernel VMEM "
           f"{vmem:.1f} MiB")
    return True, why, {"chip": chip, "compiled": [r.case.kernel for r in results]}


# ------------------------------------------------------------------ the rehearsal


def rehearse(cfg, out=sys.stdout) -> list[Check]:
    """Every check, in the order of a real start; each printed as it ends."""
    from unittest import mock

    from rlpipe.tpu.hosts import environment_checks
    from rlpipe.tpu.step import name_tpu_device

    checks: list[Check] = []

    def run(what: str, check: Callable[[], tuple]) -> None:
        checks.append(_timed(what, check))
        print(checks[-1].line(), file=out, flush=True)

    generation = learner_generation(cfg)
    name_tpu_device()  # vLLM's config and the step both parse `tpu` devices
    with mock.patch.dict(os.environ, rollout_host_env(cfg)):
        for check in plan_checks(cfg):
            checks.append(check)
            print(check.line(), file=out, flush=True)
        started = time.perf_counter()
        found = environment_checks(cfg)
        for name, passed, why in found:
            checks.append(Check(name, passed, why, (time.perf_counter() - started) / max(1, len(found))))
            print(checks[-1].line(), file=out, flush=True)
        run("engines", lambda: check_engines(cfg))
        run("learner step", lambda: check_step(cfg, generation))
        run("kernels", lambda: check_kernels(cfg, generation))
    return checks


def rollout_host_env(cfg) -> dict[str, str]:
    """What a rollout host of the recipe's slice tells vllm-torchtpu about itself (GKE and TPU VMs set these):
    without them it asks the GCE metadata server, and takes a chip it does not recognise for TPU7x's geometry.
    Compiling takes no chip, so no host-wide libtpu lock either."""
    from rlpipe.hardware.tpu_layout import slice_shares

    env = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1"}
    share = slice_shares(cfg.placement).get("rollout")
    if share is not None:
        env.update(TPU_ACCELERATOR_TYPE=share.tslice.pod_type, TPU_NAME="rlpipe-rehearse", TPU_WORKER_ID="0")
    return env


def summary(checks: list[Check], seconds: float) -> str:
    failed = [check.what for check in checks if check.passed is False]
    verdict = f"{len(failed)} failed ({', '.join(failed)})" if failed else "all passed"
    return (f"rehearse: {len(checks)} checks, {verdict}, in {seconds / 60:.1f} min on this host; nothing ran on a "
            "chip, so the slice still has to show the compiled programs run")


def rehearse_command(cfg, json_path: str | None = None) -> int:
    """`rlpipe rehearse`: 0 when every check passed, 1 when one failed, 2 when it cannot rehearse here. `json_path`:
    where to write the checks as JSON too."""
    missing = missing_tpu_packages()
    if missing:
        print(f"rlpipe: rehearse needs the tpu extra (missing here: {', '.join(missing)}); install it in a Python 3.12 "
              "environment: pip install 'rlpipe[tpu]'", file=sys.stderr)
        return 2
    try:
        learner_generation(cfg)
    except ValueError as err:
        print(f"rlpipe: config error: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # one line per check, not vLLM's start-up log
    started = time.perf_counter()
    checks = rehearse(cfg)
    print(summary(checks, time.perf_counter() - started))
    if json_path:
        Path(json_path).write_text(json.dumps([dataclasses.asdict(check) for check in checks], indent=1))
    return 1 if any(check.passed is False for check in checks) else 0
