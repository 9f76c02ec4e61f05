"""Benchmarks, reported as ratios against a baseline measured in the same run (these machines are noisy).

`rlpipe bench learner`: GRPO train-step throughput of the learner — eager vs the captured graph, one rank vs two
SimpleFSDP ranks — on a random Llama-shaped model, with MFU against this machine's fp32 matmul peak measured
in the same run. With `--experts N` the model is a Qwen3-MoE and a mode may name the experts' implementation
(`eager+loop`: transformers' per-expert loop; `eager`, `graph`: the grouped matmul), with each single-rank
mode's peak memory growth over the loaded learner.

`rlpipe bench e2e`: one GRPO workload (the default recipe's) run by rlpipe synchronous, rlpipe one-step
asynchronous and TRL's GRPOTrainer, each in a fresh process: samples/s, time to a reward, ratios against TRL.
"""

from __future__ import annotations

import json
import os
import queue as queue_module
import tempfile
import time
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch


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
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        }

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per weight multiply-add pass (forward + backward), plus attention scores."""
        head_dim = self.hidden // self.heads
        if self.experts:  # the router, and gate, up, down of the k experts a token visits
            mlp = self.hidden * self.experts + self.top_k * 3 * self.hidden * self.expert_intermediate
        else:
            mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        per_layer = self.hidden * head_dim * (self.heads * 2 + self.kv_heads * 2) + mlp  # + q, o, k, v projections
        matmul_weights = self.layers * per_layer + self.vocab * self.hidden  # the embedding lookup is no matmul
        attention = self.layers * 2 * self.heads * head_dim * self.seq  # QK^T and PV, causal half on average
        return 6 * matmul_weights + 6 * attention


def matmul_peak_gflops(seconds: float = 2.0, n: int = 2048) -> float:
    """This machine's fp32 matmul rate with the current thread count: the MFU denominator."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start) / 1e9


def _mode_settings(mode: str) -> tuple[bool, str, bool]:
    """A single-rank mode's (graph, experts' implementation, learner.share_prompts). `eager-unshared` is eager with
    every sample's prompt run on its own; a `+loop`, `+pallas` or `+torch` suffix picks the MoE experts' kernel."""
    run, _, experts = mode.partition("+")
    return run.startswith("graph"), experts or "torch", run != "eager-unshared"


