"""SimpleFSDP on 2 gloo ranks against the unsharded model trained in this process.

Each model variant is trained once per precision in one spawned 2-rank job (a module-scoped fixture); the ranks save
what they observed (losses, full weights, state-dict layout, dtypes seen in forward and in `.grad`) and the tests
compare it with a single-process reference. The vocabulary (97) and MLP width (75) are odd so that first dims split
unevenly (97 rows -> 49 + 48).
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity

from rlpipe.models import build_model
from rlpipe.parallel import (
    MixedPrecision,
    destroy_distributed,
    find_free_port,
    gathering_disabled,
    init_distributed,
    make_mesh,
    shard_model,
)
from rlpipe.parallel import simple_fsdp
from rlpipe.parallel.simple_fsdp import full_tensors

WORLD_SIZE = 2
STEPS = 3
LEARNING_RATE = 1e-3
BATCH, SEQUENCE = 4, 9
SPAWN_TIMEOUT_S = 120
FP32_TOLERANCE = 1e-5

_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=75,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    # Larger than HF's 0.02 so the logits depend visibly on every weight.
    initializer_range=0.1,
)
CONFIGS = {
    "llama-gqa-untied": dict(_COMMON, model_type="llama", tie_word_embeddings=False),
    "qwen3-gqa-tied": dict(_COMMON, model_type="qwen3", head_dim=16, tie_word_embeddings=True),
    # 3 experts over 2 ranks: the stacked expert weights split unevenly on the expert dimension (2 + 1 experts);
    # layer 0 keeps a dense MLP (mlp_only_layers), so both kinds of MLP are sharded side by side.
    "qwen3-moe-3-experts": dict(
        _COMMON,
        model_type="qwen3_moe",
        head_dim=16,
        num_experts=3,
        num_experts_per_tok=2,
        moe_intermediate_size=20,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
}
# run name -> (mesh replicate factor, mixed precision)
RUNS = {
    "fp32": (1, MixedPrecision()),
    "bf16": (1, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    "hybrid-fp32": (2, MixedPrecision()),
}


def _token_ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, CONFIGS["llama-gqa-untied"]["vocab_size"], (BATCH, SEQUENCE), generator=generator)


def _build(config_name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model(CONFIGS[config_name])


def _loss(model: nn.Module, rows: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """This rank's share of the full batch's mean next-token cross-entropy: summed over ranks it is that mean."""
    logits = model(rows[:, :-1]).float()
    token_losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="sum")
    return token_losses / total_tokens


def _train(model: nn.Module, rows: torch.Tensor, total_tokens: int, on_first_backward=None) -> list[float]:
    """STEPS AdamW steps; returns the full-batch loss of each step (summed over ranks when distributed)."""
    # eps=1e-6 rather than 1e-8: Adam divides by sqrt(v) + eps, so for an element whose gradient nearly cancels
    # (|g| ~ 1e-7) the fp32 rounding that differs between a 2-rank and a 1-rank reduction (~1e-10) would otherwise
    # become a visible difference in the update and make a 1e-5 comparison of weights flaky.
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=1e-6, foreach=True)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = _loss(model, rows, total_tokens)
        loss.backward()
        if step == 0 and on_first_backward is not None:
            on_first_backward()
        optimizer.step()
        full_loss = loss.detach().clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(full_loss)
        losses.append(full_loss.item())
    return losses


@contextmanager
def _counting_gathers():
    """Counts the parametrization's all-gathers (one per parameter read) while the block runs."""
    count = {"calls": 0}
    original = simple_fsdp._all_gather

    def counted(param, mp):
        count["calls"] += 1
        return original(param, mp)

    simple_fsdp._all_gather = counted
    try:
        yield count
    finally:
        simple_fsdp._all_gather = original


