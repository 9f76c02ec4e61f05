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