def _bench_config(
    model_path: str, shape: LearnerBenchShape, ranks: int, graph: bool, device: str = "cpu", experts: str = "torch",
    share_prompts: bool = True,
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
            f"learner.length_buckets=[{shape.seq}]",
            f"data.max_prompt_tokens={shape.seq // 2}",
            f"rollout.max_tokens={shape.seq // 2}",
            f"rollout.max_model_len={shape.seq}",
            f"model.kernels.experts={experts}",
            f"learner.share_prompts={str(share_prompts).lower()}",
        ],
    )


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
    experts: str = "torch", share_prompts: bool = True,
):
    """Seconds per train step on one rank after warm-up (which includes compilation in graph mode), the warm-up
    step's seconds, and the growth of peak resident memory over the loaded learner (meaningful in a fresh process)."""
    import resource

    from rlpipe.learner import Learner

    config = _bench_config(model_path, shape, ranks, graph, experts=experts, share_prompts=share_prompts)
    learner = Learner(model_path, config, rank, ranks)
    learner.join_group("127.0.0.1", port)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    seconds, warmup = _timed_steps(learner, _batch(shape), shape.steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return seconds, warmup, max(0, peak - before)


def _timed_steps(learner, batch, steps: int) -> tuple[float, float]:
    """Seconds per step over `steps` steps, after a first step (compilation included) timed on its own."""
    started = time.perf_counter()
    learner.train_step(batch)
    warmup = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(steps):
        learner.train_step(batch)
    return (time.perf_counter() - started) / steps, warmup


def _single_rank_run(model_path, shape, mode, threads, results) -> None:
    torch.set_num_threads(threads)
    graph, experts, share_prompts = _mode_settings(mode)
    results.put(_time_rank(model_path, shape, 1, graph, experts=experts, share_prompts=share_prompts))


def _interleaved_run(model_path, shape, modes: list[str], rounds: int, threads: int, results) -> None:
    """Best seconds per step of each single-rank mode, the modes' steps taking turns for `rounds` rounds: on a
    machine shared with other work, load that comes and goes then slows every mode alike instead of whichever
    happened to run at the time."""
    from rlpipe.learner import Learner

    torch.set_num_threads(threads)
    batch = _batch(shape)
    learners = {}
    for mode in modes:
        graph, experts, share_prompts = _mode_settings(mode)
        config = _bench_config(model_path, shape, 1, graph, experts=experts, share_prompts=share_prompts)
        learners[mode] = Learner(model_path, config)
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
    from rlpipe.learner import Learner

    learner = Learner(model_path, _bench_config(model_path, shape, devices, True, "xla"))
    seconds, warmup = _timed_steps(learner, _batch(shape), shape.steps)
    step = learner.graph_step
    from rlpipe.kernels._xla import xla_kernel_routes

    kernels = learner.kernels
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
    result = _in_fresh_process(_xla_main, model_path, shape, devices)
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


def bench_learner(shape: LearnerBenchShape, modes: list[str], out: str | None = None, rounds: int = 1) -> list[dict]:
    """With `rounds` > 1 the single-rank modes are timed again in one process, taking turns step by step, and
    each reports its best step (see `_interleaved_run`); their first step and memory still come from a fresh
    process each."""
    from rlpipe.models import build_model, save_state_dict

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    peak = matmul_peak_gflops()
    tokens = shape.batch * shape.seq
    flops = shape.flops_per_token() * tokens
    counted = " (counting every sample's prompt)" if shape.group > 1 else ""
    print(f"model: {shape}\nfp32 matmul peak here: {peak:.1f} GFLOP/s ({threads} threads); {tokens} tokens a step{counted}")
    rows = []
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
                seconds, warmup, extra_bytes = _in_fresh_process(_single_rank_run, model_path, shape, mode, threads)
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
            memory = "" if extra_bytes is None else f"  step peak +{extra_bytes / 2**20:7.1f} MiB"
            print(
                f"{mode:>12}: {row['tokens_per_s']:8.0f} tokens/s  MFU {100 * row['mfu']:5.1f}%  "
                f"first step {warmup:6.1f}s  ({seconds:.3f}s/step){memory}{counted}",
                flush=True,
            )
        single = [row for row in rows if not row["mode"].partition("+")[0].endswith("m2") and "xla" not in row["mode"]]
        if rounds > 1 and single:
            modes_timed = [row["mode"] for row in single]
            best = _in_fresh_process(_interleaved_run, model_path, shape, modes_timed, rounds, threads)
            print(f"best step of {rounds} interleaved rounds:", flush=True)
            for row in single:
                seconds = best[row["mode"]]
                row.update(seconds_per_step=seconds, tokens_per_s=tokens / seconds, mfu=flops / seconds / (peak * 1e9))
                print(f"{row['mode']:>12}: {row['tokens_per_s']:8.0f} tokens/s  ({seconds:.3f}s/step)", flush=True)
    base = rows[0]
    print(f"speed against {base['mode']}: " + ", ".join(f"{r['mode']} {r['tokens_per_s'] / base['tokens_per_s']:.2f}x" for r in rows))
    if base["step_peak_extra_bytes"]:
        print(
            f"step peak memory against {base['mode']}: "
            + ", ".join(
                f"{r['mode']} {r['step_peak_extra_bytes'] / base['step_peak_extra_bytes']:.2f}x"
                for r in rows
                if r["step_peak_extra_bytes"] is not None
            )
        )
    if out:
        with open(out, "w") as f:
            json.dump({"shape": shape.__dict__, "peak_gflops": peak, "rows": rows}, f, indent=2)
    return rows


# ---------------------------------------------------------------- weight sync

# Llama-shaped configs for `rlpipe bench sync`: SmolLM2-135M's shapes, and a ~500M-parameter one.
SYNC_MODELS = {
    "smollm2-135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True},
    "random-500m": {"hidden_size": 1280, "num_hidden_layers": 24, "num_attention_heads": 20, "num_key_value_heads": 4,
                    "intermediate_size": 3456, "vocab_size": 32000, "tie_word_embeddings": False},
}


def sync_model_config(name: str) -> dict:
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu"}
    return {**base, **SYNC_MODELS[name]}


def copy_bandwidth(nbytes: int) -> Callable[[int], tuple[float, float | None]]:
    """A measurement of this host's copy bandwidth between two preallocated buffers of `nbytes`: called with a
    repeat count, it returns the best GB/s of torch's copy_ on all threads (the memcpy figure) and of the packing
    loop's one-thread streaming copy-and-checksum (None without it), which here often beats copy_ and so is the
    stricter yardstick. Measured again next to every timed sync, so both see the machine in the same state."""
    from rlpipe.weightsync import native

    source, target = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8)
    streaming = native.copy_checksum()
    copies = {"memcpy": lambda: target.copy_(source)}
    if streaming is not None:
        copies["streaming"] = lambda: streaming(source.numpy(), target.numpy(), 0)
    for copy in copies.values():
        copy()  # first touch

    def measure(repeats: int) -> tuple[float, float | None]:
        rates = {}
        for name, copy in copies.items():
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                copy()
                best = min(best, time.perf_counter() - started)
            rates[name] = nbytes / best / 1e9
        return rates["memcpy"], rates.get("streaming")

    return measure


def bench_sync(models: list[str], transports: list[str], ranks: list[int], bucket_mb: float, repeats: int,
               out: str | None = None) -> list[dict]:
    """Learner ranks (Ray actors holding random weights sharded as SimpleFSDP stores them) stream one version to
    a receiving actor through each transport, with the code the real actors run: pack, transport, checksum,
    assemble. The engine's own write is not part of it (`sync/write_s` in a run's metrics shows that)."""
    import ray

    from actors.groups import start_ray
    from rlpipe.config import load_config
    from rlpipe.models import build_model
    from rlpipe.weightsync import EngineLayout, plan_sync

    start_ray(load_config(None, [f"ray.num_cpus={max(ranks) + 2}"]))
    sender_cls, receiver_cls = _sync_bench_actors()
    rows = []
    for model in models:
        hf_config = sync_model_config(model)
        with torch.device("meta"):
            shapes = {name: tuple(t.shape) for name, t in build_model(hf_config).state_dict().items()}
        layout = EngineLayout.from_hf_config(hf_config, 1, "float32")
        for rank_count in ranks:
            plan = plan_sync(shapes, rank_count, layout, int(bucket_mb * 2**20))
            copy_rates = copy_bandwidth(min(plan.nbytes, 512 * 2**20))
            print(f"{model}: {plan.nbytes / 1e9:.2f} GB in {len(plan.buckets)} buckets, M={rank_count}; memcpy = torch "
                  f"copy_ on {torch.get_num_threads()} threads, streaming copy = one thread, both measured before "
                  "every sync, best of all", flush=True)
            for transport in transports:
                senders = [sender_cls.remote(plan, rank, transport) for rank in range(rank_count)]
                receiver = receiver_cls.remote(plan, transport)
                if transport == "shm":  # as the run does: every rank writes into rank 0's segments
                    prefix = ray.get(senders[0].buffer_prefix.remote())
                    ray.get([s.share_buffers.remote(prefix) for s in senders])
                if transport == "gloo":
                    from rlpipe.parallel.mesh import find_free_port

                    port, world = find_free_port(), rank_count + 1
                    ray.get([s.connect.remote(port, world) for s in senders] + [receiver.connect.remote(port, world)])
                times, copies = [], []
                for version in range(1, repeats + 1):
                    copies.append(copy_rates(2))
                    ray.get(receiver.begin.remote(version))
                    started = time.perf_counter()
                    ray.get([s.send.remote(version, receiver) for s in senders])
                    receiving = ray.get(receiver.finish.remote())
                    times.append((time.perf_counter() - started, receiving))
                    ray.get([s.release.remote() for s in senders])
                ray.get([s.close.remote() for s in senders])
                for handle in [*senders, receiver]:
                    ray.kill(handle)
                seconds, receiving = min(times)
                baseline = max(memcpy for memcpy, _ in copies)
                streaming = max((rate for _, rate in copies if rate), default=None)
                row = {"model": model, "ranks": rank_count, "transport": transport, "bytes": plan.nbytes,
                       "seconds": seconds, "receiver_busy_s": receiving, "gbps": plan.nbytes / seconds / 1e9,
                       "memcpy_gbps": baseline, "streaming_copy_gbps": streaming}
                rows.append(row)
                strict = f" = {row['gbps'] / streaming:5.1%} of streaming copy" if streaming else ""
                print(f"  {transport:>4}: {row['gbps']:5.2f} GB/s = {row['gbps'] / baseline:5.1%} of memcpy "
                      f"({baseline:.1f} GB/s){strict}{f' ({streaming:.1f})' if streaming else ''}  "
                      f"({seconds:.2f} s, receiver busy {receiving:.2f} s; best of {repeats})", flush=True)
    ray.shutdown()
    if out:
        with open(out, "w") as f:
            json.dump({"bucket_mb": bucket_mb, "rows": rows}, f, indent=2)
    return rows


