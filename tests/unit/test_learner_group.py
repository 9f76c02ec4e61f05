"""Two learner ranks on gloo (SimpleFSDP) against one: the same GRPO losses and the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from rlpipe.config import load_config
from rlpipe.training.learner import Learner, combine_rank_metrics
from rlpipe.models import load_model
from rlpipe.parallel.mesh import find_free_port
from rlpipe.types import TrainBatch
from rlpipe.weightsync.form import weight_form
from rlpipe.weightsync import shard_rows
from tests.weights import whole_weights

STEPS = 3


def _config(model_path, ranks, graph=False, *extra):
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
            *extra,
        ],
    )


def _batches(zero_advantages: bool = False) -> list[TrainBatch]:
    """With `zero_advantages`, two samples of the first step and every sample of the second have advantage 0."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for step in range(STEPS):
        prompts = [torch.randint(3, 300, (int(n),), generator=generator).tolist() for n in torch.randint(2, 7, (6,))]
        completions = [torch.randint(3, 300, (int(n),), generator=generator).tolist() for n in torch.randint(1, 8, (6,))]
        logprobs = [[-1.0] * len(c) for c in completions]
        advantages = torch.randn(6, generator=generator)
        if zero_advantages:
            advantages[[1, 4] if step == 0 else slice(None) if step == 1 else []] = 0.0
        out.append(TrainBatch.from_sequences(prompts, completions, logprobs, advantages.tolist()))
    return out


def _rank(rank, world_size, model_path, port, graph, results, extra=(), zero_advantages=False):
    torch.set_num_threads(1)
    cfg = _config(model_path, world_size, graph, *extra)
    learner = Learner.from_config(model_path, cfg, rank, world_size, weight_form(cfg, model_path))
    learner.join_process_group("127.0.0.1", port)
    sums = [learner.train_step(batch) for batch in _batches(zero_advantages)]
    state = whole_weights(learner)
    local = {k: v.detach().numpy().copy() for k, v in learner.local_weights().items()}
    # numpy, not tensors: torch would share tensor memory by file descriptor, which dies with this process.
    results.put((sums, {k: v.detach().numpy().copy() for k, v in state.items()} if rank == 0 else None, rank, local))
    torch.distributed.destroy_process_group()


