"""Benchmarks, reported as ratios against a baseline measured in the same run (these machines are noisy).

`rlpipe bench learner`: GRPO train-step throughput of the learner — eager vs the captured graph, one rank vs two
SimpleFSDP ranks — on a random Llama-shaped model, with MFU against this machine's fp32 matmul peak measured
in the same run.
"""

from __future__ import annotations

import json
import os
import queue as queue_module
import tempfile
import time
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

    def hf_config(self) -> dict:
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
        per_layer = (
            self.hidden * head_dim * (self.heads * 2 + self.kv_heads * 2)  # q, o, k, v projections
            + 3 * self.hidden * self.intermediate  # gate, up, down
        )
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


def _bench_config(model_path: str, shape: LearnerBenchShape, ranks: int, graph: bool):
    from rlpipe.config import load_config

    return load_config(
        None,
        [
            f"model.path={model_path}",
            f"train.prompts_per_step={shape.batch // 2}",
            "rollout.group_size=2",
            f"train.micro_batch_size={shape.batch // ranks}",
            f"train.steps={shape.steps + 2}",
            f"learner.ranks={ranks}",
            f"learner.graph={str(graph).lower()}",
            f"learner.length_buckets=[{shape.seq}]",
            f"data.max_prompt_tokens={shape.seq // 2}",
            f"rollout.max_tokens={shape.seq // 2}",
            f"rollout.max_model_len={shape.seq}",
        ],
    )


def _batch(shape: LearnerBenchShape):
    from rlpipe.types import TrainBatch

    generator = torch.Generator().manual_seed(0)
    half = shape.seq // 2
    prompts = [torch.randint(0, shape.vocab, (half,), generator=generator).tolist() for _ in range(shape.batch)]
    completions = [torch.randint(0, shape.vocab, (half,), generator=generator).tolist() for _ in range(shape.batch)]
    logprobs = [[-2.0] * half for _ in range(shape.batch)]
    return TrainBatch.from_sequences(prompts, completions, logprobs, torch.randn(shape.batch, generator=generator).tolist())


def _time_rank(model_path: str, shape: LearnerBenchShape, ranks: int, graph: bool, rank: int = 0, port: int = 0):
    """Seconds per train step on one rank, after warm-up (which includes compilation in graph mode)."""
    from rlpipe.learner import Learner

    learner = Learner(model_path, _bench_config(model_path, shape, ranks, graph), rank, ranks)
    learner.join_group("127.0.0.1", port)
    batch = _batch(shape)
    started = time.perf_counter()
    learner.train_step(batch)
    warmup = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(shape.steps):
        learner.train_step(batch)
    return (time.perf_counter() - started) / shape.steps, warmup


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
    return max(r[0] for r in results.values()), max(r[1] for r in results.values())


def bench_learner(shape: LearnerBenchShape, modes: list[str], out: str | None = None) -> list[dict]:
    from rlpipe.models import build_model, save_state_dict

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    peak = matmul_peak_gflops()
    tokens = shape.batch * shape.seq
    flops = shape.flops_per_token() * tokens
    print(f"model: {shape}\nfp32 matmul peak here: {peak:.1f} GFLOP/s ({threads} threads); {tokens} tokens a step")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        save_state_dict(build_model(shape.hf_config()).state_dict(), shape.hf_config(), f"{folder}/model", overwrite=True)
        model_path = f"{folder}/model"
        for mode in modes:
            graph = mode.startswith("graph")
            if mode.endswith("m2"):
                seconds, warmup = _time_two_ranks(model_path, shape, graph, max(1, threads // 2))
            else:
                seconds, warmup = _time_rank(model_path, shape, 1, graph)
            row = {
                "mode": mode,
                "seconds_per_step": seconds,
                "first_step_seconds": warmup,
                "tokens_per_s": tokens / seconds,
                "mfu": flops / seconds / (peak * 1e9),
            }
            rows.append(row)
            print(
                f"{mode:>10}: {row['tokens_per_s']:8.0f} tokens/s  MFU {100 * row['mfu']:5.1f}%  "
                f"first step {warmup:6.1f}s  ({seconds:.2f}s/step)",
                flush=True,
            )
    base = rows[0]["tokens_per_s"]
    print(f"ratios against {rows[0]['mode']}: " + ", ".join(f"{r['mode']} {r['tokens_per_s'] / base:.2f}x" for r in rows))
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


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """This host's copy bandwidth (torch copy_ between two preallocated buffers, best of `repeats`)."""
    source, target = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


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
            baseline = memcpy_gbps(min(plan.nbytes, 512 * 2**20))
            print(f"{model}: {plan.nbytes / 1e9:.2f} GB in {len(plan.buckets)} buckets, M={rank_count}; "
                  f"memcpy here {baseline:.1f} GB/s", flush=True)
            for transport in transports:
                senders = [sender_cls.remote(plan, rank, transport) for rank in range(rank_count)]
                receiver = receiver_cls.remote(plan, transport)
                if transport == "gloo":
                    from rlpipe.parallel.mesh import find_free_port

                    port, world = find_free_port(), rank_count + 1
                    ray.get([s.connect.remote(port, world) for s in senders] + [receiver.connect.remote(port, world)])
                times = []
                for version in range(1, repeats + 1):
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
                row = {"model": model, "ranks": rank_count, "transport": transport, "bytes": plan.nbytes,
                       "seconds": seconds, "receiver_busy_s": receiving, "gbps": plan.nbytes / seconds / 1e9,
                       "memcpy_gbps": baseline}
                rows.append(row)
                print(f"  {transport:>4}: {row['gbps']:5.2f} GB/s = {row['gbps'] / baseline:5.1%} of memcpy  "
                      f"({seconds:.2f} s, receiver busy {receiving:.2f} s; best of {repeats})", flush=True)
    ray.shutdown()
    if out:
        with open(out, "w") as f:
            json.dump({"bucket_mb": bucket_mb, "rows": rows}, f, indent=2)
    return rows


def _sync_bench_actors():
    import ray

    from actors.groups import THREADS_ENV
    from actors.learner import send_parts
    from rlpipe.weightsync import Staging, make_transport, shard_rows

    # The same thread allowance as the real roles.
    @ray.remote(num_cpus=1, runtime_env=THREADS_ENV)
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

        def send(self, version, receiver):
            started = time.perf_counter()
            send_parts(self.plan, self.rank, self.local, self.transport, [receiver], version)
            return time.perf_counter() - started

        def release(self):
            self.transport.release()

        def close(self):
            self.transport.close()

    @ray.remote(num_cpus=1, runtime_env=THREADS_ENV, concurrency_groups={"sync": 1})
    class Receiver:
        def __init__(self, plan, transport):
            self.plan, self.transport, self.staging = plan, make_transport(transport), None
            self.busy = 0.0  # seconds spent receiving (transport, checksum, assembly)

        def connect(self, port, world):
            self.transport.connect("127.0.0.1", port, world - 1, self.plan.learner_ranks, world, 300)

        def begin(self, version):
            # As the engine does: adopt what the transport hands over in place where it can, reuse owned memory.
            reuse = self.staging.owned if self.staging else None
            self.staging = Staging(self.plan, version, reuse, adopt_buffers=self.transport.stable_receive_buffers)

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
    result = results.get()
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