def _sync_bench_actors():
    import ray

    from actors.groups import compute_env
    from actors.learner import send_parts
    from rlpipe.weightsync import Staging, make_transport, shard_rows

    # The same thread allowance as the real roles.
    @ray.remote(num_cpus=1, runtime_env={"env_vars": compute_env()})
    class Sender:
        def __init__(self, plan, rank, transport):
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.learner_ranks))  # as LearnerActor does
            generator = torch.Generator().manual_seed(rank)
            self.plan, self.rank, self.transport = plan, rank, make_transport(transport)
            self.local = {}
            for name, shape in plan.shapes.items():
                start, stop = shard_rows(shape[0], rank, plan.learner_ranks)
                self.local[name] = torch.randn((stop - start, *shape[1:]), generator=generator)

        def connect(self, port, world):
            self.transport.connect("127.0.0.1", port, self.rank, self.plan.learner_ranks, world, 300)

        def buffer_prefix(self):
            return self.transport.buffer_prefix()

        def share_buffers(self, prefix):
            self.transport.share_buffers(prefix)

        def send(self, version, receiver):
            started = time.perf_counter()
            send_parts(self.plan, self.rank, self.local, self.transport, [receiver], version)
            return time.perf_counter() - started

        def release(self):
            self.transport.release()

        def close(self):
            self.transport.close()

    @ray.remote(num_cpus=1, runtime_env={"env_vars": compute_env()}, concurrency_groups={"sync": 1})
    class Receiver:
        def __init__(self, plan, transport):
            self.plan, self.transport, self.staging = plan, make_transport(transport), None
            self.busy = 0.0  # seconds spent receiving (transport, checksum, assembly)

        def connect(self, port, world):
            self.transport.connect("127.0.0.1", port, world - 1, self.plan.learner_ranks, world, 300)

        def begin(self, version):
            # As the engine does: adopt what the transport hands over in place where it can, reuse owned memory.
            reuse = self.staging.owned if self.staging else None
            self.staging = Staging(self.plan, version, reuse, adopt_buffers=self.transport.stable_receive_buffers,
                                   whole_buckets=self.transport.whole_buckets)

        @ray.method(concurrency_group="sync")
        def receive_part(self, version, bucket, rank, handle, nbytes, digest):
            started = time.perf_counter()
            with self.transport.receive(handle, rank, nbytes) as buffer:
                self.staging.add(bucket, rank, buffer, digest)
            self.busy += time.perf_counter() - started
            return nbytes

        def finish(self):
            self.staging.complete()
            busy, self.busy = self.busy, 0.0
            return busy

    return Sender, Receiver


# ---------------------------------------------------------------- kernels

# Output projections of real models: vocabulary -> hidden size (SmolLM2-135M, Qwen3-0.6B).
LOGPROB_BENCH_WIDTHS = {49152: 576, 151936: 1024}


def _logprob_run(vocab: int, width: int, tokens: int, impl: str, chunk: int, repeats: int, results) -> None:
    """In a fresh process, so that its peak resident memory belongs to this one implementation alone."""
    import resource

    from rlpipe.kernels import linear_logprob

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator).requires_grad_()
    weight = (0.02 * torch.randn(vocab, width, generator=generator)).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    upstream = torch.randn(tokens, generator=generator)

    def run() -> None:
        logprob, _ = linear_logprob(hidden, weight, targets, impl=impl, chunk=chunk)
        torch.autograd.grad((logprob * upstream).sum(), (hidden, weight))

    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    results.put({"seconds": best, "extra_bytes": max(0, peak - before)})


