"""Whole weights of a learner, for tests that compare them: the library never gathers a whole model in one process
(the sync, checkpoints and export go tensor by tensor or shard by shard)."""

from __future__ import annotations

import torch


def whole_weights(learner) -> dict[str, torch.Tensor]:
    """Whole tensors under Hugging Face names, on the CPU (a collective when sharded: every rank calls it); with
    adapters, the base weights with the adapters merged in. `learner`: a Learner or its TrainEngine."""
    engine = getattr(learner, "engine", learner)
    return engine.weights.full_state_dict(engine.model)
