"""Peak host memory of a tensor-parallel CPU engine while it takes weight syncs, for two checkouts of rlpipe side by
side (by default the library as it was before its workers read one shared host copy, and as it is now).

    python bench/engine_memory.py --before /path/to/baseline/checkout [--after /path/to/this/checkout]

Builds a random Llama of a few hundred MB (float32) once, then for each checkout starts, in a process of its own
that imports that checkout (PYTHONPATH), one vLLM CPU engine with tensor_parallel=2 (`rollout.in_process: false`:
the engine's process, vLLM's engine-core process and its two worker processes) and syncs the model into it through
each of `--transports` from a learner stand-in outside the engine's processes (a process of its own for `shm`, a
Ray actor for `ray`; the weights as the folder holds them, so every probe matches): a start-up rehearsal, then
`--syncs` versions, numbered as the run's channel numbers them. While each sync runs, psutil samples the engine's
process tree every few milliseconds:

- RSS: the sum of the processes' resident sets (pages shared between them count once per process);
- PSS: the sum of their proportional sets (a shared page divided among the processes mapping it, those outside the
  engine included — the learner's segments are half the engine's here), plus the /dev/shm files the engine itself
  made (a host copy whose pages no process maps at that instant is in no process's set).

Reported per sync: the peak of each and its rise over the engine at rest just before the sync; ratios after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

# A Llama of 158 M parameters (634 MB in float32): 8 layers of hidden size 1024.
MODEL = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
         "intermediate_size": 2816, "vocab_size": 32000, "tie_word_embeddings": False,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
PROBE = list(range(5, 45))


def build_model(folder: str) -> str:
    """The random model as a Hugging Face folder (safetensors, config, the tests' tiny tokenizer)."""
    import torch
    import transformers

    from rlpipe.bench.tiny_model import build_tokenizer

    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    tokenizer = build_tokenizer(folder)
    config = transformers.LlamaConfig(**MODEL, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=None, torch_dtype="float32")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


class TreeSampler:
    """Samples the memory of a process and all its descendants in a thread, keeping the peaks."""

    def __init__(self, root: int, shm_prefix: str | None, interval_s: float = 0.005):
        import psutil

        self.root, self.shm_prefix, self.interval_s = psutil.Process(root), shm_prefix, interval_s
        self.peak_rss = self.peak_pss = self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> tuple[int, int]:
        import psutil

        rss = pss = 0
        for process in [self.root, *self.root.children(recursive=True)]:
            try:
                info = process.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss, pss = rss + info.rss, pss + info.pss
        return rss, pss + self._shm_files()

    def _shm_files(self) -> int:
        if not self.shm_prefix:
            return 0
        total = 0
        for name in os.listdir("/dev/shm"):
            if name.startswith(self.shm_prefix):
                try:
                    total += os.stat(os.path.join("/dev/shm", name)).st_blocks * 512
                except FileNotFoundError:
                    pass
        return total

    def __enter__(self) -> TreeSampler:
        self.peak_rss, self.peak_pss = self.sample()
        self.samples = 1
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, pss = self.sample()
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.samples += 1
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        rss, pss = self.sample()
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)


class LearnerStandIn:
    """Streams the folder's weights (rank 0 of 1) through a transport, one version per `send`."""

    def __init__(self, model: str, transport: str):
        import torch

        from rlpipe.models.hf import load_model_weights
        from rlpipe.weightsync import make_transport

        self.weights = load_model_weights(model, torch.float32)
        self.transport = make_transport(transport)

    def shapes(self) -> dict:
        return {name: tuple(t.shape) for name, t in self.weights.items()}

    def send(self, plan, version: int, key: bytes) -> list:
        from rlpipe.weightsync import stream_parts

        return [(p.bucket, p.rank, p.handle, p.nbytes, p.checksum)
                for p in stream_parts(plan, 0, self.weights, self.transport, version, key)]

    def release(self) -> None:
        self.transport.release()

    def close(self) -> None:
        self.transport.close()


def _learner_process(model: str, transport: str, connection) -> None:
    """The stand-in in a process of its own, driven through a pipe (the shm transport)."""
    learner = LearnerStandIn(model, transport)
    connection.send(learner.shapes())
    while (request := connection.recv()) is not None:
        connection.send(learner.send(*request) if request != "release" else learner.release())
    learner.close()


class _PipeLearner:
    def __init__(self, model: str, transport: str):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=_learner_process, args=(model, transport, theirs), daemon=True)
        self.process.start()
        self._shapes = self.connection.recv()

    def shapes(self) -> dict:
        return self._shapes

    def send(self, plan, version: int, key: bytes) -> list:
        self.connection.send((plan, version, key))
        return self.connection.recv()

    def release(self) -> None:
        self.connection.send("release")
        self.connection.recv()

    def close(self) -> None:
        self.connection.send(None)
        self.process.join(60)


class _RayLearner:
    """The stand-in as a Ray actor (the ray transport: object references cross to the engine)."""

    def __init__(self, model: str, transport: str):
        import ray

        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=3 * 2**30, log_to_driver=False)
        self.actor = ray.remote(LearnerStandIn).remote(model, transport)
        self._shapes = ray.get(self.actor.shapes.remote())

    def shapes(self) -> dict:
        return self._shapes

    def send(self, plan, version: int, key: bytes) -> list:
        import ray

        return ray.get(self.actor.send.remote(plan, version, key))

    def release(self) -> None:
        import ray

        ray.get(self.actor.release.remote())

    def close(self) -> None:
        import ray

        ray.get(self.actor.close.remote())
        ray.shutdown()