def _observe_one_step(model: nn.Module, full_shapes: dict[str, tuple], compute_dtype: torch.dtype) -> dict:
    """One forward and backward of a sharded model: what autograd saved in forward (every saved tensor passes the
    saved-tensors hook), and the all-gathers of forward and of backward (parametrization calls and, on a mesh of
    more than one rank, the collectives themselves)."""
    layer_weight_shapes = {shape for name, shape in full_shapes.items() if ".layers." in name and len(shape) == 2}
    output_shape = full_shapes.get("lm_head.weight", full_shapes["model.embed_tokens.weight"])
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    # 3 x 7 = 21 tokens: no activation shares a shape with a weight of these models.
    ids = torch.randint(0, CONFIGS["llama-gqa-untied"]["vocab_size"], (3, 8), generator=torch.Generator().manual_seed(7))
    with _counting_gathers() as forward_gathers, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = _loss(model, ids, ids[:, 1:].numel())
    # The profiler sees the collectives gloo runs, and needs no dispatch mode (which would disturb the recompute).
    with _counting_gathers() as backward_gathers, torch.profiler.profile(activities=[ProfilerActivity.CPU]) as profile:
        loss.backward()
    model.zero_grad(set_to_none=True)

    def weight_shaped(tensor, shapes):
        return tensor.dim() == 2 and tensor.dtype == compute_dtype and (tensor.shape in shapes or tensor.T.shape in shapes)

    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in saved}
    return dict(
        saved_bytes=sum(storages.values()),
        saved_layer_weights=sorted({tuple(t.shape) for t in saved if weight_shaped(t, layer_weight_shapes)}),
        saved_output_projection=any(weight_shaped(t, {output_shape}) for t in saved),
        forward_gathers=forward_gathers["calls"],
        backward_gathers=backward_gathers["calls"],
        backward_all_gather_collectives=sum(
            event.count for event in profile.key_averages() if event.key == "gloo:all_gather"
        ),
        layer_params=sum(1 for layer in model.model.layers for _ in layer.parameters()),
    )


def _recompute_run(config_name: str, rank: int) -> dict:
    """fp32 SimpleFSDP on 2 ranks with and without activation checkpointing: one observed step, then STEPS of
    training (losses and final full weights)."""
    ids = _token_ids()
    rows = ids.chunk(WORLD_SIZE)[rank]
    out = {}
    for recompute in (False, True):
        model = _build(config_name)
        full_shapes = {name: tuple(value.shape) for name, value in model.state_dict().items()}
        shard_model(model, make_mesh(WORLD_SIZE, "cpu"))
        model.model.activation_checkpointing = recompute
        observed = _observe_one_step(model, full_shapes, torch.float32)
        observed["losses"] = _train(model, rows, ids[:, 1:].numel())
        observed["final_full"] = dict(full_tensors(model))
        out["recompute" if recompute else "keep"] = observed
    return out


# ---------------------------------------------------------------- spawned ranks


def _sharded_run(config_name: str, replicate: int, mp: MixedPrecision, rank: int) -> dict:
    model = _build(config_name)
    unsharded_names = list(model.state_dict())
    mesh = make_mesh(WORLD_SIZE, "cpu", replicate=replicate)
    shard_model(model, mesh, mp)

    layout = {
        name: (type(value).__name__, tuple(value.to_local().shape), [repr(p) for p in value.placements])
        for name, value in model.state_dict().items()
    }
    initial_full = dict(full_tensors(model))

    embedding_module = model.model.embed_tokens
    with gathering_disabled():
        embedding_while_disabled = embedding_module.weight
        disabled_view = (type(embedding_while_disabled).__name__, tuple(embedding_while_disabled.to_local().shape))
    with torch.no_grad():
        gathered = embedding_module.weight  # a collective: both ranks read it
        gathered_view = (type(gathered).__name__, tuple(gathered.shape), str(gathered.dtype))

    # What forward computes with: output dtypes of every weight-bearing module, and the weight q_proj reads.
    forward_dtypes: dict[str, str] = {}

    def record_output(name):
        def hook(module, args, output):
            forward_dtypes[name] = str(output.dtype)

        return hook

    def record_gathered_weight(module, args):
        with torch.no_grad():
            weight = module.weight
        forward_dtypes["q_proj.weight as read in forward"] = f"{type(weight).__name__}:{weight.dtype}"

    hooks = [
        module.register_forward_hook(record_output(name))
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Embedding))
    ]
    # The logits come from F.linear with output_embedding() (the embedding itself when tied), not from a module.
    hooks.append(model.register_forward_hook(record_output("logits")))
    hooks.append(model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(record_gathered_weight))

    grads: dict[str, tuple] = {}
    first_full_grads: dict[str, torch.Tensor] = {}

    def record_grads():
        for hook in hooks:
            hook.remove()
        for name, param in model.named_parameters():
            grads[name] = (type(param.grad).__name__, str(param.grad.dtype), [repr(p) for p in param.grad.placements])
            first_full_grads[name] = param.grad.full_tensor()  # a collective, same order on every rank

    ids = _token_ids()
    rows = ids.chunk(WORLD_SIZE)[rank]
    losses = _train(model, rows, ids[:, 1:].numel(), on_first_backward=record_grads)
    final_full = dict(full_tensors(model))
    master_dtypes = {name: str(param.dtype) for name, param in model.named_parameters()}

    return dict(
        unsharded_names=unsharded_names,
        layout=layout,
        initial_full=initial_full,
        disabled_view=disabled_view,
        gathered_view=gathered_view,
        forward_dtypes=forward_dtypes,
        grads=grads,
        first_full_grads=first_full_grads,
        losses=losses,
        final_full=final_full,
        master_dtypes=master_dtypes,
    )


