"""Weight-sync time across hosts against on one host, for the same model: `rlpipe bench sync`'s sender and receiver
actors (pack, transport, checksum, assemble), the learner rank(s) on host A and the receiving engine either on host
A too or on host B. The hosts are network namespaces on this machine, each with its own /dev/shm and Ray node
(tests/integration/hosts.py), so "across hosts" crosses a network stack and two object stores as it would between
VMs, without a real network's bandwidth.

    python scripts/bench_sync_hosts.py                      # SmolLM2-135M shapes, 1 learner rank, 5 repeats
    python scripts/bench_sync_hosts.py --models smollm2-135m,random-500m --ranks 2 --repeats 7 --out sync-hosts.json

Each repeat times one sync of every configuration in turn (so they see the machine in the same state); the table
shows the median and the spread. The object store is what `sync.transport: auto` uses across hosts; shared memory,
what it uses on one host, is shown alongside (it cannot cross hosts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_worker_niceness", "0")  # as in the tests: Ray's default 15 starves actors on a busy machine

CONFIGS = (("ray", "host_a", "ray, one host"), ("ray", "host_b", "ray, across hosts"), ("shm", "host_a", "shm, one host"))


def measure(address: str, models: list[str], ranks: int, bucket_mb: float, repeats: int) -> list[dict]:
    """Inside host A: join the cluster, time `repeats` syncs of each configuration, interleaved."""
    import ray

    from rlpipe.bench.sync import _sync_bench_actors, sync_model_shapes
    from rlpipe.weightsync import EngineLayout, plan_sync

    ray.init(address=address, logging_level="ERROR")
    sender_cls, receiver_cls = _sync_bench_actors()
    rows = []
    for model in models:
        hf_config, shapes = sync_model_shapes(model)
        plan = plan_sync(shapes, ranks, EngineLayout.from_hf_config(hf_config, 1, "float32"), int(bucket_mb * 2**20))
        on = lambda host: {"resources": {host: 1}}  # noqa: E731
        senders = {transport: [sender_cls.options(**on("host_a")).remote(plan, rank, transport) for rank in range(ranks)]
                   for transport in ("ray", "shm")}
        prefix = ray.get(senders["shm"][0].buffer_prefix.remote())
        ray.get([sender.share_buffers.remote(prefix) for sender in senders["shm"]])
        receivers = [receiver_cls.options(**on(host)).remote(plan, transport) for transport, host, _ in CONFIGS]
        times: list[list[float]] = [[] for _ in CONFIGS]
        for version in range(repeats + 1):  # version 0 warms every path up (first-touch buffers), untimed
            for index, ((transport, _, _), receiver) in enumerate(zip(CONFIGS, receivers)):
                ray.get(receiver.begin.remote(version + 1))
                started = time.perf_counter()
                ray.get([sender.send.remote(version + 1, receiver) for sender in senders[transport]])
                ray.get(receiver.finish.remote())
                if version:
                    times[index].append(time.perf_counter() - started)
                ray.get([sender.release.remote() for sender in senders[transport]])
        for (transport, host, label), seconds in zip(CONFIGS, times):
            median = statistics.median(seconds)
            rows.append({"model": model, "ranks": ranks, "config": label, "transport": transport, "receiver": host,
                         "bytes": plan.nbytes, "seconds": seconds, "median_s": median,
                         "gbps": plan.nbytes / median / 1e9})
        ray.get([sender.close.remote() for group in senders.values() for sender in group])
        for handle in [*receivers, *(s for group in senders.values() for s in group)]:
            ray.kill(handle)
    ray.shutdown()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m")
    parser.add_argument("--ranks", type=int, default=1, help="learner ranks sending (each its own shards)")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the rows as JSON here")
    parser.add_argument("--inside", metavar="ADDRESS", help=argparse.SUPPRESS)  # the measuring half, on host A
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    if args.inside:
        print(json.dumps(measure(args.inside, models, args.ranks, args.bucket_mb, args.repeats)))
        return 0

    from tests.integration.hosts import HostCluster, HostsUnavailable

    try:
        # Room in each host's object store and /dev/shm for a whole version of the largest model, twice over.
        cluster = HostCluster({"host_a": {"cpus": 2 * args.ranks + 3, "resources": {"host_a": 8}},
                               "host_b": {"cpus": 2, "resources": {"host_b": 8}}},
                              shm_mb=6144, object_store_mb=4096)
    except HostsUnavailable as err:
        print(f"bench_sync_hosts: no cluster of hosts on this machine: {err}", file=sys.stderr)
        return 2
    try:
        command = [sys.executable, str(Path(__file__).resolve()), "--inside", cluster.address, "--models", args.models,
                   "--ranks", str(args.ranks), "--bucket-mb", str(args.bucket_mb), "--repeats", str(args.repeats)]
        done = cluster.head.run(command, cwd=str(REPO), capture_output=False, stdout=subprocess.PIPE, timeout=3600)
    finally:
        cluster.close()
    if done.returncode != 0:
        print(f"bench_sync_hosts: the measurement failed (exit {done.returncode})", file=sys.stderr)
        return 1
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{datetime.date.today()}, {args.ranks} learner rank(s), {args.bucket_mb:g} MiB buckets, "
          f"median of {args.repeats} (min-max)")
    for model in models:
        ours = [row for row in rows if row["model"] == model]
        one = next(row for row in ours if row["config"] == "ray, one host")["median_s"]
        print(f"{model} ({ours[0]['bytes'] / 1e9:.2f} GB)")
        for row in ours:
            print(f"  {row['config']:<18} {row['median_s']:6.3f} s ({min(row['seconds']):.3f}-{max(row['seconds']):.3f})"
                  f"  {row['gbps']:5.2f} GB/s  {row['median_s'] / one:5.2f}x ray on one host")
    if args.out:
        Path(args.out).write_text(json.dumps({"ranks": args.ranks, "bucket_mb": args.bucket_mb, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
