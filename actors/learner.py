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
    def __init__(self, model_path: str, cfg: Config):
        # Ray caps an actor's threads at its logical CPU share; the learner should use the whole machine
        # while it trains, since generation and training take turns in synchronous mode.
        torch.set_num_threads(os.cpu_count() or 1)
        self.learner = Learner(model_path, cfg)

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