def _in_fresh_process(target, *args):
    """`target(*args, results)` in a spawned process; returns what it put on `results`. A fresh process per
    measurement keeps peak memory (and vLLM engines) from one measurement out of the next."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=target, args=(*args, results))
    child.start()
    while True:
        try:
            result = results.get(timeout=5)
            break
        except queue_module.Empty:
            # A child that dies without reporting (a crash in native code) would leave us waiting forever.
            if child.exitcode is not None:
                try:  # it may have reported just before exiting
                    result = results.get(timeout=1)
                    break
                except queue_module.Empty:
                    raise RuntimeError(f"{target.__name__} exited with code {child.exitcode} without a result") from None
    child.join()
    return result


def bench_kernels(vocabs: list[int], tokens_list: list[int], chunk: int, repeats: int, out: str | None = None) -> list[dict]:
    """Log-probs through the output projection, forward and backward: the chunked path against whole logits
    (`reference`), each in its own process. Memory is the peak resident growth over the inputs."""
    rows = []
    for vocab in vocabs:
        width = LOGPROB_BENCH_WIDTHS.get(vocab, 1024)
        for tokens in tokens_list:
            logits_gb = tokens * vocab * 4 / 1e9
            print(f"vocab {vocab}, hidden {width}, {tokens} tokens (fp32 logits alone: {logits_gb:.2f} GB)", flush=True)
            measured = {
                impl: _in_fresh_process(_logprob_run, vocab, width, tokens, impl, chunk, repeats)
                for impl in ("reference", "chunked")
            }
            base = measured["reference"]
            for impl, result in measured.items():
                row = {"vocab": vocab, "hidden": width, "tokens": tokens, "impl": impl, "chunk": chunk, **result,
                       "speed_vs_reference": base["seconds"] / result["seconds"],
                       "memory_vs_reference": result["extra_bytes"] / max(1, base["extra_bytes"])}
                rows.append(row)
                print(f"  {impl:>9}: {result['seconds']:6.2f} s ({row['speed_vs_reference']:.2f}x speed), "
                      f"peak +{result['extra_bytes'] / 1e9:5.2f} GB ({row['memory_vs_reference']:.1%} of reference)",
                      flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return rows


# ---------------------------------------------------------------- learner / rollout agreement

AGREEMENT_QUESTIONS = [
    "What is 17 + 25?", "Name three primary colours.", "Write a haiku about rain.", "What is the capital of France?",
    "Explain what a prime number is.", "Compute 9 * 8.", "List the days of the week.", "What does a compiler do?",
]


def _agreement_run(model_path: str, impl: str, dtype: str, prompts: int, samples: int, max_tokens: int, results) -> None:
    """One engine (vLLM's model or rlpipe's inside vLLM) samples completions; the fp32 learner model scores the
    same tokens. In a fresh process, so engines never share one."""
    from transformers import AutoTokenizer

    from rlpipe.config import RolloutConfig
    from rlpipe.data import render_prompt
    from rlpipe.learner import token_logprobs
    from rlpipe.models import load_model
    from rlpipe.rollout import RolloutEngine
    from rlpipe.types import Prompt

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    questions = [AGREEMENT_QUESTIONS[i % len(AGREEMENT_QUESTIONS)] for i in range(prompts)]
    batch = [Prompt(i, q, render_prompt(tokenizer, q, None)) for i, q in enumerate(questions)]
    engine = RolloutEngine(model_path, RolloutConfig(dtype=dtype, model_impl=impl, max_tokens=max_tokens), seed=0)
    groups = engine.generate(batch, samples, temperature=1.0)
    engine.close()
    model = load_model(model_path).eval()
    gaps = []
    with torch.no_grad():
        for prompt, completions in zip(batch, groups):
            for completion in completions:
                ids = torch.tensor([prompt.token_ids + completion.token_ids])
                learner = token_logprobs(model, ids)[0, len(prompt.token_ids) :]
                gaps.append(learner - torch.tensor(completion.logprobs))
    gap = torch.cat(gaps).double()
    results.put({
        "tokens": gap.numel(),
        "mean_abs": gap.abs().mean().item(),
        "max_abs": gap.abs().max().item(),
        "kl_k3": (torch.exp(gap) - gap - 1).mean().item(),  # KL(rollout || learner) on the rollout's samples
    })


def bench_agreement(model: str, impls: list[str], dtypes: list[str], prompts: int, samples: int, max_tokens: int,
                    out: str | None = None) -> list[dict]:
    """|learner - rollout| log-prob of the sampled tokens, for each engine model and dtype; the learner runs
    rlpipe's model in fp32 (the default learner)."""
    from rlpipe.models.builtin import resolve_model_path

    model_path = resolve_model_path(model)
    rows = []
    print(f"{model_path}: {prompts} prompts x {samples} samples x up to {max_tokens} tokens, learner fp32", flush=True)
    for dtype in dtypes:
        for impl in impls:
            measured = _in_fresh_process(_agreement_run, model_path, impl, dtype, prompts, samples, max_tokens)
            row = {"model_impl": impl, "dtype": dtype, **measured}
            rows.append(row)
            print(f"  engine {impl:>6} {dtype:>8}: mean |d logprob| {row['mean_abs']:.3g}, max {row['max_abs']:.3g}, "
                  f"KL {row['kl_k3']:.3g} over {row['tokens']} tokens", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"model": model_path, "rows": rows}, f, indent=2)
    return rows


# ---------------------------------------------------------------- end to end: rlpipe sync / async vs TRL

E2E_MODELS = {"tiny": "a random 2-layer Qwen3 (hidden 64) with a 384-token BPE", "smollm2-135m": "builtin:smollm2-135m-instruct"}
E2E_SYSTEMS = ("rlpipe-sync", "rlpipe-async")  # and one "trl-<generation>" row per TRL generation mode
# TRL's generation paths on CPU: model.generate (hf), transformers' continuous batching (hf-cb), colocated vLLM with
# vLLM's model code or with vLLM's Transformers backend (vllm-colocate, vllm-colocate-tf).
TRL_GENERATION = ("hf", "hf-cb", "vllm-colocate", "vllm-colocate-tf")
# Where rlpipe and TRL differ by design; neither can be set to the other's choice.
E2E_DIFFERENCES = (
    "importance correction: rlpipe weights tokens by min(exp(learner - engine logprob), 2) (algo.tis_cap, computed "
    "from the training forward); TRL vllm-colocate: vllm_importance_sampling_mode=token_truncate with clip_max 2, "
    "computed in an extra no-grad forward over the step's samples; TRL hf generation has no engine/learner gap",
    "clipping: both 0.2 below / 0.28 above; rlpipe counts a tie as unclipped, TRL takes torch.min",
    "advantages: both (r - group mean) / group std, TRL adds 1e-4 to the std",
    "rlpipe runs as Ray actors (engine, learner, reward worker) with a weight sync and a logprob probe after each "
    "step; TRL runs in one process (colocated vLLM gets the weights by load_weights, HF generation uses the model)",
)


