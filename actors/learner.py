"""Ray actor holding one learner rank (rlpipe/learner.py does the work)."""

from __future__ import annotations

import os

import ray
import torch

from rlpipe.config import Config
from rlpipe.learner import Learner
from rlpipe.types import TrainBatch


@ray.remote
class LearnerActor:
    def __init__(self, model_path: str, cfg: Config, rank: int, world_size: int):
        # Ray caps an actor's threads at its logical CPU share; the learner should use the whole machine
        # while it trains, since generation and training take turns in synchronous mode.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        self.learner = Learner(model_path, cfg, rank, world_size)

    def rendezvous_address(self) -> tuple[str, int]:
        """Where rank 0 listens for the group: this node's address and a free port on it."""
        from rlpipe.parallel.mesh import find_free_port

        address = ray.util.get_node_ip_address()
        return address, find_free_port(address)

    def join_group(self, master_addr: str, master_port: int) -> None:
        self.learner.join_group(master_addr, master_port)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.learner.train_step(batch)

    def weights_payload(self) -> bytes:
        return self.learner.weights_payload()

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        return self.learner.sequence_logprobs(token_ids)

    def export(self, out_dir: str) -> str:
        return self.learner.export(out_dir)

    def policy_version(self) -> int:
        return self.learner.policy_version