def measure(model: str, transport: str, syncs: int, bucket_mb: float) -> dict:
    """In a process importing the checkout under test: one TP=2 engine, a rehearsal and `syncs` versions."""
    from rlpipe.config import RolloutConfig, load_config
    from rlpipe.rollout.engine import RolloutEngine
    from rlpipe.weightsync import plan_sync
    from rlpipe.weightsync.codec import new_sync_key

    cfg = load_config(None, [f"model.path={model}", f"sync.transport={transport}", f"sync.bucket_mb={bucket_mb}",
                             "sync.probe_tolerance=1e-4"])
    learner = (_RayLearner if transport == "ray" else _PipeLearner)(model, transport)
    rollout = RolloutConfig(max_model_len=256, max_tokens=8, tensor_parallel=2, in_process=False, kv_cache_gib=1)
    engine = RolloutEngine(model, rollout, 0, sync=cfg.sync, progress_bars=False)
    layout, _ = engine.layout()
    plan = plan_sync(learner.shapes(), 1, layout, int(bucket_mb * 2**20))
    key = new_sync_key()
    expected = engine.sequence_logprobs(PROBE)
    host_copy = getattr(engine, "host_copy", None)
    sampler = TreeSampler(os.getpid(), host_copy.segment_prefix() if host_copy else None)
    rows = []
    for index in range(syncs + 1):
        # As the channel numbers them: the rehearsal carries version 1 and leaves the engine at 0, so 1 comes again.
        version, rehearsal = max(1, index), index == 0
        time.sleep(1.0)  # the engine at rest
        rest_rss, rest_pss = sampler.sample()
        started = time.perf_counter()
        with sampler:
            engine.sync.begin(plan, version, key)
            for bucket, rank, handle, nbytes, digest in learner.send(plan, version, key):
                engine.sync.receive(version, bucket, rank, handle, nbytes, digest)
            result = engine.sync.commit(version, PROBE, expected, rehearsal=rehearsal)
        learner.release()
        rows.append({"sync": "rehearsal" if rehearsal else f"v{version}", "rest_rss": rest_rss, "rest_pss": rest_pss,
                     "peak_rss": sampler.peak_rss, "peak_pss": sampler.peak_pss, "probe": result.probe_max_abs,
                     "write_s": result.write_s, "sync_s": time.perf_counter() - started,
                     "samples": sampler.samples})
    engine.close()
    learner.close()
    return {"model_bytes": plan.nbytes, "transport": transport, "rows": rows}


def _child(args) -> None:
    result = measure(args.model, args.transports, args.syncs, args.bucket_mb)
    print("RESULT " + json.dumps(result), flush=True)


def _run_checkout(checkout: str, model: str, transport: str, syncs: int, bucket_mb: float) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
        "VLLM_CPU_OMP_THREADS_BIND", "0|1")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    command = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--transports", transport,
               "--syncs", str(syncs), "--bucket-mb", str(bucket_mb)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"the measurement of {checkout} failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def format_table(before: dict, after: dict) -> str:
    gb = 1e9
    lines = [f"model: {before['model_bytes'] / gb:.3f} GB in float32 (one copy); engine: TP=2 CPU, in a process of "
             "its own (engine process + engine core + 2 workers)",
             "| sync | peak RSS before | peak RSS after | ratio | peak PSS before | peak PSS after | ratio "
             "| PSS rise before | PSS rise after | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for old, new in zip(before["rows"], after["rows"]):
        rise_old, rise_new = old["peak_pss"] - old["rest_pss"], new["peak_pss"] - new["rest_pss"]
        lines.append(
            f"| {old['sync']} | {old['peak_rss'] / gb:.2f} GB | {new['peak_rss'] / gb:.2f} GB | "
            f"{new['peak_rss'] / old['peak_rss']:.2f} | {old['peak_pss'] / gb:.2f} GB | {new['peak_pss'] / gb:.2f} GB | "
            f"{new['peak_pss'] / old['peak_pss']:.2f} | {rise_old / gb:.2f} GB | {rise_new / gb:.2f} GB | "
            f"{rise_new / max(rise_old, 1):.2f} |")
    lines.append("| write s (before / after): " + ", ".join(
        f"{old['sync']} {old['write_s']:.2f} / {new['write_s']:.2f}" for old, new in zip(before["rows"], after["rows"]))
        + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="checkout measured first (the baseline)")
    parser.add_argument("--after", default=os.path.dirname(os.path.dirname(os.path.realpath(__file__))),
                        help="checkout measured second (default: this one)")
    parser.add_argument("--model", help="model folder (default: built once in a temporary folder)")
    parser.add_argument("--transports", default="shm,ray", help="sync.transport of each pair of measurements")
    parser.add_argument("--syncs", type=int, default=2, help="versions after the rehearsal")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--out", help="write both results as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return
    if not args.before:
        parser.error("--before: the checkout to compare against")
    model = args.model or build_model(os.path.join(tempfile.gettempdir(), "rlpipe-engine-memory-model"))
    results = {}
    for transport in args.transports.split(","):
        for label, checkout in (("before", args.before), ("after", args.after)):
            print(f"measuring {label}, sync.transport={transport}: {checkout}", flush=True)
            result = _run_checkout(os.path.abspath(checkout), model, transport, args.syncs, args.bucket_mb)
            results.setdefault(transport, {})[label] = result
            for row in result["rows"]:
                print(f"  {row['sync']}: peak RSS {row['peak_rss'] / 1e9:.2f} GB, peak PSS {row['peak_pss'] / 1e9:.2f} "
                      f"GB (at rest {row['rest_pss'] / 1e9:.2f}), probe {row['probe']:.1e}, write {row['write_s']:.2f} s, "
                      f"{row['samples']} samples", flush=True)
    for transport, pair in results.items():
        print(f"\nsync.transport={transport}")
        print(format_table(pair["before"], pair["after"]))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