@dataclass
class E2ESpec:
    """The one GRPO workload every system is configured from: the default recipe's task, prompts, reward and
    algorithm, with only these changed."""

    model_path: str
    steps: int = 4
    output_dir: str = "runs/bench-e2e"
    recipe: str | None = None  # default: configs/default.yaml

    def recipe_path(self) -> str:
        from pathlib import Path

        return self.recipe or str(Path(__file__).resolve().parent.parent / "configs" / "default.yaml")


def e2e_settings(spec: E2ESpec, trl_generation: tuple[str, ...] = ("hf",)) -> dict[str, dict]:
    """Each system's settings, all derived from `spec`: rlpipe's as config overrides (sync: max_staleness 0,
    async: 1), TRL's as GRPOConfig keyword arguments plus the dataset rows in rlpipe's sampling order."""
    common = [
        f"model.path={spec.model_path}",
        f"train.steps={spec.steps}",
        "train.warmup_steps=0",  # rlpipe's factor is (step + 1) / warmup: warm-up 1 is no warm-up; HF's would be 0 at step 0
        "data.eval_size=0",  # no greedy before/after evaluation: not part of the workload
        "metrics.tensorboard=false",
        "metrics.plot=false",
        "metrics.export=false",
        f"run.output_dir={spec.output_dir}",
        "run.overwrite=true",
    ]
    settings: dict[str, dict] = {
        name: {"overrides": [*common, f"run.name={name}", f"train.max_staleness={staleness}"]}
        for name, staleness in (("rlpipe-sync", 0), ("rlpipe-async", 1))
    }
    cfg = _e2e_config(spec, settings["rlpipe-sync"]["overrides"])
    rows = e2e_prompt_rows(cfg)
    for generation in trl_generation:
        settings[f"trl-{generation}"] = {
            "generation": generation,
            "grpo_config": _trl_config_kwargs(cfg, generation, f"{spec.output_dir}/trl-{generation}"),
            "rows": rows,
            "reward_functions": [dataclasses.asdict(f) for f in cfg.reward.functions],
            "system_prompt": cfg.data.system_prompt,
            "max_prompt_tokens": cfg.data.max_prompt_tokens,
        }
    return settings


def _e2e_config(spec: E2ESpec, overrides: list[str]):
    from rlpipe.config import load_config

    return load_config(spec.recipe_path(), overrides)


def e2e_prompt_rows(cfg) -> list[dict]:
    """The rows rlpipe's controller draws, step by step, in its order (its Sampler with run.seed): TRL reads
    them in this order with its own shuffling off. `entry` travels as JSON text (the verifier reads both)."""
    from rlpipe.data import Sampler, load_rows

    train_rows, _ = load_rows(cfg.data, cfg.run.seed)
    sampler = Sampler(len(train_rows), cfg.run.seed)
    order = [i for _ in range(cfg.train.steps) for i in sampler.next(cfg.train.prompts_per_step)]
    return [
        {
            "question": train_rows[i]["question"],
            "answer": train_rows[i]["answer"],
            "entry": json.dumps(train_rows[i]["entry"]),
        }
        for i in order
    ]


