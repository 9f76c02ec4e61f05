"""Two learner ranks on gloo (SimpleFSDP) against one: the same GRPO losses and the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from rlpipe.config import load_config
from rlpipe.learner import Learner, combine_rank_metrics
from rlpipe.models import load_model
from rlpipe.parallel.mesh import find_free_port
from rlpipe.types import TrainBatch
from rlpipe.weightsync import shard_rows

STEPS = 3


def _config(model_path, ranks, graph=False):
    return load_config(
        None,
        [
            f"learner.graph={str(graph).lower()}",
            "learner.length_buckets=[16]",
            "data.max_prompt_tokens=8",
            "rollout.max_tokens=8",
            "train.adam_eps=1e-4",  # see test_learner.py: keeps compiled-vs-eager float noise out of Adam's steps
            f"model.path={model_path}",
            "rollout.group_size=3",
            "train.prompts_per_step=2",
            "train.micro_batch_size=2",  # 3 rows a rank: one full micro-batch and one short one
            "train.lr=1e-3",  # Adam turns float noise in near-zero gradients into steps of size ~lr
            f"train.steps={STEPS}",
            f"learner.ranks={ranks}",
            "algo.kl_beta=0.05",  # a sharded reference model takes part too
        ],
    )


def _batches() -> list[TrainBatch]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        prompts = [torch.randint(3, 300, (int(n),), generator=generator).tolist() for n in torch.randint(2, 7, (6,))]
        completions = [torch.randint(3, 300, (int(n),), generator=generator).tolist() for n in torch.randint(1, 8, (6,))]
        logprobs = [[-1.0] * len(c) for c in completions]
        advantages = torch.randn(6, generator=generator).tolist()
        out.append(TrainBatch.from_sequences(prompts, completions, logprobs, advantages))
    return out


def _rank(rank, world_size, model_path, port, graph, results):
    torch.set_num_threads(1)
    learner = Learner(model_path, _config(model_path, world_size, graph), rank, world_size)
    learner.join_group("127.0.0.1", port)
    sums = [learner.train_step(batch) for batch in _batches()]
    state = learner.full_state_dict()
    local = {k: v.detach().numpy().copy() for k, v in learner.local_weights().items()}
    # numpy, not tensors: torch would share tensor memory by file descriptor, which dies with this process.
    results.put((sums, {k: v.detach().numpy().copy() for k, v in state.items()} if rank == 0 else None, rank, local))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_two_ranks_equal_one(tiny_qwen3, graph):
    """Two sharded ranks (eager, or each step as one captured graph) against one eager unsharded rank."""
    single = Learner(tiny_qwen3, _config(tiny_qwen3, 1))
    single_metrics = [combine_rank_metrics([single.train_step(b)]) for b in _batches()]

    context = mp.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    procs = [context.Process(target=_rank, args=(r, 2, tiny_qwen3, port, graph, results)) for r in range(2)]
    for p in procs:
        p.start()
    outputs = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    per_rank_sums = [sums for sums, *_ in outputs]
    state = next(s for _, s, *_ in outputs if s is not None)
    # What weight sync reads: each rank's own rows (no gather), which together are the whole weights.
    local = {rank: shards for *_, rank, shards in outputs}
    for name, full in state.items():
        for rank in range(2):
            start, stop = shard_rows(full.shape[0], rank, 2)
            assert local[rank][name].shape == (stop - start, *full.shape[1:]), name
        torch.testing.assert_close(torch.from_numpy(np.concatenate([local[0][name], local[1][name]])),
                                   torch.from_numpy(full), atol=0, rtol=0)

    for step in range(STEPS):
        combined = combine_rank_metrics([sums[step] for sums in per_rank_sums])
        if graph:
            assert combined["learner/graph_compiles"] == 1
        for key in ("loss", "kl", "entropy", "grad_norm", "train_tokens"):
            assert abs(combined[key] - single_metrics[step][key]) < 1e-5, (step, key)
    start = load_model(tiny_qwen3).state_dict()
    for name, tensor in single.model.state_dict().items():
        torch.testing.assert_close(torch.from_numpy(state[name]), tensor, atol=1e-5, rtol=0)
    assert max((start[n] - t).abs().max() for n, t in single.model.state_dict().items()) > 1e-3  # it trained
