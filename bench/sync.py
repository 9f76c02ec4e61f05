"""`rlpipe bench sync`: weight-sync bytes/s of each transport, learner ranks (Ray actors) to a receiving actor,
against this host's copy bandwidth measured alongside.

A run syncs once per step with the same actors, so the bench does too: every row is a series of versions through
one set of actors, and the first sync (which sets the transport up) is reported apart from the ones after it (the
steady state a training run sees from its second sync on, the first being the start-up rehearsal).

With `--in-run-rounds N` it also runs the default recipe for a few steps per transport, N rounds with the transports
alternating, and reports the sync as a training step sees it: transfer, the engine's write, the whole sync phase."""

from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable

import torch


# Llama-shaped configs for `rlpipe bench sync`: SmolLM2-135M's shapes, and a ~500M-parameter one.
SYNC_MODELS = {
    "smollm2-135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True},
    "random-500m": {"hidden_size": 1280, "num_hidden_layers": 24, "num_attention_heads": 20, "num_key_value_heads": 4,
                    "intermediate_size": 3456, "vocab_size": 32000, "tie_word_embeddings": False},
}


# The transports measured one against another (`auto` is a choice between two of them per pair, not a third).
SYNC_TRANSPORTS = ("ray", "shm", "gloo")
# The default recipe's model, whose run gives the in-run figures (`--in-run-rounds`).
IN_RUN_MODEL = "builtin:smollm2-135m-instruct"


def sync_model_config(name: str) -> dict:
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu"}
    return {**base, **SYNC_MODELS[name]}


def sync_model_shapes(name: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """The HF config of SYNC_MODELS[name] and its weights' shapes (built on the meta device: no memory)."""
    from rlpipe.models import build_model

    hf_config = sync_model_config(name)
    with torch.device("meta"):
        return hf_config, {name: tuple(t.shape) for name, t in build_model(hf_config).state_dict().items()}


def copy_bandwidth(nbytes: int) -> Callable[[int], tuple[float, float | None]]:
    """A measurement of this host's copy bandwidth between two preallocated buffers of `nbytes`: called with a
    repeat count, it returns the best GB/s of torch's copy_ on all threads (the memcpy figure) and of the packing
    loop's one-thread streaming copy, hashing every word as it copies (None without it), which here often beats
    copy_ and so is the stricter yardstick. Measured again next to every timed sync, so both see the machine in the
    same state."""
    from rlpipe.weightsync import native

    source, target = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8)
    streaming = native.copy_hash()
    copies = {"memcpy": lambda: target.copy_(source)}
    if streaming is not None:
        copies["streaming"] = lambda: streaming(source.numpy(), target.numpy(), 0, 0, 0, 1, 0)
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
               out: str | None = None, in_run_rounds: int = 0, in_run_steps: int = 6) -> list[dict]:
    """Learner ranks (Ray actors holding random weights sharded as SimpleFSDP stores them) stream `repeats`
    versions in turn to a receiving actor through each transport, with the code the real actors run: pack,
    transport, checksum, assemble. The engine's own write is not part of it; `in_run_rounds` > 0 adds runs of the
    default recipe that show it (`bench_sync_in_run`)."""
    import ray

    from rlpipe.actors.cluster import start_ray
    from rlpipe.config import load_config
    from rlpipe.parallel.mesh import find_free_port
    from rlpipe.weightsync import EngineLayout, plan_sync
    from rlpipe.weightsync.codec import new_sync_key

    start_ray(load_config(None, [f"ray.num_cpus={max(ranks) + 2}"]))
    key = new_sync_key()  # as the run's channel draws it
    sender_cls, receiver_cls = _sync_bench_actors()
    rows = []
    for model in models:
        hf_config, shapes = sync_model_shapes(model)
        layout = EngineLayout.from_hf_config(hf_config, 1, "float32")
        for rank_count in ranks:
            plan = plan_sync(shapes, rank_count, layout, int(bucket_mb * 2**20))
            copy_rates = copy_bandwidth(min(plan.nbytes, 512 * 2**20))
            print(f"{model}: {plan.nbytes / 1e9:.2f} GB in {len(plan.buckets)} buckets, M={rank_count}; memcpy = torch "
                  f"copy_ on {torch.get_num_threads()} threads, streaming copy = one thread, both measured (best of "
                  "two) just before every sync, which is set against them", flush=True)
            for transport in transports:
                senders = [sender_cls.remote(plan, rank, transport) for rank in range(rank_count)]
                receiver = receiver_cls.remote(plan, transport)
                # As the run's channel sets a transport up (actors/sync_channel.py): ranks write into the buffers
                # rank 0 names where the transport shares them, and join its process group where it has one.
                prefix = ray.get(senders[0].buffer_prefix.remote())
                ray.get([s.share_buffers.remote(prefix) for s in senders])
                port, world = find_free_port(), rank_count + 1
                ray.get([s.connect.remote(port, world) for s in senders] + [receiver.connect.remote(port, world)])
                syncs = []
                for version in range(1, repeats + 1):
                    memcpy, streaming = copy_rates(2)
                    ray.get(receiver.begin.remote(version, key))
                    started = time.perf_counter()
                    sent = ray.get([s.send.remote(version, key, receiver) for s in senders])
                    receiving, receiver_faults = ray.get(receiver.finish.remote(version))
                    released = time.perf_counter()
                    # As in a run, after the version is committed: counted, since a transport may do work there.
                    ray.get([s.release.remote() for s in senders])
                    finished = time.perf_counter()
                    syncs.append({"s": finished - started, "release_s": finished - released, "memcpy_gbps": memcpy,
                                  "streaming_copy_gbps": streaming, "receiver_busy_s": receiving,
                                  "sender_faults": sum(faults for _, faults in sent), "receiver_faults": receiver_faults})
                ray.get([s.close.remote() for s in senders])
                for handle in [*senders, receiver]:
                    ray.kill(handle)
                row = sync_row(model, rank_count, transport, plan.nbytes, syncs)
                rows.append(row)
                print(format_row(row), flush=True)
    ray.shutdown()
    in_run = bench_sync_in_run(transports, in_run_rounds, in_run_steps) if in_run_rounds > 0 else None
    if out:
        with open(out, "w") as f:
            json.dump({"bucket_mb": bucket_mb, "rows": rows, "in_run": in_run}, f, indent=2)
    return rows