# The dense model's sharded graph step is checked against eager in the activation-checkpointing test below; each
# two-rank inductor compile costs a minute or more of the suite. The dense eager case runs without a KL term, so
# samples with advantage 0 are skipped: the ranks split what is left, and a step with none left steps AdamW on
# zero gradients (sharded ones here).
@pytest.mark.parametrize(
    ("family", "graph"), [("qwen3", False), ("qwen3_moe", False), ("qwen3_moe", True), ("olmo2", False)],
    ids=["eager-qwen3-skipping", "eager-qwen3_moe", "graph-qwen3_moe", "eager-olmo2-transformers"],
)
@pytest.mark.heavy
def test_two_ranks_equal_one(request, family, graph):
    """Two sharded ranks (eager, or each step as one captured graph) against one eager unsharded rank. The
    mixture-of-experts model's stacked expert weights are sharded on the expert dimension (2 of its 4 experts a
    rank), and its router metrics, summed over ranks, equal the single rank's. OLMo 2 runs on transformers' code:
    SimpleFSDP shards its modules as it does rlpipe's, each rank reading only its rows."""
    tiny_qwen3 = request.getfixturevalue(f"tiny_{family}")
    skipping = family == "qwen3" and not graph
    extra = ("algo.kl_beta=0",) if skipping else ()
    if family == "qwen3_moe" and not graph:  # two passes over each step's samples (TRL's num_iterations)
        extra = ("train.num_iterations=2",)
    single = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, 1, False, *extra))
    assert single.skip_zero_advantage == skipping
    single_metrics = [combine_rank_metrics([single.train_step(b)]) for b in _batches(skipping)]
    if skipping:
        assert [m["learner/samples_run"] for m in single_metrics] == [4, 0, 6]
    assert single.engine.optimizer_steps_taken == STEPS * single.num_iterations

    context = mp.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    procs = [
        context.Process(target=_rank, args=(r, 2, tiny_qwen3, port, graph, results, extra, skipping)) for r in range(2)
    ]
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
        router_keys = ("moe/expert_load_min", "moe/expert_load_max", "moe/expert_load_entropy", "moe/aux_loss")
        keys = ("loss", "kl", "entropy", "grad_norm", "train_tokens", "learner/samples_run",
                *(router_keys if family == "qwen3_moe" else ()))
        for key in keys:
            if key in single_metrics[step] or key in combined:  # no kl without a KL term; no entropy with no row run
                assert abs(combined[key] - single_metrics[step][key]) < 1e-5, (step, key)
    if family == "qwen3_moe":
        assert local[0]["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 2  # whole experts per rank
    start = load_model(tiny_qwen3).state_dict()
    for name, tensor in single.model.state_dict().items():
        torch.testing.assert_close(torch.from_numpy(state[name]), tensor, atol=1e-5, rtol=0)
    assert max((start[n] - t).abs().max() for n, t in single.model.state_dict().items()) > 1e-3  # it trained


def _recompute_rank(rank, model_path, port_queue, results):
    """Eager learners without and with activation checkpointing, then a graph learner with it, one after another."""
    import torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass as remat

    torch.set_num_threads(1)
    rematerialise, gathers = remat.remat_using_tags_for_fwd_loss_bwd_graph, {}

    def counting(graph_module):
        # The compiled step's forward-loss-backward graph after torch re-emitted checkpointed ops for backward.
        graph_module = rematerialise(graph_module)
        nodes = [n for n in graph_module.graph.nodes if "all_gather_into_tensor" in str(n.target)]
        gathers[current] = (len(nodes), sum(n.name.endswith("_recomputed") for n in nodes))
        return graph_module

    remat.remat_using_tags_for_fwd_loss_bwd_graph = counting
    out = {}
    runs = [(False, False), (False, True), (True, True)]
    for current in runs:
        # Each group's port is chosen when it starts, by rank 0: one chosen minutes earlier may be taken by then.
        if rank == 0:
            port = find_free_port()
            port_queue.put(port)
        else:
            port = port_queue.get(timeout=600)
        graph, recompute = current
        cfg = _config(
            model_path,
            2,
            graph,
            f"learner.activation_checkpointing={str(recompute).lower()}",
            "train.micro_batch_size=3",  # a rank's 3 rows in one pass, as the graph step with checkpointing needs
        )
        learner = Learner.from_config(model_path, cfg, rank, 2)
        learner.join_process_group("127.0.0.1", port)
        sums = [learner.train_step(batch) for batch in _batches()]
        state = {k: v.detach().numpy().copy() for k, v in whole_weights(learner).items()}
        out[current] = (sums, state, learner.model.model.activation_checkpointing)
        torch.distributed.destroy_process_group()
    results.put((rank, out, gathers))


@pytest.mark.heavy
def test_activation_checkpointing_on_two_ranks_changes_no_numbers(tiny_qwen3):
    """Sharded eager steps with checkpointed layers equal those without (1e-6), and so does the compiled (inductor)
    step with checkpointed layers, within compiled-vs-eager float noise; in the compiled graph every layer weight's
    all-gather is re-emitted for backward, so backward reads no forward-gathered copy."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port_queue = context.Queue()
    procs = [context.Process(target=_recompute_rank, args=(r, tiny_qwen3, port_queue, results)) for r in range(2)]
    for p in procs:
        p.start()
    outputs = dict((rank, (out, gathers)) for rank, out, gathers in (results.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    keep_run = (False, False)
    for recompute_run, tolerance in (((False, True), 1e-6), ((True, True), 1e-5)):
        per_rank = {rank: (outputs[rank][0][keep_run], outputs[rank][0][recompute_run]) for rank in range(2)}
        assert per_rank[0][1][2] and not per_rank[0][0][2]
        for step in range(STEPS):
            keep = combine_rank_metrics([per_rank[rank][0][0][step] for rank in range(2)])
            recompute = combine_rank_metrics([per_rank[rank][1][0][step] for rank in range(2)])
            for key in ("loss", "kl", "entropy", "grad_norm"):
                assert abs(recompute[key] - keep[key]) < tolerance, (recompute_run, step, key)
        for name, tensor in per_rank[0][0][1].items():
            torch.testing.assert_close(torch.from_numpy(per_rank[0][1][1][name]), torch.from_numpy(tensor),
                                       atol=tolerance, rtol=0)
    layer_params = sum(1 for _ in load_model(tiny_qwen3).model.layers.parameters())  # 2 layers x 11
    for rank in range(2):
        gathers, recomputed = outputs[rank][1][(True, True)]
        assert recomputed == layer_params and gathers > recomputed  # the forward's own gathers stay, as named


def _one_program_rank(rank, model_path, port, results):
    """One compiled step on a rank of two; reports the micro-batches it ran and each graph Dynamo handed the
    backend (a hash of its code and its inputs' shapes), what a compiler of the graph would see."""
    import hashlib

    torch.set_num_threads(1)
    cfg = _config(model_path, 2, True, "learner.packed_buckets=[4,8,16,24,32]", "algo.kl_beta=0")
    learner = Learner.from_config(model_path, cfg, rank, 2)
    learner.join_process_group("127.0.0.1", port)
    step = learner.engine.step_fn
    graphs, micro_batches = [], []
    eager = torch._dynamo.backends.registry.lookup_backend("eager")  # the graph is what matters, not its code

    def recording(graph_module, example_inputs):
        shapes = [tuple(value.shape) for value in example_inputs if isinstance(value, torch.Tensor)]
        graphs.append((hashlib.sha256(graph_module.code.encode()).hexdigest(), shapes))
        return eager(graph_module, example_inputs)

    step._counter.backend = recording
    run = step.step

    def recorded(batch, lr=None):
        micro_batches.extend(
            (tuple(m.input_ids.shape), tuple(m.layout.input_ids.shape), int(m.loss_inputs.mask.sum())) for m in batch
        )
        return run(batch, lr)

    step.step = recorded
    prompts = [[5, 6]] * 3 + [list(range(10, 18))] * 3  # group 0 short (rank 0's rows), group 1 long (rank 1's)
    completions = [[7]] * 3 + [list(range(20, 28))] * 3
    batch = TrainBatch.from_sequences(prompts, completions, [[-1.0] * len(c) for c in completions],
                                      [1.0, -1.0, 0.5, 1.0, -1.0, 0.5])
    learner.train_step(batch)
    results.put((rank, micro_batches, graphs))
    torch.distributed.destroy_process_group()


@pytest.mark.heavy
def test_two_ranks_with_different_shares_compile_one_program(tiny_qwen3):
    """The compiled packed step on two ranks whose rows differ (rank 0 a group of 4-token rows, rank 1 one of
    16-token rows): both run micro-batches of the same shapes, packed to the width of the longest micro-batch of
    either rank, and hand the compiler the same graph; no rank compiles a program of its own."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    procs = [context.Process(target=_one_program_rank, args=(r, tiny_qwen3, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    outputs = {rank: (micro, graphs) for rank, micro, graphs in (results.get(timeout=600) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (micro_0, graphs_0), (micro_1, graphs_1) = outputs[0], outputs[1]
    assert [trained for *_, trained in micro_0] != [trained for *_, trained in micro_1]  # different rows
    assert len(graphs_0) == 1 and graphs_0[0][0] == graphs_1[0][0] and graphs_0[0][1] == graphs_1[0][1]
    # Rank 1's first pass: an 8-token prompt once and two 8-token completions, 24 tokens, the 24 bucket.
    assert [shapes for *shapes, _ in micro_0] == [shapes for *shapes, _ in micro_1] == [[(2, 24), (1, 24)]] * 2
