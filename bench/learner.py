"""`rlpipe bench learner`: GRPO train-step throughput of the learner (eager vs the captured graph, one rank vs two
SimpleFSDP ranks, MoE experts' implementations) on a random model, with MFU against the fp32 matmul peak here.

With `device="cuda"` the single-rank modes run on one GPU in bf16 mixed precision (float32 master weights, bf16
compute), and MFU is against the bf16 matmul peak of that GPU, measured in the same run. Nothing here imports Ray
or vLLM, so the benchmark runs on a machine that has only torch (and safetensors, pyyaml)."""

from __future__ import annotations

import json
import os
import queue as queue_module
import re
import tempfile
import time
from dataclasses import dataclass

import torch

from rlpipe.bench.common import in_fresh_process


@dataclass
class LearnerBenchShape:
    layers: int = 12
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1536
    vocab: int = 8192
    seq: int = 256
    batch: int = 8
    steps: int = 3
    experts: int = 0  # > 0: a Qwen3-MoE with this many experts in every layer
    top_k: int = 2
    expert_intermediate: int = 384
    group: int = 1  # > 1: consecutive rows share their prompt (the first half of seq), as a GRPO group's samples do
    family: str = "llama"  # the dense model_type: llama, or qwen3 (q/k norms, explicit head_dim)
    head_dim: int | None = None  # None: hidden // heads
    tied: bool = False  # the output projection is the input embedding

    def hf_config(self) -> dict:
        if self.experts:
            return {
                **self._llama_config(),
                "model_type": "qwen3_moe",
                "architectures": ["Qwen3MoeForCausalLM"],
                "num_experts": self.experts,
                "num_experts_per_tok": self.top_k,
                "moe_intermediate_size": self.expert_intermediate,
                "norm_topk_prob": True,
            }
        return self._llama_config()

    def _llama_config(self) -> dict:
        return {
            "model_type": self.family,
            "architectures": [_ARCHITECTURES[self.family]],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim or self.hidden // self.heads,
            "max_position_embeddings": max(4096, self.seq),
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
        }

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per weight multiply-add pass (forward + backward), plus attention scores."""
        head_dim = self.head_dim or self.hidden // self.heads
        if self.experts:  # the router, and gate, up, down of the k experts a token visits
            mlp = self.hidden * self.experts + self.top_k * 3 * self.hidden * self.expert_intermediate
        else:
            mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        per_layer = self.hidden * head_dim * (self.heads * 2 + self.kv_heads * 2) + mlp  # + q, o, k, v projections
        matmul_weights = self.layers * per_layer + self.vocab * self.hidden  # the embedding lookup is no matmul
        attention = self.layers * 2 * self.heads * head_dim * self.seq  # QK^T and PV, causal half on average
        return 6 * matmul_weights + 6 * attention


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Shapes of released models (their config.json's sizes; random weights), with the rows to time them on.
PRESETS = {
    "smollm2-135m": dict(
        family="llama", layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152, tied=True,
        seq=128, batch=32,
    ),
    "qwen3-0.6b": dict(
        family="qwen3", layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
        vocab=151936, tied=True, seq=2048, batch=8,
    ),
    # Half the rows of qwen3-0.6b: master weights, AdamW state and activations stay far inside one 141 GB H200.
    "qwen3-1.7b": dict(
        family="qwen3", layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
        vocab=151936, tied=True, seq=2048, batch=4,
    ),
    # No released model: Qwen3's layout at a size whose step takes a moment on a CPU, for checking the tooling
    # (scripts/device-check.sh with RLPIPE_CHECK_DEVICE=cpu).
    "tiny": dict(
        family="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=192, vocab=1024,
        tied=True, seq=64, batch=4,
    ),
}

# On cuda the learner keeps float32 master weights and AdamW state and computes in bf16 (SimpleFSDP's
# MixedPrecision, on one rank too), as a GPU run would.
CUDA_PRECISION = ("model.dtype=float32", "learner.param_dtype=bfloat16")
# bf16 is what the GPU computes in, so its dense bf16 matmul rate is the MFU denominator there.
CUDA_PEAK_DTYPE, CUDA_PEAK_SIZE = torch.bfloat16, 8192


def matmul_peak_gflops(seconds: float = 2.0, n: int = 2048, device: str = "cpu", dtype=torch.float32) -> float:
    """The rate of an n x n matmul on `device` in `dtype`: the MFU denominator. On cpu fp32 with the current thread
    count; on cuda the GPU's queue is drained before each clock read, so the time covers every matmul counted."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):  # the library's first-call set-up (cuBLAS handles, kernel choice) is not the rate
        a @ b
    _synchronize(torch.device(device))
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    _synchronize(torch.device(device))
    return 2 * n**3 * count / (time.perf_counter() - start) / 1e9


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`: a CUDA kernel launch returns before the kernel has run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def unsupported_modes(modes: list[str], device: str) -> str | None:
    """Why these modes cannot run on `device`, or None. On cuda one process drives one GPU: single-rank modes only."""
    if device == "cuda":
        other = [mode for mode in modes if mode.partition("+")[0].endswith("m2") or "xla" in mode]
        if other:
            return f"{', '.join(other)}: on cuda the modes run on one rank (eager, graph, eager-unshared)"
    return None


def _mode_settings(mode: str) -> tuple[bool, str, bool]:
    """A single-rank mode's (graph, experts' implementation, learner.share_prompts). `eager-unshared` is eager with
    every sample's prompt run on its own; a `+loop`, `+pallas` or `+torch` suffix picks the MoE experts' kernel."""
    run, _, experts = mode.partition("+")
    return run.startswith("graph"), experts or "torch", run != "eager-unshared"


def _lora_rank(mode: str) -> int | None:
    """`eager-lora16`: learner.lora with rank 16 (alpha 32, every linear layer); None: full fine-tuning."""
    found = re.search(r"-lora(\d+)", mode)
    return int(found.group(1)) if found else None


def _bench_config(
    model_path: str, shape: LearnerBenchShape, ranks: int, graph: bool, device: str = "cpu", experts: str = "torch",
    share_prompts: bool = True, lora_rank: int | None = None,
):
    from rlpipe.config import load_config

    # On xla one process holds the whole batch and the SPMD mesh splits its rows over the devices.
    micro_batch = shape.batch if device == "xla" else shape.batch // ranks
    return load_config(
        None,
        [
            f"model.path={model_path}",
            f"train.prompts_per_step={shape.batch // max(2, shape.group)}",
            f"rollout.group_size={max(2, shape.group)}",
            f"train.micro_batch_size={micro_batch}",
            f"train.steps={shape.steps + 2}",
            f"learner.ranks={ranks}",
            f"learner.device={device}",
            f"learner.graph={str(graph).lower()}",
            # Rows pad to seq; a graph step's packed micro-batch to exactly its packed length (every batch of the
            # bench has that one shape, so a bucket of its own is what a run's buckets would give it at best), with
            # the largest bucket the config check asks for beside it.
            f"learner.length_buckets=[{shape.seq}]",
            f"learner.packed_buckets={_packed_buckets(shape, micro_batch, share_prompts and not shape.experts)}",
            f"data.max_prompt_tokens={shape.seq // 2}",
            f"rollout.max_tokens={shape.seq // 2}",
            f"rollout.max_model_len={shape.seq}",
            f"model.kernels.experts={experts}",
            f"learner.share_prompts={str(share_prompts).lower()}",
            *(CUDA_PRECISION if device == "cuda" else ()),
            # On the GPU, rows without a shared prompt (all full length here) run padded: packing saves nothing,
            # and a packed graph row of micro_batch x seq tokens would attend with a dense mask over all of them.
            *(("learner.packing=false",) if device == "cuda" and shape.group == 1 else ()),
            *((f"learner.lora.rank={lora_rank}", "learner.lora.alpha=32") if lora_rank else ()),
        ],
    )


def _packed_buckets(shape: LearnerBenchShape, rows: int, share_prompts: bool) -> list[int]:
    """The longest packed row of `_batch`'s micro-batches of `rows` rows (each group's prompt once when shared), and
    `rows` whole rows end to end."""
    from rlpipe.models.packing import packed_length

    batch = _batch(shape)
    longest = 0
    for first in range(0, shape.batch, rows):
        part = batch.slice(first, first + rows)
        mask = part.completion_mask
        prompts = torch.where(mask.any(1), mask.int().argmax(1), part.lengths) if share_prompts else None
        longest = max(longest, packed_length(part.input_ids, part.lengths, prompts))
    return sorted({longest, rows * shape.seq})


def _batch(shape: LearnerBenchShape):
    from rlpipe.types import TrainBatch

    generator = torch.Generator().manual_seed(0)
    half = shape.seq // 2
    prompts = [torch.randint(0, shape.vocab, (half,), generator=generator).tolist() for _ in range(shape.batch)]
    prompts = [prompts[row - row % shape.group] for row in range(shape.batch)]
    completions = [torch.randint(0, shape.vocab, (half,), generator=generator).tolist() for _ in range(shape.batch)]
    logprobs = [[-2.0] * half for _ in range(shape.batch)]
    return TrainBatch.from_sequences(prompts, completions, logprobs, torch.randn(shape.batch, generator=generator).tolist())


def _time_rank(
    model_path: str, shape: LearnerBenchShape, ranks: int, graph: bool, rank: int = 0, port: int = 0,
    experts: str = "torch", share_prompts: bool = True, device: str = "cpu", lora_rank: int | None = None,
):
    """Seconds per train step on one rank after warm-up (which includes compilation in graph mode), the warm-up
    step's seconds, and the growth of peak memory over the loaded learner: resident memory on cpu (meaningful in a
    fresh process), allocated GPU memory on cuda."""
    import resource

    from rlpipe.training.learner import Learner
    from rlpipe.weightsync.form import weight_form

    config = _bench_config(model_path, shape, ranks, graph, device, experts=experts, share_prompts=share_prompts,
                           lora_rank=lora_rank)
    learner = Learner.from_config(model_path, config, rank, ranks, weight_form(config, model_path))
    learner.join_process_group("127.0.0.1", port)
    on_gpu = learner.engine.device if learner.engine.device.type == "cuda" else None
    if on_gpu is not None:
        torch.cuda.reset_peak_memory_stats(on_gpu)
        before = torch.cuda.memory_allocated(on_gpu)
    else:
        with open("/proc/self/statm") as f:
            before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    seconds, warmup = _timed_steps(learner, _batch(shape), shape.steps)
    if on_gpu is not None:
        peak = torch.cuda.max_memory_allocated(on_gpu)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return seconds, warmup, max(0, peak - before)


def _timed_steps(learner, batch, steps: int) -> tuple[float, float]:
    """Seconds per step over `steps` steps, after a first step (compilation included) timed on its own. The
    learner's device is drained before every clock read, so a step's time is its kernels' time, not their launch."""
    device = learner.engine.device
    _synchronize(device)
    started = time.perf_counter()
    learner.train_step(batch)
    _synchronize(device)
    warmup = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(steps):
        learner.train_step(batch)
    _synchronize(device)
    return (time.perf_counter() - started) / steps, warmup


def _single_rank_run(model_path, shape, mode, threads, device, results) -> None:
    torch.set_num_threads(threads)
    graph, experts, share_prompts = _mode_settings(mode)
    results.put(_time_rank(model_path, shape, 1, graph, experts=experts, share_prompts=share_prompts, device=device,
                           lora_rank=_lora_rank(mode)))


def _interleaved_run(model_path, shape, modes: list[str], rounds: int, threads: int, results) -> None:
    """Best seconds per step of each single-rank mode, the modes' steps taking turns for `rounds` rounds: on a
    machine shared with other work, load that comes and goes then slows every mode alike instead of whichever
    happened to run at the time."""
    from rlpipe.training.learner import Learner
    from rlpipe.weightsync.form import weight_form

    torch.set_num_threads(threads)
    batch = _batch(shape)
    learners = {}
    for mode in modes:
        graph, experts, share_prompts = _mode_settings(mode)
        config = _bench_config(model_path, shape, 1, graph, experts=experts, share_prompts=share_prompts,
                               lora_rank=_lora_rank(mode))
        learners[mode] = Learner.from_config(model_path, config, form=weight_form(config, model_path))
        learners[mode].train_step(batch)  # warm-up, compilation included
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(rounds):
        for mode, learner in learners.items():
            started = time.perf_counter()
            learner.train_step(batch)
            best[mode] = min(best[mode], time.perf_counter() - started)
    results.put(best)


def _time_xla(model_path: str, shape: LearnerBenchShape, devices: int):
    """Seconds per step of the xla learner (its step one XLA program), the first step's seconds (tracing and
    compiling), and what torch_xla counted: programs compiled, host syncs inside the step, ops run on the host."""
    from rlpipe.training.learner import Learner

    learner = Learner.from_config(model_path, _bench_config(model_path, shape, devices, True, "xla"))
    seconds, warmup = _timed_steps(learner, _batch(shape), shape.steps)
    step = learner.engine.ready()
    from rlpipe.kernels._xla import xla_kernel_routes

    kernels = learner.engine.kernels
    routes = xla_kernel_routes(kernels.attention, kernels.rmsnorm, kernels.logprob)
    return seconds, warmup, {
        "compiles": step.compiles, "hidden_syncs": step.graph_breaks, "fallback_ops": step.xla_fallbacks, "kernels": routes
    }


def _xla_main(model_path, shape, devices, queue):
    # A fresh process: the device count of PJRT's CPU client and SPMD mode are fixed when torch_xla starts.
    if os.environ.setdefault("PJRT_DEVICE", "CPU") == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(devices)
    try:
        queue.put(_time_xla(model_path, shape, devices))
    except Exception as err:  # reported by the parent
        queue.put(repr(err))


def _time_xla_process(model_path: str, shape: LearnerBenchShape, devices: int):
    result = in_fresh_process(_xla_main, model_path, shape, devices)
    if isinstance(result, str):
        raise RuntimeError(f"xla learner failed: {result}")
    return result


def _rank_main(rank, model_path, shape, graph, port, threads, queue):
    torch.set_num_threads(threads)
    try:
        queue.put((rank, _time_rank(model_path, shape, 2, graph, rank, port)))
    except Exception as err:  # reported by the parent, which would otherwise wait for a result forever
        queue.put((rank, repr(err)))


def _time_two_ranks(model_path: str, shape: LearnerBenchShape, graph: bool, threads: int):
    import torch.multiprocessing as mp

    from rlpipe.parallel.mesh import find_free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = find_free_port()
    procs = [
        context.Process(target=_rank_main, args=(r, model_path, shape, graph, port, threads, queue)) for r in range(2)
    ]
    for proc in procs:
        proc.start()
    results: dict = {}
    while len(results) < len(procs):
        try:
            rank, result = queue.get(timeout=5)
            results[rank] = result
        except queue_module.Empty:
            # A rank that dies without reporting (a crash in native code) would leave us waiting forever.
            dead = [r for r, proc in enumerate(procs) if proc.exitcode not in (None, 0) and r not in results]
            if dead:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} before reporting")
    for proc in procs:
        proc.join()
    for rank, result in results.items():
        if isinstance(result, str):
            raise RuntimeError(f"rank {rank} failed: {result}")
    return max(r[0] for r in results.values()), max(r[1] for r in results.values()), None


def bench_learner(
    shape: LearnerBenchShape, modes: list[str], out: str | None = None, rounds: int = 1, device: str = "cpu"
) -> list[dict]:
    """With `rounds` > 1 the single-rank modes are timed again in one process, taking turns step by step, and
    each reports its best step (see `_interleaved_run`); their first step and memory still come from a fresh
    process each. `device="cuda"`: single-rank modes on one GPU, bf16 mixed precision, one round."""
    from rlpipe.models import build_model, save_state_dict

    problem = unsupported_modes(modes, device) or next(
        (f"{mode}: -loraN is for the single-rank eager and graph modes" for mode in modes
         if _lora_rank(mode) and not re.fullmatch(r"(eager|graph)-lora\d+(\+\w+)?", mode)), None)
    if problem or (device == "cuda" and rounds > 1):
        raise ValueError(problem or "rounds > 1: on cuda the modes run one after another, in a process each")
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    tokens = shape.batch * shape.seq
    flops = shape.flops_per_token() * tokens
    counted = " (counting every sample's prompt)" if shape.group > 1 else ""
    if device == "cuda":
        device_name = torch.cuda.get_device_name()
        peak_kind = f"bf16 {CUDA_PEAK_SIZE}x{CUDA_PEAK_SIZE} matmul on {device_name}"
        peak = matmul_peak_gflops(n=CUDA_PEAK_SIZE, device="cuda", dtype=CUDA_PEAK_DTYPE)
        torch.cuda.empty_cache()  # the modes run in processes of their own; this one keeps only its context
        print(f"model: {shape}\n{peak_kind}: {peak / 1e3:.1f} TFLOP/s; {tokens} tokens a step{counted}; "
              f"{', '.join(CUDA_PRECISION)}")
    else:
        device_name, peak_kind = "cpu", f"fp32 2048x2048 matmul, {threads} threads"
        peak = matmul_peak_gflops()
        print(f"model: {shape}\nfp32 matmul peak here: {peak:.1f} GFLOP/s ({threads} threads); {tokens} tokens a step{counted}")
    rows = []

    def write(complete: bool) -> None:
        """The figures so far: written after every mode too, so a run stopped part-way keeps what it measured."""
        if not out:
            return
        for row in rows:
            row["speed_vs_baseline"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        with open(out, "w") as f:
            json.dump(
                {
                    "shape": shape.__dict__, "device": device, "device_name": device_name, "torch": torch.__version__,
                    "peak_gflops": peak, "peak": peak_kind, "baseline": modes[0], "modes": modes,
                    "complete": complete, "rows": rows,
                },
                f,
                indent=2,
            )

    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        save_state_dict(build_model(shape.hf_config()).state_dict(), shape.hf_config(), f"{folder}/model", overwrite=True)
        model_path = f"{folder}/model"
        for mode in modes:
            run = mode.partition("+")[0]
            graph = run.startswith("graph")
            xla, extra_bytes = {}, None
            if run in ("xla-graph", "xla-graph-m2"):  # torch_xla's environment only (scripts/setup-xla.sh)
                seconds, warmup, xla = _time_xla_process(model_path, shape, 2 if run.endswith("m2") else 1)
            elif run.endswith("m2"):
                seconds, warmup, extra_bytes = _time_two_ranks(model_path, shape, graph, max(1, threads // 2))
            else:  # a fresh process each, so that its peak memory is this mode's alone
                seconds, warmup, extra_bytes = in_fresh_process(
                    _single_rank_run, model_path, shape, mode, threads, device
                )
            row = {
                "mode": mode,
                "seconds_per_step": seconds,
                "first_step_seconds": warmup,
                "tokens_per_s": tokens / seconds,
                "mfu": flops / seconds / (peak * 1e9),
                "step_peak_extra_bytes": extra_bytes,
                **xla,
            }
            rows.append(row)
            counted = (
                f"  XLA programs compiled {xla['compiles']}, host syncs in the step {xla['hidden_syncs']}, "
                f"ops run on the host {xla['fallback_ops'] or 'none'}; kernels {xla['kernels']}"
                if xla
                else ""
            )
            where = " GPU" if device == "cuda" else ""
            memory = "" if extra_bytes is None else f"  step peak{where} +{extra_bytes / 2**20:7.1f} MiB"
            print(
                f"{mode:>12}: {row['tokens_per_s']:8.0f} tokens/s  MFU {100 * row['mfu']:5.1f}%  "
                f"first step {warmup:6.1f}s  ({seconds:.3f}s/step){memory}{counted}",
                flush=True,
            )
            write(complete=False)
        single = [row for row in rows if not row["mode"].partition("+")[0].endswith("m2") and "xla" not in row["mode"]]
        if rounds > 1 and single:
            modes_timed = [row["mode"] for row in single]
            best = in_fresh_process(_interleaved_run, model_path, shape, modes_timed, rounds, threads)
            print(f"best step of {rounds} interleaved rounds:", flush=True)
            for row in single:
                seconds = best[row["mode"]]
                row.update(seconds_per_step=seconds, tokens_per_s=tokens / seconds, mfu=flops / seconds / (peak * 1e9))
                print(f"{row['mode']:>12}: {row['tokens_per_s']:8.0f} tokens/s  ({seconds:.3f}s/step)", flush=True)
    base = rows[0]
    for row in rows:
        row["speed_vs_baseline"] = row["tokens_per_s"] / base["tokens_per_s"]
    print(f"speed against {base['mode']}: " + ", ".join(f"{r['mode']} {r['speed_vs_baseline']:.2f}x" for r in rows))
    if base["step_peak_extra_bytes"]:
        print(
            f"step peak memory against {base['mode']}: "
            + ", ".join(
                f"{r['mode']} {r['step_peak_extra_bytes'] / base['step_peak_extra_bytes']:.2f}x"
                for r in rows
                if r["step_peak_extra_bytes"] is not None
            )
        )
    write(complete=True)
    return rows