def _trl_config_kwargs(cfg, generation: str, output_dir: str) -> dict:
    """GRPOConfig (trl 1.16) fields for the same workload: one generation of prompts_per_step x group_size
    completions per optimizer step, micro-batches of train.micro_batch_size, fp32, constant LR, no KL."""
    if generation not in TRL_GENERATION:
        raise ValueError(f"TRL generation {generation!r} (known: {', '.join(TRL_GENERATION)})")
    samples = cfg.train.prompts_per_step * cfg.rollout.group_size
    micro = cfg.train.micro_batch_size
    if (cfg.train.mini_batch_size or samples) != samples:
        raise ValueError("the e2e bench compares one optimizer step per GRPO step (train.mini_batch_size null)")
    kwargs = {
        "output_dir": output_dir,
        "max_steps": cfg.train.steps,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": samples // micro,  # one optimizer step per generation batch ...
        "generation_batch_size": samples,  # ... of prompts_per_step x num_generations completions
        "num_generations": cfg.rollout.group_size,
        "max_completion_length": cfg.rollout.max_tokens,
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "top_k": 0,
        "learning_rate": cfg.train.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "adam_beta1": cfg.train.betas[0],
        "adam_beta2": cfg.train.betas[1],
        "adam_epsilon": cfg.train.adam_eps,
        "weight_decay": cfg.train.weight_decay,
        "max_grad_norm": cfg.train.grad_clip,
        "beta": cfg.algo.kl_beta,
        "epsilon": cfg.algo.clip_low,
        "epsilon_high": cfg.algo.clip_high,
        "loss_type": "dapo",  # token sum over the accumulated batch / its token count = rlpipe's token-mean
        "scale_rewards": cfg.algo.advantage_scale,
        "num_iterations": 1,
        "shuffle_dataset": False,  # the rows come in rlpipe's sampling order
        "seed": cfg.run.seed,
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "gradient_checkpointing": cfg.learner.activation_checkpointing,
        "model_init_kwargs": {"dtype": cfg.model.dtype},
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    if generation == "hf-cb":
        kwargs["use_transformers_continuous_batching"] = True
    if generation.startswith("vllm-colocate"):
        kwargs.update(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            vllm_max_model_length=cfg.rollout.max_model_len,
            vllm_importance_sampling_correction=cfg.algo.tis_cap is not None,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=cfg.algo.tis_cap,
            vllm_model_impl="transformers" if generation == "vllm-colocate-tf" else "vllm",
        )
    return kwargs


def e2e_workload(name: str, settings: dict, spec: E2ESpec) -> dict:
    """The workload a system's settings describe, read back through that system's own config classes (rlpipe's
    load_config; TRL's GRPOConfig, whose __post_init__ resolves the batch sizes): equal for every system."""
    if name.startswith("rlpipe"):
        cfg = _e2e_config(spec, settings["overrides"])
        samples = cfg.samples_per_step
        return {
            "model": cfg.model.path,
            "steps": cfg.train.steps,
            "prompts_per_step": cfg.train.prompts_per_step,
            "group_size": cfg.rollout.group_size,
            "max_completion_tokens": cfg.rollout.max_tokens,
            "temperature": cfg.rollout.temperature,
            "top_p": cfg.rollout.top_p,
            "lr": cfg.train.lr,
            "lr_per_step": [cfg.train.lr * _lr_factor(cfg, s) for s in range(cfg.train.steps)],
            "optimizer_steps_per_step": samples // (cfg.train.mini_batch_size or samples),
            "micro_batch_size": cfg.train.micro_batch_size,
            "adam": (*cfg.train.betas, cfg.train.adam_eps, cfg.train.weight_decay),
            "grad_clip": cfg.train.grad_clip,
            "kl_beta": cfg.algo.kl_beta,
            "clip": (cfg.algo.clip_low, cfg.algo.clip_high),
            "advantage_scale": cfg.algo.advantage_scale,
            "loss_agg": cfg.algo.loss_agg,
            "dtype": (cfg.model.dtype, cfg.rollout.dtype),
            "seed": cfg.run.seed,
            "system_prompt": cfg.data.system_prompt,
            "rows": [r["question"] for r in e2e_prompt_rows(cfg)],
            "reward_functions": [dataclasses.asdict(f) for f in cfg.reward.functions],
        }
    from trl import GRPOConfig

    args = GRPOConfig(**settings["grpo_config"])
    optimizer_steps = args.steps_per_generation // args.gradient_accumulation_steps
    return {
        "model": spec.model_path,
        "steps": args.max_steps,
        "prompts_per_step": args.generation_batch_size // args.num_generations,
        "group_size": args.num_generations,
        "max_completion_tokens": args.max_completion_length,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "lr": args.learning_rate,
        "lr_per_step": [args.learning_rate] * args.max_steps if args.lr_scheduler_type == "constant" and not args.warmup_steps else None,
        "optimizer_steps_per_step": optimizer_steps,
        "micro_batch_size": args.per_device_train_batch_size,
        "adam": (args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay),
        "grad_clip": args.max_grad_norm,
        "kl_beta": args.beta,
        "clip": (args.epsilon, args.epsilon_high),
        "advantage_scale": args.scale_rewards,
        "loss_agg": {"dapo": "token-mean"}.get(args.loss_type, args.loss_type),
        "dtype": (args.model_init_kwargs["dtype"], "float32" if not (args.bf16 or args.fp16) else "mixed"),
        "seed": args.seed,
        "system_prompt": settings["system_prompt"],
        "rows": [r["question"] for r in settings["rows"]] if not args.shuffle_dataset else None,
        "reward_functions": settings["reward_functions"],
    }


def _lr_factor(cfg, step: int) -> float:
    from rlpipe.learner import lr_factor

    return lr_factor(step, cfg.train.warmup_steps, cfg.train.steps, cfg.train.lr_schedule, cfg.train.min_lr_ratio)


class TrlReward:
    """An rlpipe reward function (`rewards` contract: fn(prompts, completions, **columns)) in TRL's reward-function
    signature: TRL passes chat messages, the dataset's columns, completion ids and its own extras (trainer_state,
    log_extra, ...). The prompt it hands on is the question, as rlpipe's reward pool does, and the columns rlpipe
    adds per sample (completion_tokens, finish_reason, max_tokens) are filled in."""

    def __init__(self, name: str, weight: float = 1.0, kwargs: dict | None = None, max_tokens: int | None = None,
                 eos_token_id: int | None = None, **_):
        from rewards import load_reward
        from rewards.registry import display_name

        self.fn, self.weight, self.kwargs = load_reward(name), weight, dict(kwargs or {})
        self.max_tokens, self.eos_token_id = max_tokens, eos_token_id
        self.__name__ = display_name(name)  # TRL names the reward's metrics after it

    def __call__(self, prompts, completions, completion_ids=None, **columns):
        questions = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        data = {k: v for k, v in columns.items() if isinstance(v, list) and len(v) == len(texts)}
        data.pop("question", None)  # rlpipe hands the prompt field over as `prompts`, not as a column
        if completion_ids is not None:
            data["completion_tokens"] = [len(ids) for ids in completion_ids]
            data["finish_reason"] = ["stop" if ids and ids[-1] == self.eos_token_id else "length" for ids in completion_ids]
            data["max_tokens"] = [self.max_tokens] * len(texts)
        scores = self.fn(questions, texts, **data, **self.kwargs)
        out = []
        for score in scores:
            if isinstance(score, dict):
                score = score.get("score")
            out.append(None if score is None else self.weight * float(score))
        return out


def _trl_dataset_rows(rows: list[dict], system_prompt: str | None) -> list[dict]:
    """Conversational prompts: TRL templates them with add_generation_prompt, as rlpipe's render_prompt does."""
    def messages(question: str) -> list[dict]:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return [*system, {"role": "user", "content": question}]

    return [{"prompt": messages(r["question"]), **r} for r in rows]


def _e2e_trl_run(model_path: str, settings: dict, results) -> None:
    """TRL's GRPOTrainer on the workload, in a fresh process. Timed: from the trainer's on_train_begin to the end of
    each optimizer step (model loading, vLLM start and trainer set-up come before)."""
    try:
        results.put(_e2e_trl(model_path, settings))
    except BaseException as err:  # reported as the row's error, with the exception's last line
        import traceback

        results.put({"error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}",
                     "traceback": traceback.format_exc()[-4000:]})


def _e2e_trl(model_path: str, settings: dict) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if settings["generation"].startswith("vllm-colocate"):
        # vLLM on CPU, in this process (ENVIRONMENT.md): as rlpipe's engine is set up.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    started = time.perf_counter()
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlpipe.data import render_prompt

    if settings["generation"].startswith("vllm-colocate"):
        import functools

        import trl.generation.vllm_generation as vllm_generation

        # TRL builds LLM(...) with dtype "auto", which vLLM-on-CPU turns into bf16 for an fp32 checkpoint; rlpipe's
        # engine runs fp32 (rollout.dtype), so the engine gets the same dtype here. Nothing else is changed.
        vllm_generation.LLM = functools.partial(vllm_generation.LLM, dtype="float32")

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = _trl_dataset_rows(settings["rows"], settings["system_prompt"])
    # The same prompt tokens as rlpipe's (render_prompt), as TRL will template them.
    for row in rows[:8]:
        ours = render_prompt(tokenizer, row["question"], settings["system_prompt"])
        theirs = tokenizer.apply_chat_template(conversation=[row["prompt"]], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"][0]
        if list(theirs) != ours:
            raise RuntimeError(f"TRL's prompt tokens differ from rlpipe's for {row['question']!r}")
    config = settings["grpo_config"]
    rewards = [TrlReward(**spec, max_tokens=config["max_completion_length"], eos_token_id=tokenizer.eos_token_id)
               for spec in settings["reward_functions"]]

    class Timer(TrainerCallback):
        def __init__(self):
            self.start, self.ends, self.logs = None, [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    timer = Timer()
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=rewards,
        args=GRPOConfig(**config),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    setup_s = time.perf_counter() - started
    trainer.train()
    per_step = [b - a for a, b in zip([timer.start, *timer.ends], timer.ends)]
    samples = config["generation_batch_size"]
    steps = []
    for index, seconds in enumerate(per_step):
        logs = timer.logs[index] if index < len(timer.logs) else {}
        steps.append({"step": index + 1, "seconds": seconds, "reward": logs.get("reward"), "samples": samples,
                      "completion_tokens": logs.get("completions/mean_length", 0.0) * samples})
    return {"steps": steps, "setup_s": setup_s, "last_log": timer.logs[-1] if timer.logs else {}}


def _e2e_rlpipe_run(spec: E2ESpec, overrides: list[str], results) -> None:
    """rlpipe's `train(cfg)` in a fresh process. Timed: each step's clock (time/step: generate, reward, train and
    sync, from the step's start to its metrics), summed; Ray start, engine and learner start-up, the sync
    rehearsal and the final checkpoint come before or after."""
    try:
        from rlpipe.controller import train

        cfg = _e2e_config(spec, overrides)
        started = time.perf_counter()
        train(cfg)
        total = time.perf_counter() - started
        history = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if line]
        steps = [{"step": h["step"], "seconds": h["time/step"], "reward": h.get("reward/mean"),
                  "samples": h.get("samples_trained", 0.0), "samples_run": h.get("learner/samples_run"),
                  "completion_tokens": h.get("completion_tokens", 0.0),
                  "phases": {k: v for k, v in h.items() if k.startswith("time/")},
                  "staleness_max": h.get("staleness/max")} for h in history]
        results.put({"steps": steps, "setup_s": total - sum(s["seconds"] for s in steps)})
    except BaseException as err:
        import traceback

        results.put({"error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}",
                     "traceback": traceback.format_exc()[-4000:]})


def _e2e_summary(name: str, result: dict, threshold: float) -> dict:
    steps = result.get("steps") or []
    seconds = sum(s["seconds"] for s in steps)
    samples = sum(s["samples"] for s in steps)
    elapsed, reached = 0.0, None
    for s in steps:
        elapsed += s["seconds"]
        if reached is None and s["reward"] is not None and s["reward"] >= threshold:
            reached = {"step": s["step"], "seconds": elapsed}
    later_seconds = sum(s["seconds"] for s in steps[1:])
    return {
        "system": name,
        "error": result.get("error"),
        "timed_s": seconds,
        "samples": samples,
        "samples_per_s": samples / seconds if seconds else None,
        # Without step 1's warm-ups (first generation and backward); in async mode step 2's generation partly
        # overlapped step 1, which this leaves out, so it flatters async a little.
        "samples_per_s_after_first": sum(s["samples"] for s in steps[1:]) / later_seconds if later_seconds else None,
        "completion_tokens_per_s": sum(s["completion_tokens"] for s in steps) / seconds if seconds else None,
        "threshold_reached": reached,
        "setup_s": result.get("setup_s"),
        "process_wall_s": result.get("process_wall_s"),
        "rewards": [s["reward"] for s in steps],
        "steps": steps,
    }


def _plot_e2e(rows: list[dict], threshold: float, title: str, out_png: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        if not row["steps"]:
            continue
        rewards = [s["reward"] for s in row["steps"]]
        by_step.plot([s["step"] for s in row["steps"]], rewards, marker="o", label=row["system"])
        clock = [sum(s["seconds"] for s in row["steps"][: i + 1]) for i in range(len(row["steps"]))]
        by_time.plot(clock, rewards, marker="o", label=row["system"])
    by_step.xaxis.get_major_locator().set_params(integer=True)
    for ax, label in ((by_step, "step"), (by_time, "timed seconds (end of step)")):
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("mean reward of the step's samples")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def bench_e2e(model: str, steps: int, threshold: float, trl_generation: list[str], systems: list[str] | None = None,
              out: str | None = None, png: str | None = None, repeats: int = 1) -> list[dict]:
    """The same GRPO workload three ways, each in its own fresh process, one after the other: rlpipe synchronous
    (train.max_staleness 0), rlpipe one-step asynchronous (1), and TRL's GRPOTrainer (per TRL generation mode).
    Samples/s = completions trained / timed seconds (each runner says what it times); ratios against the fastest
    TRL row. With `repeats` > 1 the systems run round after round (every other round in reverse order) and each
    system's fastest round is reported; every round is in the JSON."""
    if model not in E2E_MODELS:
        raise ValueError(f"--model {model!r} (known: {', '.join(E2E_MODELS)})")
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-e2e-") as folder:
        if model == "tiny":
            from rlpipe.tiny_model import build_tiny_model

            model_path = build_tiny_model(f"{folder}/tiny-qwen3", "qwen3")
        else:
            from rlpipe.models.builtin import resolve_model_path

            model_path = resolve_model_path(E2E_MODELS[model])
        spec = E2ESpec(model_path, steps, output_dir=f"{folder}/runs")
        settings = e2e_settings(spec, tuple(trl_generation))
        names = [n for n in settings if systems is None or n in systems or (n.startswith("trl") and "trl" in systems)]
        print(f"bench e2e: {model} ({model_path}), {steps} steps, {repeats} round(s); systems {', '.join(names)}",
              flush=True)
        rounds: dict[str, list[dict]] = {name: [] for name in names}
        for round_index in range(repeats):
            for name in names if round_index % 2 == 0 else names[::-1]:
                load = os.getloadavg()[0]
                print(f"--- {name} (round {round_index + 1}; load average {load:.2f})", flush=True)
                started = time.perf_counter()
                try:
                    if name.startswith("rlpipe"):
                        result = _in_fresh_process(_e2e_rlpipe_run, spec, settings[name]["overrides"])
                    else:
                        result = _in_fresh_process(_e2e_trl_run, model_path, settings[name])
                except RuntimeError as err:  # the process died without a word (a native crash)
                    result = {"error": str(err)}
                result["process_wall_s"] = time.perf_counter() - started
                if result.get("error"):
                    print(f"{name} failed: {result['error']}\n{result.get('traceback', '')}", flush=True)
                summary = _e2e_summary(name, result, threshold)
                summary.update(round=round_index + 1, load_before=load, load_after=os.getloadavg()[0])
                rounds[name].append(summary)
                time.sleep(2)  # let the run's processes (Ray's among them) finish exiting before the next starts
        workload = e2e_workload("rlpipe-sync", settings["rlpipe-sync"], spec)
    rows = [max(runs, key=lambda r: r["samples_per_s"] or 0.0) for runs in rounds.values()]
    trl_rates = [r["samples_per_s"] for r in rows if r["system"].startswith("trl") and r["samples_per_s"]]
    base = max(trl_rates) if trl_rates else None
    for row in rows:
        row["ratio_to_trl"] = row["samples_per_s"] / base if base and row["samples_per_s"] else None
    _print_e2e(rows, threshold)
    title = f"GRPO on {model}: {workload['prompts_per_step']} prompts x {workload['group_size']} samples, {steps} steps"
    png = png or (f"{os.path.splitext(out)[0]}.png" if out else f"bench-e2e-{model}.png")
    _plot_e2e(rows, threshold, title, png)
    print(f"reward per step: {png}")
    if out:
        workload.pop("rows")
        with open(out, "w") as f:
            json.dump({"model": model, "model_path": model_path if model != "tiny" else E2E_MODELS["tiny"],
                       "steps": steps, "threshold": threshold, "repeats": repeats, "workload": workload,
                       "settings": {n: {k: v for k, v in s.items() if k != "rows"} for n, s in settings.items()},
                       "differences": E2E_DIFFERENCES, "rows": rows, "rounds": rounds, "plot": png}, f, indent=2)
    return rows


def _print_e2e(rows: list[dict], threshold: float) -> None:
    print(f"\n{'system':<22}{'samples/s':>10}{'steps 2+':>10}{'tokens/s':>10}{'timed s':>9}"
          f"{'to reward>=' + format(threshold, 'g'):>18}{'vs TRL':>8}{'process s':>11}")
    for row in rows:
        if row["error"]:
            print(f"{row['system']:<22}failed: {row['error']}")
            continue
        reached = row["threshold_reached"]
        when = f"{reached['seconds']:.1f}s (step {reached['step']})" if reached else "not reached"
        ratio = f"{row['ratio_to_trl']:.2f}x" if row["ratio_to_trl"] else "-"
        later = f"{row['samples_per_s_after_first']:.2f}" if row["samples_per_s_after_first"] else "-"
        print(f"{row['system']:<22}{row['samples_per_s']:>10.2f}{later:>10}{row['completion_tokens_per_s']:>10.1f}"
              f"{row['timed_s']:>9.1f}{when:>18}{ratio:>8}{row['process_wall_s']:>11.1f}")
    print("mean reward per step: " + "; ".join(f"{r['system']} " + " ".join(
        "-" if v is None else f"{v:.2f}" for v in r["rewards"]) for r in rows))
    run = [r for r in rows if any(s.get("samples_run") is not None for s in r["steps"])]
    if run:  # rlpipe's learner leaves out samples with advantage 0 (learner.skip_zero_advantage)
        print("samples the learner ran per step: " + "; ".join(f"{r['system']} " + " ".join(
            "-" if s.get("samples_run") is None else f"{s['samples_run']:.0f}" for s in r["steps"]) for r in run))