def _plain_module_checks() -> dict:
    """A bare Linear (float inputs, uneven 3 -> 2 + 1 rows): fp32 activations get cast to the bf16 compute dtype,
    and an in-place write under gathering_disabled() reaches the stored shards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3))
    shard_model(model, make_mesh(WORLD_SIZE), MixedPrecision(param_dtype=torch.bfloat16))
    output = model(torch.randn(2, 5))
    with gathering_disabled(), torch.no_grad():
        model[0].weight.fill_(0.5)
    return dict(output_dtype=str(output.dtype), weight_after_fill=dict(full_tensors(model))["0.weight"])


def _rank_main(rank: int, port: int, config_name: str, run_names: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks share a small machine
    try:
        init_distributed("gloo", rank, WORLD_SIZE, "127.0.0.1", port, timeout_s=60)
        results = {}
        for run_name in run_names:
            replicate, mp = RUNS[run_name]
            started = time.perf_counter()
            results[run_name] = _sharded_run(config_name, replicate, mp, rank)
            results[run_name]["seconds"] = time.perf_counter() - started
        results["plain_module"] = _plain_module_checks()
        results["activation_checkpointing"] = _recompute_run(config_name, rank)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        destroy_distributed()


def _spawn_ranks(config_name: str, run_names: list[str], out_dir: Path) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    port = find_free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, port, config_name, run_names, str(out_dir)))
        for rank in range(WORLD_SIZE)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [process for process in processes if process.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    errors = [path.read_text() for path in sorted(out_dir.glob("rank*.error"))]
    if hung or errors or any(process.exitcode != 0 for process in processes):
        pytest.fail(
            f"sharded ranks failed (exit codes {[p.exitcode for p in processes]}, "
            f"{len(hung)} killed after {SPAWN_TIMEOUT_S} s):\n" + "\n".join(errors)
        )
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def config_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def sharded(config_name, tmp_path_factory) -> list[dict]:
    """Per rank: {run name: observations}."""
    run_names = list(RUNS)
    started = time.perf_counter()
    per_rank = _spawn_ranks(config_name, run_names, tmp_path_factory.mktemp(f"fsdp-{config_name}"))
    runs = ", ".join(f"{name} {per_rank[0][name]['seconds']:.1f} s" for name in run_names)
    print(f"\n{config_name}: 2-rank job {time.perf_counter() - started:.1f} s ({runs})")
    return per_rank


@pytest.fixture(scope="module")
def reference(config_name) -> dict:
    """The unsharded model trained on the whole batch in this process."""
    model = _build(config_name)
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    first_grads = {}

    def record_grads():
        first_grads.update({name: param.grad.clone() for name, param in model.named_parameters()})

    ids = _token_ids()
    losses = _train(model, ids, ids[:, 1:].numel(), on_first_backward=record_grads)
    return dict(initial=initial, first_grads=first_grads, losses=losses, final=model.state_dict())


def _max_difference(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> dict[str, float]:
    assert left.keys() == right.keys()
    return {name: (left[name].float() - right[name].float()).abs().max().item() for name in left}


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("run_name", ["fp32", "hybrid-fp32"])
@pytest.mark.heavy
def test_sharded_training_matches_unsharded(sharded, reference, config_name, run_name):
    observed = sharded[0][run_name]
    assert observed["losses"] == pytest.approx(reference["losses"], abs=FP32_TOLERANCE)
    grad_differences = _max_difference(observed["first_full_grads"], reference["first_grads"])
    assert max(grad_differences.values()) < 1e-6, grad_differences
    differences = _max_difference(observed["final_full"], reference["final"])
    assert max(differences.values()) < FP32_TOLERANCE, differences
    # Every parameter did move, so the comparison means something.
    moved = _max_difference(reference["final"], reference["initial"])
    assert min(moved.values()) > LEARNING_RATE, moved


def test_bf16_compute_with_fp32_grads_and_master_weights(sharded, reference):
    for per_rank in sharded:
        observed = per_rank["bf16"]
        assert set(observed["forward_dtypes"].values()) <= {"torch.bfloat16", "Tensor:torch.bfloat16"}
        assert observed["forward_dtypes"]["q_proj.weight as read in forward"] == "Tensor:torch.bfloat16"
        assert observed["forward_dtypes"]["logits"] == "torch.bfloat16"
        assert all(dtype == "torch.float32" for dtype in observed["master_dtypes"].values())
        for name, (grad_type, grad_dtype, grad_placements) in observed["grads"].items():
            assert (grad_type, grad_dtype) == ("DTensor", "torch.float32"), name
            assert grad_placements == observed["layout"][name][2], name
        assert all(value.dtype == torch.float32 for value in observed["final_full"].values())

    observed = sharded[0]["bf16"]
    assert observed["losses"] == pytest.approx(reference["losses"], abs=1e-2)
    # Adam's normalised steps amplify bf16 noise in near-zero gradients, so compare the whole update's direction
    # and size rather than each element.
    for name, final in reference["final"].items():
        reference_update = (final - reference["initial"][name]).flatten()
        bf16_update = (observed["final_full"][name] - reference["initial"][name]).flatten()
        cosine = F.cosine_similarity(reference_update, bf16_update, dim=0).item()
        assert cosine > 0.98, (name, cosine)
        assert bf16_update.norm() == pytest.approx(reference_update.norm().item(), rel=0.05), name


@pytest.mark.heavy
def test_fp32_run_computes_in_fp32(sharded):
    observed = sharded[0]["fp32"]
    assert set(observed["forward_dtypes"].values()) <= {"torch.float32", "Tensor:torch.float32"}
    assert all(grad_dtype == "torch.float32" for _, grad_dtype, _ in observed["grads"].values())


def test_state_dict_holds_local_shards_under_unsharded_names(sharded, reference):
    full_shapes = {name: tuple(value.shape) for name, value in reference["initial"].items()}
    for per_rank in sharded:
        observed = per_rank["fp32"]
        assert list(observed["layout"]) == observed["unsharded_names"] == list(full_shapes)
        for name, (value_type, _, placements) in observed["layout"].items():
            assert value_type == "DTensor", name
            assert placements == ["Shard(dim=0)"], name
    for name, full_shape in full_shapes.items():
        local_shapes = [per_rank["fp32"]["layout"][name][1] for per_rank in sharded]
        assert sum(shape[0] for shape in local_shapes) == full_shape[0], name
        assert all(shape[1:] == full_shape[1:] for shape in local_shapes), name
    embedding_rows = [per_rank["fp32"]["layout"]["model.embed_tokens.weight"][1][0] for per_rank in sharded]
    assert embedding_rows == [49, 48]


def test_hybrid_mesh_places_replicate_then_shard(sharded):
    """replicate=2 on 2 ranks: a (2, 1) mesh, so each rank holds the whole tensor and gradients are all-reduced."""
    for per_rank in sharded:
        observed = per_rank["hybrid-fp32"]
        for name, (_, local_shape, placements) in observed["layout"].items():
            assert placements == ["Replicate()", "Shard(dim=0)"], name
            assert local_shape == tuple(observed["initial_full"][name].shape), name
            assert observed["grads"][name][2] == placements, name


def test_full_tensors_equal_unsharded_weights(sharded, reference):
    for per_rank in sharded:
        for run_name in RUNS:
            observed = per_rank[run_name]
            assert _max_difference(observed["initial_full"], reference["initial"]) == {
                name: 0.0 for name in reference["initial"]
            }
            assert all(type(value) is torch.Tensor for value in observed["initial_full"].values())


def test_gathering_disabled_exposes_shards(sharded):
    """Inside gathering_disabled() the attribute is the stored shard; outside it is the gathered full weight."""
    for per_rank, local_rows in zip(sharded, (49, 48)):
        observed = per_rank["fp32"]
        assert observed["disabled_view"] == ("DTensor", (local_rows, 64))
        assert observed["gathered_view"] == ("Tensor", (97, 64), "torch.float32")


def test_float_inputs_are_cast_and_disabled_gathering_writes_shards(sharded):
    for per_rank in sharded:
        observed = per_rank["plain_module"]
        assert observed["output_dtype"] == "torch.bfloat16"
        assert torch.equal(observed["weight_after_fill"], torch.full((3, 5), 0.5))


def test_activation_checkpointing_regathers_in_backward_on_two_ranks(sharded):
    """With checkpointed layers backward re-runs each layer, whose weight reads all-gather again (real collectives
    here), so autograd keeps no gathered layer weight; the numbers do not change."""
    for per_rank in sharded:
        keep, recompute = per_rank["activation_checkpointing"]["keep"], per_rank["activation_checkpointing"]["recompute"]
        assert keep["backward_gathers"] == keep["backward_all_gather_collectives"] == 0
        assert recompute["backward_gathers"] == recompute["backward_all_gather_collectives"] == recompute["layer_params"]
        assert keep["forward_gathers"] == recompute["forward_gathers"]
        assert keep["saved_layer_weights"] and not recompute["saved_layer_weights"]
        assert recompute["saved_bytes"] < keep["saved_bytes"] / 2
        assert recompute["losses"] == pytest.approx(keep["losses"], abs=1e-6)
        differences = _max_difference(recompute["final_full"], keep["final_full"])
        assert max(differences.values()) < 1e-6, differences


def test_activation_checkpointing_keeps_no_gathered_layer_weight_for_backward(monkeypatch):
    """A mesh of one with bf16 compute: every weight read makes a full bf16 copy. Without checkpointing autograd
    saves the copies of every layer weight until backward; with it none, because backward gathers them again."""
    init_distributed("gloo", 0, 1, "127.0.0.1", find_free_port(), timeout_s=60)
    try:
        observed = {}
        for recompute in (False, True):
            model = _build("llama-gqa-untied")
            full_shapes = {name: tuple(value.shape) for name, value in model.state_dict().items()}
            shard_model(model, make_mesh(1, "cpu"), MixedPrecision(param_dtype=torch.bfloat16))
            model.model.activation_checkpointing = recompute
            observed[recompute] = _observe_one_step(model, full_shapes, torch.bfloat16)
    finally:
        destroy_distributed()
    keep, recompute = observed[False], observed[True]
    layer_shapes = {shape for name, shape in full_shapes.items() if ".layers." in name and len(shape) == 2}
    assert {shape if shape in layer_shapes else shape[::-1] for shape in keep["saved_layer_weights"]} == layer_shapes
    assert recompute["saved_layer_weights"] == []
    assert keep["backward_gathers"] == 0 and recompute["backward_gathers"] == recompute["layer_params"] == 18
    assert recompute["saved_bytes"] < keep["saved_bytes"] / 2, (recompute["saved_bytes"], keep["saved_bytes"])
    # The output projection is outside the checkpointed layers: one gathered unit, kept until its backward.
    assert keep["saved_output_projection"] and recompute["saved_output_projection"]


def test_make_mesh_rejects_a_replicate_factor_that_does_not_divide_the_world():
    with pytest.raises(ValueError, match="world_size=4.*replicate=3"):
        make_mesh(4, replicate=3)


def test_destroy_distributed_without_a_group_is_a_no_op():
    destroy_distributed()


def test_find_free_port_returns_a_bindable_port():
    import socket

    port = find_free_port()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_gloo_group_runs_its_collectives_on_one_worker_thread():
    """With gloo's default two worker threads, the collectives that inductor's code for the sharded step keeps in
    flight together ran concurrently and corrupted the heap of a 2-rank 12-layer run (see rlpipe/parallel/mesh.py);
    the learner's group is built with one worker thread, and ProcessGroupGloo itself is left as it was."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from rlpipe.parallel.mesh import GLOO_WORKER_THREADS

    gloo_class = distributed_c10d.ProcessGroupGloo
    init_distributed("gloo", 0, 1, "127.0.0.1", find_free_port(), timeout_s=30)
    try:
        group = distributed_c10d._get_default_group()
        gloo = group._get_backend(torch.device("cpu"))
        assert isinstance(gloo, gloo_class)
        assert gloo.options._threads == GLOO_WORKER_THREADS == 1
        assert gloo.options._timeout.total_seconds() == 30
        values = torch.arange(4.0)
        dist.all_reduce(values)
        torch.testing.assert_close(values, torch.arange(4.0))
    finally:
        destroy_distributed()
    assert distributed_c10d.ProcessGroupGloo is gloo_class