def bench_sync_in_run(transports: list[str], rounds: int, steps: int) -> dict:
    """The sync as a training step sees it: the default recipe (its model, `IN_RUN_MODEL`, if installed) for
    `steps` steps per transport, each run in a fresh process, the transports in turn for `rounds` rounds (every
    other round in reverse order). Per run, from its metrics: the start-up rehearsal, the first step's sync, and
    the medians over the later steps of `sync/transfer_s` (learner ranks to the engines), `sync/write_s` (the
    engine's write), `sync/probe_s` (its replay of the probe), `sync/reference_s` (the learner's probe log-probs,
    where computed before the transfer) and `time/sync` (the step's whole sync phase)."""
    from rlpipe.bench.common import in_fresh_process

    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-sync-") as folder:
        model_path, model, extra = _in_run_model(folder)
        print(f"in a run: the default recipe on {model}, {steps} steps a run, {rounds} round(s) of "
              f"{', '.join(transports)}", flush=True)
        runs: dict[str, list[dict]] = {transport: [] for transport in transports}
        for round_index in range(rounds):
            for transport in transports if round_index % 2 == 0 else transports[::-1]:
                overrides = [*extra, f"model.path={model_path}", f"train.steps={steps}", f"sync.transport={transport}",
                             "data.eval_size=0", "metrics.tensorboard=false", "metrics.plot=false",
                             "metrics.export=false", f"run.output_dir={folder}/runs", f"run.name={transport}",
                             "run.overwrite=true"]
                result = in_fresh_process(_in_run, overrides)
                if "error" in result:
                    raise RuntimeError(f"bench sync: the {transport} run failed: {result['error']}")
                summary = in_run_summary(result["steps"], result["rehearsal"])
                summary.update(transport=transport, round=round_index + 1)
                runs[transport].append(summary)
                print(format_in_run(summary), flush=True)
                time.sleep(2)  # the run's processes (Ray's among them) finish exiting before the next starts
    medians = {transport: {key: statistics.median(run["steady"][key] for run in done)
                           for key in ("transfer_s", "write_s", "transfer_write_s", "sync_s")}
               for transport, done in runs.items() if done}
    if "ray" in medians:
        for transport, figures in medians.items():
            print(f"  {transport:>4}, medians of {rounds} run(s): " + ", ".join(
                f"{key} {value:.3f} s ({medians['ray'][key] / value:.2f}x ray's speed)" for key, value in figures.items()
            ), flush=True)
    return {"model": model, "steps": steps, "rounds": rounds, "runs": runs, "medians": medians}


