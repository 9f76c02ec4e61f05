"""Small train batches the learner tests share (importable without pytest, as tests/cuda runs without it)."""

from __future__ import annotations

import torch

from rlpipe.types import TrainBatch


def four_samples(seed: int = 0) -> TrainBatch:
    """Four random samples of different prompt and completion lengths, advantages 1, -1, 0.5, -0.5."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (4, 6, 3, 5)]
    completions = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (5, 2, 7, 4)]
    logprobs = [[-1.0] * len(c) for c in completions]
    return TrainBatch.from_sequences(prompts, completions, logprobs, [1.0, -1.0, 0.5, -0.5], pad_id=0)
