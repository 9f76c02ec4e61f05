"""`rlpipe bench sync`: weight-sync bytes/s of each transport, learner ranks (Ray actors) to a receiving actor,
against this host's copy bandwidth measured alongside."""

from __future__ import annotations

import json
import os
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