def in_run_summary(steps: list[dict], rehearsal: dict) -> dict:
    """A run's syncs from its metrics (one dict a step) and its start-up rehearsal (summary.json's sync_check):
    the first step's sync apart, the medians of the steps after it."""
    synced = [step for step in steps if "sync/transfer_s" in step]  # a step without samples does not sync

    def figures(step: dict) -> dict:
        transfer, write = step["sync/transfer_s"], step["sync/write_s"]
        probes = {key[len("sync/"):]: step[key] for key in ("sync/probe_s", "sync/reference_s") if key in step}
        return {"transfer_s": transfer, "write_s": write, "transfer_write_s": transfer + write, **probes,
                "sync_s": step["time/sync"]}

    each = [figures(step) for step in synced]
    later = each[1:] or each
    return {"rehearsal": {"transfer_s": rehearsal["sync/transfer_s"], "write_s": rehearsal["sync/write_s"]},
            "first_step": each[0] if each else None,
            "steady": {key: statistics.median(step[key] for step in later) for key in later[0]} if later else None,
            "steps": each}


def format_in_run(run: dict) -> str:
    def part(figures: dict | None) -> str:
        if not figures:
            return "-"
        probes = "".join(f", {name} {figures[key]:.3f} s" for key, name in
                         (("probe_s", "engine's probe"), ("reference_s", "learner's probe")) if key in figures)
        return (f"transfer {figures['transfer_s']:.3f} + write {figures['write_s']:.3f} s{probes}, "
                f"sync phase {figures['sync_s']:.3f} s")

    return (f"  {run['transport']:>4} (round {run['round']}): rehearsal transfer {run['rehearsal']['transfer_s']:.2f} + "
            f"write {run['rehearsal']['write_s']:.2f} s; first step {part(run['first_step'])}; later steps (medians "
            f"of {max(1, len(run['steps']) - 1)}) {part(run['steady'])}")


def _in_run_model(folder: str) -> tuple[str, str, list[str]]:
    """(path, what it is, overrides): the default recipe's model where it is installed; else random weights in
    SmolLM2-135M's shapes (the bench's model) with the tests' small tokenizer, every sample trained on (a random
    policy earns no reward, and a step whose groups all lack signal would train and sync nothing)."""
    from rlpipe.config import ConfigError
    from rlpipe.models.builtin import resolve_model_path

    try:
        return resolve_model_path(IN_RUN_MODEL), IN_RUN_MODEL, []
    except ConfigError as err:
        print(f"in a run: {err}; random weights in SmolLM2-135M's shapes instead", flush=True)
    import transformers

    from rlpipe.bench.tiny_model import build_tokenizer

    path = os.path.join(folder, "random-smollm2-135m")
    tokenizer = build_tokenizer(path)
    config = {key: value for key, value in sync_model_config("smollm2-135m").items() if key != "model_type"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **config, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None))
    model.save_pretrained(path)
    return path, "random weights, SmolLM2-135M's shapes", ["algo.drop_uniform_groups=false"]


def _in_run(overrides: list[str], results) -> None:
    """`rlpipe train` of the default recipe with `overrides`, in this (fresh) process; puts its per-step metrics
    and its start-up rehearsal on `results`."""
    try:
        from rlpipe.config import load_config, recipes_dir
        from rlpipe.run.controller import train

        cfg = load_config(str(recipes_dir() / "default.yaml"), overrides)
        train(cfg)
        steps = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if line]
        rehearsal = json.loads((cfg.run_dir / "summary.json").read_text())["sync_check"]
        results.put({"steps": steps, "rehearsal": rehearsal})
    except BaseException as err:
        results.put({"error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"})


