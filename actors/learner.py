"""Ray actor holding one learner rank (rlpipe/training/learner.py does the work)."""

from __future__ import annotations

import os

import ray
import torch

from rlpipe.actors.calls import get_all, settle
from rlpipe.training.checkpoint import set_torch_rng_text, torch_rng_text
from rlpipe.config import Config
from rlpipe.hardware.device import learner_processes
from rlpipe.training.learner import Learner
from rlpipe.reporting.logs import LogSetup, configure_worker
from rlpipe.hardware.tpu_env import keep_only_given_tpu_env
from rlpipe.types import TrainBatch
from rlpipe.weightsync.form import FULL, WeightForm
from rlpipe.weightsync import SyncPlan, make_transport, stream_parts
from rlpipe.weightsync.transport import SegmentNames

# Parts of this many buckets may be in flight per engine before the sender waits for receipts.
_BUCKETS_IN_FLIGHT = 2
# After a failed part, how long the parts still in flight are waited for.
_SETTLE_S = 30.0


def send_parts(
    plan: SyncPlan, rank: int, local: dict[str, torch.Tensor], transport, engines: list, version: int, key: bytes,
    timeout_s: float | None = None,
) -> int:
    """Stream `rank`'s parts of every bucket to the engines' `receive_part`, their checksums keyed with the run's
    secret `key`; returns the bytes sent per engine.
    Each engine is told about a part before it is delivered (a gloo send waits for its receiver). Every receipt has
    the deadline `timeout_s` (sync.timeout_s). After a failed receipt the parts still in flight are waited for and
    their errors dropped: they fail only because the version was abandoned."""
    receipts: list[list] = []
    sent = 0
    try:
        for part in stream_parts(plan, rank, local, transport, version, key):
            receipts.append(
                [
                    engine.receive_part.remote(version, part.bucket, part.rank, part.handle, part.nbytes, part.checksum)
                    for engine in engines
                ]
            )
            part.deliver()
            sent += part.sent_bytes
            if len(receipts) > _BUCKETS_IN_FLIGHT:  # bounds what the object store holds for this sync
                get_all(receipts[-_BUCKETS_IN_FLIGHT - 1], timeout_s, "a rollout engine", "receive_part",
                        "sync.timeout_s")
        get_all([ref for refs in receipts for ref in refs], timeout_s, "a rollout engine", "receive_part",
                "sync.timeout_s")
    except BaseException:
        # Bounded apart from the deadline: a part an engine never answers raises nothing later either.
        settle([ref for refs in receipts for ref in refs], min(timeout_s or _SETTLE_S, _SETTLE_S))
        raise
    return sent


@ray.remote
class LearnerActor:
    def __init__(
        self, model_path: str, cfg: Config, rank: int, world_size: int, log: LogSetup | None = None,
        form: WeightForm = FULL,
    ):
        keep_only_given_tpu_env()  # also where Ray was started without rlpipe's job environment (actors/cluster.py)
        if log is not None:
            configure_worker(log)
        # Ray caps an actor's threads at its logical CPU share; the learner should use the whole machine
        # while it trains, since generation and training take turns in synchronous mode.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        self.cfg = cfg
        self.learner = Learner.from_config(model_path, cfg, rank, world_size, form)
        self.transport = make_transport(cfg.sync.transport)

    def rendezvous_address(self) -> tuple[str, int]:
        """Where rank 0 listens for the group: this node's address and a free port on it."""
        from rlpipe.parallel.mesh import find_free_port

        address = ray.util.get_node_ip_address()
        return address, find_free_port(address)

    def join_process_group(self, master_addr: str, master_port: int) -> None:
        self.learner.join_process_group(master_addr, master_port)

    def join_sync_process_group(self, address: str, port: int, world: int) -> None:
        learners = learner_processes(self.cfg.learner.device, self.cfg.learner.ranks)
        self.transport.connect(address, port, self.learner.rank, learners, world, self.cfg.sync.timeout_s)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.learner.train_step(batch)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.learner.weight_shapes()

    # This rank's end of the weight-sync channel, set up and driven by its driver side (actors/sync_channel.py).

    def set_sync_routes(self, routes: list[str], whole_buckets: bool) -> None:
        """The route to each engine (rlpipe/weightsync/routes.py)."""
        self.transport.set_routes(routes, whole_buckets)

    def sync_buffer_prefix(self) -> SegmentNames | None:
        """How the buffers every rank writes into are named, where the transport shares them (asked of rank 0)."""
        return self.transport.buffer_prefix()

    def share_sync_buffers(self, prefix: SegmentNames | None) -> None:
        self.transport.share_buffers(prefix)

    def send_weights(self, plan: SyncPlan, version: int, engines: list, engine_indexes: list[int], key: bytes) -> int:
        """Stream this rank's parts of every bucket to `engines` (the pool's engines `engine_indexes`), checksums keyed
        with the run's secret `key`; returns the bytes sent to each engine."""
        self.transport.select(engine_indexes)
        return send_parts(plan, self.learner.rank, self.learner.local_weights(), self.transport, engines, version,
                          key, self.cfg.sync.timeout_s)

    def release_weights(self) -> None:
        self.transport.release()

    def close_sync(self) -> None:
        """Free the transport's buffers (shared-memory segments are unlinked)."""
        self.transport.close()

    def probe_reference(self, token_ids: list[int], by_decoding: bool):
        return self.learner.probe_reference(token_ids, by_decoding)

    def export(self, out_dir: str) -> str:
        return self.learner.export(out_dir)

    def policy_version(self) -> int:
        return self.learner.policy_version

    def save_checkpoint(self, directory: str) -> str:
        """This rank's part of the learner state; returns its torch RNG state (base64) for trainer.json."""
        self.learner.save_checkpoint(directory)
        return torch_rng_text()

    def load_checkpoint(self, directory: str, rng_state: str | None) -> int:
        self.learner.load_checkpoint(directory)
        if rng_state is not None:
            set_torch_rng_text(rng_state)
        return self.learner.policy_version
