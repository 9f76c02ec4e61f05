"""`rlpipe bench sync`: weight-sync bytes/s of each transport, learner ranks (Ray actors) to a receiving actor,
against this host's copy bandwidth measured alongside.

A run syncs once per step with the same actors, so the bench does too: every row is a series of versions through
one set of actors, and the first sync (which sets the transport up) is reported apart from the ones after it (the
steady state a training run sees from its second sync on, the first being the start-up rehearsal)."""

from __future__ import annotations

import json
import os
import resource
import statistics
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
    """Learner ranks (Ray actors holding random weights sharded as SimpleFSDP stores them) stream `repeats`
    versions in turn to a receiving actor through each transport, with the code the real actors run: pack,
    transport, checksum, assemble. The engine's own write is not part of it (`sync/write_s` in a run's metrics
    shows that)."""
    import ray

    from rlpipe.actors.groups import start_ray
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
                  f"copy_ on {torch.get_num_threads()} threads, streaming copy = one thread, both measured (best of "
                  "two) just before every sync, which is set against them", flush=True)
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
                syncs = []
                for version in range(1, repeats + 1):
                    memcpy, streaming = copy_rates(2)
                    ray.get(receiver.begin.remote(version))
                    started = time.perf_counter()
                    sent = ray.get([s.send.remote(version, receiver) for s in senders])
                    receiving, receiver_faults = ray.get(receiver.finish.remote())
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
    if out:
        with open(out, "w") as f:
            json.dump({"bucket_mb": bucket_mb, "rows": rows}, f, indent=2)
    return rows


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


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _sync_bench_actors():
    import ray

    from rlpipe.actors.groups import compute_env
    from rlpipe.actors.learner import send_parts
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
            started, faults = time.perf_counter(), _minor_faults()
            send_parts(self.plan, self.rank, self.local, self.transport, [receiver], version)
            return time.perf_counter() - started, _minor_faults() - faults

        def release(self):
            self.transport.release()

        def close(self):
            self.transport.close()

    @ray.remote(num_cpus=1, runtime_env={"env_vars": compute_env()}, concurrency_groups={"sync": 1})
    class Receiver:
        def __init__(self, plan, transport):
            self.plan, self.transport, self.staging = plan, make_transport(transport), None
            self.busy = 0.0  # seconds spent receiving (transport, checksum, assembly)
            self.faults = 0

        def connect(self, port, world):
            self.transport.connect("127.0.0.1", port, world - 1, self.plan.learner_ranks, world, 300)

        def begin(self, version):
            # As the engine does: adopt what the transport hands over in place where it can, reuse owned memory.
            reuse = self.staging.owned if self.staging else None
            self.staging = Staging(self.plan, version, reuse, adopt_buffers=self.transport.stable_receive_buffers,
                                   whole_buckets=self.transport.whole_buckets)
            self.faults = _minor_faults()

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
            return busy, _minor_faults() - self.faults

    return Sender, Receiver