def sync_row(model: str, ranks: int, transport: str, nbytes: int, syncs: list[dict]) -> dict:
    """One row of the bench: the first sync (the transport's set-up included) and the steady state (the median of
    the syncs after it). Each sync's share of memcpy is taken against the copy bandwidth measured just before it,
    so that a machine whose speed drifts (shared, noisy) compares like with like; the steady share is the median
    of those of the syncs after the first."""
    for sync in syncs:
        sync["gbps"] = nbytes / sync["s"] / 1e9
        sync["pct_memcpy"] = 100 * sync["gbps"] / sync["memcpy_gbps"]
        streaming = sync["streaming_copy_gbps"]
        sync["pct_streaming_copy"] = 100 * sync["gbps"] / streaming if streaming else None
    later = syncs[1:]

    def median(key: str) -> float | None:
        values = [sync[key] for sync in later if sync[key] is not None]
        return statistics.median(values) if values else None

    return {"model": model, "ranks": ranks, "transport": transport, "bytes": nbytes,
            "first_s": syncs[0]["s"], "first_pct_memcpy": syncs[0]["pct_memcpy"],
            "steady_s": median("s"), "steady_pct_memcpy": median("pct_memcpy"),
            "steady_pct_streaming_copy": median("pct_streaming_copy"),
            "memcpy_gbps": statistics.median(sync["memcpy_gbps"] for sync in syncs), "syncs": syncs}


def format_row(row: dict) -> str:
    def part(seconds: float | None, pct: float | None) -> str:
        if seconds is None:
            return "   -   "
        return f"{seconds:5.2f} s = {row['bytes'] / seconds / 1e9:5.2f} GB/s = {pct:5.1f} % of memcpy"

    steady = row["steady_pct_streaming_copy"]
    times = " ".join(f"{sync['s']:.3f}" for sync in row["syncs"])
    faults = " ".join(f"{sync['sender_faults']}+{sync['receiver_faults']}" for sync in row["syncs"])
    return (f"  {row['transport']:>4}: first {part(row['first_s'], row['first_pct_memcpy'])}; steady "
            f"{part(row['steady_s'], row['steady_pct_memcpy'])}{f' = {steady:5.1f} % of streaming copy' if steady else ''}"
            f" (medians of {len(row['syncs']) - 1}; memcpy {row['memcpy_gbps']:.1f} GB/s)\n"
            f"        each sync: {times} s; page faults, senders+receiver: {faults}")


def commit_as_a_run_does(receiver, version: int) -> None:
    """Commit `version` on the bench's receiver as a run's engine does: the first as the start-up rehearsal, which
    lays out and faults in the memory the next version is staged into (`WeightReceiver._prepare_spare`), so that the
    steady state is that of a run's training steps, not one more sync paying a page fault per 4 KiB."""
    receiver.commit(version, [0, 1], [0.0, 0.0], rehearsal=version == 1)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _sync_bench_actors():
    import ray

    from rlpipe.actors.cluster import compute_env
    from rlpipe.actors.learner import send_parts
    from rlpipe.weightsync import WeightReceiver, make_transport, shard_rows

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

        def send(self, version, key, receiver):
            started, faults = time.perf_counter(), _minor_faults()
            send_parts(self.plan, self.rank, self.local, self.transport, [receiver], version, key)
            return time.perf_counter() - started, _minor_faults() - faults

        def release(self):
            self.transport.release()

        def close(self):
            self.transport.close()

    @ray.remote(num_cpus=1, runtime_env={"env_vars": compute_env()}, concurrency_groups={"sync": 1})
    class Receiver:
        """An engine's end of the channel (rlpipe's WeightReceiver) in front of an engine that writes nothing and
        answers the probe as the learner does: what is timed is the transport, the checks and the assembly."""

        def __init__(self, plan, transport):
            self.plan = plan
            self.receiver = WeightReceiver(make_transport(transport), write=lambda weights: None,
                                           probe=lambda tokens: [0.0] * len(tokens), initial_weights=dict,
                                           tolerance=0.0, exact=True)
            self.busy = 0.0  # seconds spent receiving (transport, checksum, assembly)
            self.faults = 0

        def connect(self, port, world):
            self.receiver.transport.connect("127.0.0.1", port, world - 1, self.plan.learner_ranks, world, 300)

        def begin(self, version, key):
            self.receiver.begin(self.plan, version, key)
            self.faults = _minor_faults()

        @ray.method(concurrency_group="sync")
        def receive_part(self, version, bucket, rank, handle, nbytes, digest):
            started = time.perf_counter()
            self.receiver.receive(version, bucket, rank, handle, nbytes, digest)
            self.busy += time.perf_counter() - started
            return nbytes

        def finish(self, version):
            started = time.perf_counter()
            commit_as_a_run_does(self.receiver, version)
            busy, self.busy = self.busy + time.perf_counter() - started, 0.0
            return busy, _minor_faults() - self.faults

    return Sender, Receiver
