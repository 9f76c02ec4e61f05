"""The weight-sync plan, bucket codec and transports; the plan checked against vLLM's own fused TP layers."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import re
import signal
import uuid

import numpy as np
import pytest
import torch

from rlpipe.weightsync import codec, native
from rlpipe.parallel.mesh import find_free_port
from rlpipe.weightsync import (
    EngineLayout,
    NonFiniteWeights,
    Staging,
    SyncError,
    checksum,
    make_transport,
    pack_part,
    plan_sync,
    shard_rows,
    stream_parts,
)
from rlpipe.weightsync.transport import SegmentHandle, SegmentNames
from tests.conftest import MACHINE_WIDE
from tests.unit.engine_tensors import engine_tensors
from tests.unit.foreign_files import NOBODY, another_user, make_as_nobody, make_open_to_all, untouched


# The secret the tests' checksums are keyed with (a run draws its own: codec.new_sync_key); fixed, so that processes
# the tests start agree on it.
KEY = bytes(range(16))


def _part_checksum(bucket, rank: int, buffer: np.ndarray, version: int) -> int:
    """The checksum of `rank`'s part of `bucket`, hashed afresh from the packed bytes."""
    hasher = codec.PartHash.of_part(version, bucket, rank, KEY)
    data = buffer.reshape(-1).view(np.uint8)
    for piece in bucket.parts[rank]:
        hasher.update(data[piece.offset : piece.offset + piece.nbytes], piece.offset)
    return hasher.digest()

HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 64, 4, 16, 96, 100


def _hf_shapes(kv_heads: int, tied: bool = False) -> dict[str, tuple[int, ...]]:
    prefix = "model.layers.0"
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        f"{prefix}.input_layernorm.weight": (HIDDEN,),
        f"{prefix}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": (kv_heads * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.v_proj.weight": (kv_heads * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        "model.norm.weight": (HIDDEN,),
    }
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def _layout(tp: int, kv_heads: int, dtype: str = "float32", tied: bool = False) -> EngineLayout:
    config = {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": kv_heads,
        "hidden_size": HIDDEN,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE,
        "vocab_size": VOCAB,
        "tie_word_embeddings": tied,
    }
    return EngineLayout.from_hf_config(config, tp, dtype)


def _full_tensors(shapes, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _local_shards(full: dict[str, torch.Tensor], rank: int, ranks: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in full.items():
        start, stop = shard_rows(tensor.shape[0], rank, ranks)
        out[name] = tensor[start:stop]
    return out


# ---------------------------------------------------------------- plan


@pytest.mark.parametrize("rows", [0, 1, 5, 7, 8, 97])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_shard_rows_follow_torch_chunk(rows, ranks):
    chunks = torch.arange(rows).chunk(ranks) if rows else []
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]
    got = [shard_rows(rows, rank, ranks) for rank in range(ranks)]
    assert [r for r in got if r[1] > r[0]] == expected


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_plan_covers_every_row_once_and_respects_the_bucket_budget(ranks):
    shapes = _hf_shapes(kv_heads=2)
    budget = 40_000
    plan = plan_sync(shapes, ranks, _layout(1, 2), budget)
    covered: dict[str, list[tuple[int, int]]] = {name: [] for name in shapes}
    for bucket in plan.buckets:
        sizes = [int(np.prod(shapes[name])) * 4 for name in bucket.names]
        assert sum(sizes) <= budget or len(bucket.names) == 1  # only a tensor larger than a bucket fills one alone
        for rank in range(ranks):
            offset = 0
            for piece in bucket.parts[rank]:
                assert piece.offset == offset and piece.name in bucket.names
                assert piece.nbytes == (piece.stop - piece.start) * int(np.prod(shapes[piece.name][1:])) * 4
                assert (piece.start, piece.stop) == shard_rows(shapes[piece.name][0], rank, ranks)
                covered[piece.name].append((piece.start, piece.stop))
                offset += piece.nbytes
    for name, spans in covered.items():
        rows = sorted(spans)
        assert rows[0][0] == 0 and rows[-1][1] == shapes[name][0]
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    assert plan.nbytes == sum(int(np.prod(s)) * 4 for s in shapes.values())


def test_the_first_and_last_buckets_are_short_and_tensors_larger_than_a_bucket_travel_between():
    # The pipeline fills while the first bucket is packed and drains while the last is checked.
    shapes = _hf_shapes(kv_heads=2)
    sizes = {name: int(np.prod(shape)) * 4 for name, shape in shapes.items()}
    budget = max(sizes[name] for name in shapes if "embed" not in name and "lm_head" not in name)
    assert sizes["model.embed_tokens.weight"] > budget  # embedding and output layer fill a bucket each
    plan = plan_sync(shapes, 1, _layout(1, 2), budget)
    first, last = plan.buckets[0], plan.buckets[-1]
    for bucket in (first, last):
        assert sum(sizes[name] for name in bucket.names) <= budget // 4 or len(bucket.names) == 1
    ends = set(first.names) | set(last.names)
    assert not ends & {"model.embed_tokens.weight", "lm_head.weight"}
    assert sorted(name for bucket in plan.buckets for name in bucket.names) == sorted(shapes)


def test_plan_uses_the_rollout_dtype_and_skips_a_tied_output_layer():
    shapes = _hf_shapes(kv_heads=2)  # the learner may carry lm_head even when the engine ties it
    plan = plan_sync(shapes, 2, _layout(1, 2, "bfloat16", tied=True), 1 << 20)
    assert "lm_head.weight" not in plan.shapes
    assert plan.nbytes == sum(int(np.prod(s)) * 2 for name, s in shapes.items() if name != "lm_head.weight")


def test_plan_rejects_an_empty_bucket_budget():
    with pytest.raises(ValueError, match="bucket size"):
        plan_sync(_hf_shapes(2), 1, _layout(1, 2), 0)


def _tp_worker(rank: int, world: int, port: int, kv_heads: int, results) -> None:
    """Build vLLM's own parallel layers at tensor-parallel rank `rank` and load the HF tensors through their
    weight loaders, as the engine does; report the local parameters."""
    import os

    os.environ["VLLM_DIST_IDENT"] = str(port)  # vLLM's CPU worker names its shared-memory group after this
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(
                world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank,
                backend="gloo",
            )
            initialize_model_parallel(tensor_model_parallel_size=world)
            f32 = {"params_dtype": torch.float32}
            layers = {
                "model.layers.0.self_attn.qkv_proj": QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, kv_heads, bias=False, **f32),
                "model.layers.0.self_attn.o_proj": RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False, **f32),
                "model.layers.0.mlp.gate_up_proj": MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, bias=False, **f32),
                "model.layers.0.mlp.down_proj": RowParallelLinear(INTERMEDIATE, HIDDEN, bias=False, **f32),
                "model.embed_tokens": VocabParallelEmbedding(VOCAB, HIDDEN, **f32),
                "lm_head": ParallelLMHead(VOCAB, HIDDEN, **f32),
            }
            shard_ids = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
            for name, tensor in _full_tensors(_hf_shapes(kv_heads)).items():
                module_path, _, _ = name.rpartition(".")
                parent, _, module = module_path.rpartition(".")
                if module in shard_ids:
                    fused, shard_id = shard_ids[module]
                    param = layers[f"{parent}.{fused}"].weight
                    param.weight_loader(param, tensor, shard_id)
                elif module_path in layers:
                    param = layers[module_path].weight
                    param.weight_loader(param, tensor)
            results.put((rank, {f"{path}.weight": layer.weight.detach().numpy().copy() for path, layer in layers.items()}))
    except Exception as err:  # reported by the parent
        results.put((rank, repr(err)))


@pytest.mark.parametrize("tp,kv_heads", [(1, 2), (2, 2), (2, 1)])
@pytest.mark.heavy
def test_plan_destinations_match_vllm_parallel_layers(tp, kv_heads):
    """The plan's placement of every HF row equals what vLLM's fused, tensor-parallel layers hold after loading
    the same tensors (T=2 with kv_heads=1 replicates the kv head on both ranks)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    procs = [context.Process(target=_tp_worker, args=(r, tp, port, kv_heads, results)) for r in range(tp)]
    for proc in procs:
        proc.start()
    local: dict[int, dict] = {}
    try:
        while len(local) < tp:
            rank, value = results.get(timeout=240)
            assert not isinstance(value, str), value
            local[rank] = value
    except queue_module.Empty:
        pytest.fail(f"vLLM layer workers did not report; exit codes {[p.exitcode for p in procs]}")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            proc.kill()

    full = _full_tensors(_hf_shapes(kv_heads))
    plan = plan_sync(_hf_shapes(kv_heads), 1, _layout(tp, kv_heads), 1 << 20)
    checked: dict[tuple[int, str], int] = {}
    for name, dests in plan.destinations.items():
        if name.endswith("norm.weight"):
            continue  # replicated whole; no parallel layer in this test
        assert sorted(d.tp_rank for d in dests) == list(range(tp))
        for dest in dests:
            engine_param = torch.from_numpy(local[dest.tp_rank][dest.param])
            got = engine_param.narrow(dest.dim, dest.dst_start, dest.dst_stop - dest.dst_start)
            want = full[name].narrow(dest.dim, dest.src_start, dest.src_stop - dest.src_start)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} -> {dest}")
            key = (dest.tp_rank, dest.param)
            checked[key] = checked.get(key, 0) + (dest.dst_stop - dest.dst_start)
    # The destinations fill every engine parameter (up to vLLM's vocabulary padding rows) ...
    for (rank, param), filled in checked.items():
        shape = local[rank][param].shape
        dim = 1 if param.endswith(("o_proj.weight", "down_proj.weight")) else 0
        padding = shape[0] - filled if param in ("model.embed_tokens.weight", "lm_head.weight") else 0
        assert filled + padding == shape[dim], (param, filled, shape)
    # ... and the engine tensors built from them are vLLM's parameters, per rank and as global sharded arrays.
    global_params = engine_tensors(plan, full)
    for rank in range(tp):
        built = engine_tensors(plan, full, tp_rank=rank)
        for param, value in local[rank].items():
            assert tuple(built[param].shape) == value.shape, param
            rows = value.shape[0]  # vLLM leaves vocabulary padding rows uninitialised: compare the real ones
            if param in ("model.embed_tokens.weight", "lm_head.weight"):
                rows = min(rows, VOCAB - rank * rows)
            torch.testing.assert_close(built[param][:rows], torch.from_numpy(value)[:rows], rtol=0, atol=0)
    for param in local[0]:
        dim = 1 if param.endswith(("o_proj.weight", "down_proj.weight")) else 0
        blocks = [engine_tensors(plan, full, tp_rank=rank)[param] for rank in range(tp)]
        torch.testing.assert_close(global_params[param], torch.cat(blocks, dim), rtol=0, atol=0)
    torch.testing.assert_close(global_params["model.norm.weight"], full["model.norm.weight"], rtol=0, atol=0)


# ---------------------------------------------------------------- codec


def test_checksum_notices_any_changed_word_and_length():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=4099, dtype=np.uint8)  # not a multiple of 8: the tail counts too
    reference = checksum(data)
    for position in [0, 7, 8, 2048, 4095, 4098]:
        changed = data.copy()
        changed[position] ^= 0x10
        assert checksum(changed) != reference, position
    assert checksum(data[:-1]) != reference
    assert checksum(np.zeros(16, np.uint8)) != checksum(np.zeros(8, np.uint8))


@pytest.mark.parametrize(
    "chunk_bytes, dtype, use_native",
    [(6, "bfloat16", False), (10, "bfloat16", True), (1 << 20, "bfloat16", False),
     (6, "float32", False), (1 << 20, "float32", False), (1 << 20, "float32", True)],
)
def test_packing_takes_the_checksum_of_exactly_the_bytes_it_wrote(monkeypatch, chunk_bytes, dtype, use_native):
    # The checksum is hashed chunk by chunk as the buffer fills (chunks of 6 or 10 bytes round to one word), and the
    # result must still be the checksum of the finished part, whose pieces (3 ranks' rows) end off the word grid.
    # bfloat16 casts; float32 is the plain-copy path.
    monkeypatch.setattr(codec, "CHUNK_BYTES", chunk_bytes)
    if use_native:
        assert native.copy_hash() is not None, "no C compiler for the native copy-and-hash loop"
    else:
        monkeypatch.setattr(native, "copy_hash", lambda: None)
    shapes = _hf_shapes(kv_heads=2)
    full = _full_tensors(shapes)
    plan = plan_sync(shapes, 3, _layout(1, 2, dtype), 30_000)
    for rank in range(3):
        local = _local_shards(full, rank, 3)
        for bucket in plan.buckets:
            buffer = np.full(bucket.part_bytes(rank), 0xAB, dtype=np.uint8)
            digest = pack_part(bucket, rank, local, plan.torch_dtype, buffer, version=5, key=KEY)
            assert digest == _part_checksum(bucket, rank, buffer, version=5)
            for piece in bucket.parts[rank]:
                packed = torch.from_numpy(buffer[piece.offset : piece.offset + piece.nbytes]).view(plan.torch_dtype)
                assert torch.equal(packed, local[piece.name].to(plan.torch_dtype).reshape(-1)), piece.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_native_loop_copies_exactly_hashes_as_numpy_does_and_finds_every_nan_and_inf(dtype):
    # Every alignment case of the C loop: heads and tails off the 64-byte grid, empty and one-value spans, a
    # destination off the words' grid (stored through the cache), a long body; a bad value in the head, the body
    # and the tail. Its word sum is numpy's, copying or not, wherever the span lies in its part.
    copy_hash = native.copy_hash()
    assert copy_hash is not None, "no C compiler for the native copy-and-hash loop"
    exponent = codec._EXPONENT_BITS[dtype]
    size = dtype.itemsize
    values = torch.linspace(-100, 100, (1 << 16) + 40, dtype=torch.float32).to(dtype)
    source_block = values.view(torch.uint8).numpy()
    for count in [0, 1, 3, 16, 17, 64, 1000, 1 << 16]:
        for target_shift in [0, size, 3 * size, 8, 1]:
            source = source_block[: count * size]
            target_block = np.zeros(count * size + 80, dtype=np.uint8)
            target = target_block[target_shift : target_shift + count * size]
            position = 8 * (count + target_shift)
            seed, step = 0xC0FFEE + count, 0x5DEECE66D + 2 * count + 1
            sums, bad = copy_hash(source, target, size, exponent, seed, step, position)
            assert not bad, (count, target_shift)
            assert sums == codec.word_sums(source, seed, step, position), (count, target_shift)
            assert copy_hash(source, None, 0, 0, seed, step, position)[0] == sums
            assert np.array_equal(target, source)
            assert not target_block[:target_shift].any() and not target_block[target_shift + count * size :].any()
            for index in sorted({0, count // 2, count - 1}) if count else []:
                for bad in [float("nan"), float("inf"), -float("inf")]:
                    broken = values[:count].clone()
                    broken[index] = bad
                    broken_bytes = broken.view(torch.uint8).numpy()
                    assert copy_hash(broken_bytes, target, size, exponent, 1, 1, 0)[1], (count, index, bad)
                    assert not copy_hash(broken_bytes, target, 0, 0, 1, 1, 0)[1]  # width 0: no check


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("whole", [False, True], ids=["parts", "whole-buckets"])
def test_parts_from_every_rank_assemble_the_full_tensors(dtype, ranks, experts, whole):
    """With experts: stacked [E, ...] tensors whose expert dimension (4) splits 2 + 2 or 2 + 2 + 0 over the ranks.
    `whole`: every rank writes its rows into one buffer per bucket, as over shared memory."""
    shapes = {**_hf_shapes(kv_heads=2), **(_moe_shapes() if experts else {})}
    full = _full_tensors(shapes)
    layout = _moe_layout(1, dtype=dtype) if experts else _layout(1, 2, dtype)
    plan = plan_sync(shapes, ranks, layout, 30_000)
    staging = Staging(plan, 1, KEY, whole_buckets=whole)
    shared = {bucket.index: np.full(bucket.nbytes, 0xAB, dtype=np.uint8) for bucket in plan.buckets}
    for rank in reversed(range(ranks)):  # arrival order does not matter
        local = _local_shards(full, rank, ranks)
        for bucket in plan.buckets:
            if not bucket.part_bytes(rank):
                continue
            buffer = shared[bucket.index] if whole else np.empty(bucket.part_bytes(rank), dtype=np.uint8)
            digest = pack_part(bucket, rank, local, plan.torch_dtype, buffer, whole_bucket=whole, version=1, key=KEY)
            staging.add(bucket.index, rank, buffer, digest)
    assembled = staging.complete()
    assert list(assembled) == list(plan.shapes)
    for name, tensor in full.items():
        torch.testing.assert_close(assembled[name], tensor.to(getattr(torch, dtype)), rtol=0, atol=0)
    # Every tensor is the engine's own copy, checked as it was copied: nothing views a transport buffer.
    assert set(staging.owned) == set(shapes)
    for buffer in shared.values():
        buffer[:] = 0
    torch.testing.assert_close(assembled[next(iter(shapes))], full[next(iter(shapes))].to(getattr(torch, dtype)),
                               rtol=0, atol=0)
    assert staging.verify() is None
    reused = Staging(plan, 2, KEY, reuse=staging.owned)
    if staging.owned:
        name = next(iter(staging.owned))
        assert reused._owned_tensor(name) is staging.owned[name]  # written over, not allocated again


def test_a_corrupt_short_or_missing_part_is_refused():
    shapes = _hf_shapes(kv_heads=2)
    full = _full_tensors(shapes)
    plan = plan_sync(shapes, 2, _layout(1, 2), 30_000)
    bucket = plan.buckets[1]
    buffer = np.empty(bucket.part_bytes(0), dtype=np.uint8)
    digest = pack_part(bucket, 0, _local_shards(full, 0, 2), torch.float32, buffer, version=3, key=KEY)
    corrupt = buffer.copy()
    corrupt[len(corrupt) // 2] ^= 1
    staging = Staging(plan, 3, KEY)
    with pytest.raises(SyncError, match="v3: bucket 1 from learner rank 0 is corrupt"):
        staging.add(1, 0, corrupt, digest)
    with pytest.raises(SyncError, match="bucket 1 from rank 0 has .* bytes, the plan says"):
        staging.add(1, 0, buffer[:-4], digest)
    staging.add(1, 0, buffer, digest)
    with pytest.raises(SyncError, match="arrived twice"):
        staging.add(1, 0, buffer, digest)
    with pytest.raises(SyncError, match="never arrived"):
        staging.complete()


def test_in_a_shared_bucket_each_ranks_rows_are_checked_on_their_own():
    shapes = _hf_shapes(kv_heads=2)
    full = _full_tensors(shapes)
    plan = plan_sync(shapes, 2, _layout(1, 2), 30_000)
    bucket = next(b for b in plan.buckets if b.part_bytes(0) and b.part_bytes(1))
    buffer = np.zeros(bucket.nbytes, dtype=np.uint8)
    digests = [pack_part(bucket, rank, _local_shards(full, rank, 2), torch.float32, buffer, whole_bucket=True,
                         version=4, key=KEY)
               for rank in range(2)]
    assert buffer.any()
    piece = bucket.parts[1][0]
    buffer[piece.bucket_offset + piece.nbytes // 2] ^= 1  # in rank 1's rows
    staging = Staging(plan, 4, KEY, whole_buckets=True)
    staging.add(bucket.index, 0, buffer, digests[0])
    with pytest.raises(SyncError, match=f"bucket {bucket.index} from learner rank 1 is corrupt"):
        staging.add(bucket.index, 1, buffer, digests[1])
    assert (bucket.index, 1) in staging.missing()  # a part that failed its check never counts as arrived


def _packed_bucket(dtype="float32", version=3, seed=0):
    """One bucket part of rank 0 of 1, packed for `version`: (plan, bucket, buffer, checksum)."""
    shapes = _hf_shapes(kv_heads=2)
    plan = plan_sync(shapes, 1, _layout(1, 2, dtype), 1 << 20)
    bucket = next(b for b in plan.buckets if "model.layers.0.self_attn.q_proj.weight" in b.names)
    buffer = np.empty(bucket.part_bytes(0), dtype=np.uint8)
    digest = pack_part(bucket, 0, _full_tensors(shapes, seed=seed), plan.torch_dtype, buffer, version=version, key=KEY)
    return plan, bucket, buffer, digest


def _piece(bucket, name):
    return next(piece for piece in bucket.parts[0] if piece.name == name)


def _refused(plan, bucket, buffer, digest, version=3, rank=0):
    with pytest.raises(SyncError, match="is corrupt"):
        Staging(plan, version, KEY).add(bucket.index, rank, buffer, digest)


def test_swapped_words_and_compensating_changes_fail_the_checksum():
    plan, bucket, buffer, digest = _packed_bucket()
    Staging(plan, 3, KEY).add(bucket.index, 0, buffer, digest)  # intact: accepted
    words = buffer.view(np.uint64)
    swapped = buffer.copy()
    swapped.view(np.uint64)[[10, 11]] = words[[11, 10]]  # two words trade places: their sum stays
    _refused(plan, bucket, swapped, digest)
    compensated = buffer.copy()
    compensated.view(np.uint64)[20] += np.uint64(1 << 40)
    compensated.view(np.uint64)[30] -= np.uint64(1 << 40)  # one word up, another down by as much
    _refused(plan, bucket, compensated, digest)


def test_swapped_chunks_of_a_q_proj_weight_fail_the_checksum():
    plan, bucket, buffer, digest = _packed_bucket("bfloat16")
    piece = _piece(bucket, "model.layers.0.self_attn.q_proj.weight")
    half = piece.nbytes // 2
    swapped = buffer.copy()
    q_proj = swapped[piece.offset : piece.offset + piece.nbytes]
    q_proj[:half], q_proj[half:] = buffer[piece.offset + half : piece.offset + piece.nbytes], buffer[piece.offset : piece.offset + half]
    assert not np.array_equal(swapped, buffer)
    _refused(plan, bucket, swapped, digest, version=3)


def test_a_bfloat16_weight_changed_to_a_huge_value_fails_the_checksum():
    plan, bucket, buffer, digest = _packed_bucket("bfloat16")
    piece = _piece(bucket, "model.layers.0.self_attn.q_proj.weight")
    corrupt = buffer.copy()
    values = torch.from_numpy(corrupt[piece.offset : piece.offset + piece.nbytes]).view(torch.bfloat16)
    values[5] = 6.4e36  # one weight of ~0.02 becomes 6.4e36: a single changed exponent
    _refused(plan, bucket, corrupt, digest)


def test_a_part_labelled_with_another_version_bucket_or_rank_fails_the_checksum():
    plan, bucket, buffer, digest = _packed_bucket(version=3)
    # The previous version's intact part, with its own checksum, replayed as version 4 (a stale buffer).
    with pytest.raises(SyncError, match="v4: bucket .* is corrupt"):
        Staging(plan, 4, KEY).add(bucket.index, 0, buffer, digest)
    # The same bytes and checksum relabelled as another bucket of the same size, or another rank's part.
    equal_plan = plan_sync({"a.weight": (8, 16), "b.weight": (8, 16)}, 2, _layout(1, 2), 8 * 16 * 4)
    first, second = equal_plan.buckets[0], equal_plan.buckets[1]
    assert first.part_bytes(0) == second.part_bytes(0) == first.part_bytes(1)
    local = _local_shards(_full_tensors({"a.weight": (8, 16), "b.weight": (8, 16)}), 0, 2)
    part = np.empty(first.part_bytes(0), dtype=np.uint8)
    first_digest = pack_part(first, 0, local, torch.float32, part, version=3, key=KEY)
    with pytest.raises(SyncError, match=f"bucket {second.index} from learner rank 0 is corrupt"):
        Staging(equal_plan, 3, KEY).add(second.index, 0, part, first_digest)
    with pytest.raises(SyncError, match=f"bucket {first.index} from learner rank 1 is corrupt"):
        Staging(equal_plan, 3, KEY).add(first.index, 1, part, first_digest)
    Staging(equal_plan, 3, KEY).add(first.index, 0, part, first_digest)  # where it belongs: accepted


_MASK64, _LOW32 = (1 << 64) - 1, (1 << 32) - 1


def _forged(part: np.ndarray, seed: int, step: int, index: int, value: float, fillers: tuple[int, ...]) -> np.ndarray:
    """`part` (float32 pieces whose words lie at their byte positions in the part) with float `index` set to `value`,
    and four filler words rewritten so that both word sums under the keys `seed` and `step` (codec.word_sums) are
    what they were: a forgery that whoever knows the keys can make."""
    def keyed(i: int) -> int:
        return (seed + 8 * i * step) & _MASK64

    def product(i: int, word: int) -> int:
        v = word ^ keyed(i)
        return (v & _LOW32) * (v >> 32)

    words = [int(w) for w in part.view("<u8")]
    total = sum(words) & _MASK64, sum(product(i, w) for i, w in enumerate(words)) & _MASK64
    forged = part.copy()
    forged.view(np.float32)[index] = value
    words = [int(w) for w in forged.view("<u8")]
    a, b, c, d = fillers
    kept = [i for i in range(len(words)) if i not in fillers]
    # a and b bring the product sum back: lo32(v) = 1 gives hi32(v); hi32(v) = 2^32 - 1 gives (2^32 - 1) lo32(v).
    times, rest = divmod((total[1] - sum(product(i, words[i]) for i in kept)) & _MASK64, _LOW32)
    assert times <= _LOW32
    words[a], words[b] = ((rest << 32) | 1) ^ keyed(a), ((_LOW32 << 32) | times) ^ keyed(b)
    # c and d, whose products are zero (lo32(v) = 0, hi32(v) = 0), bring the word sum back.
    needed = (total[0] - sum(words[i] for i in kept) - words[a] - words[b]) & _MASK64
    free = (needed - (keyed(c) & _LOW32) - ((keyed(d) >> 32) << 32)) & _MASK64
    words[c] = ((free >> 32) << 32) | (keyed(c) & _LOW32)
    words[d] = ((keyed(d) >> 32) << 32) | (free & _LOW32)
    forged.view("<u8")[list(fillers)] = np.array([words[i] for i in fillers], dtype=np.uint64)
    return forged


def test_a_weight_changed_by_someone_without_the_runs_secret_fails_the_checksum():
    # Someone who can write a staged part (shared memory open to them) sets a weight to 1000.0 and rewrites four
    # filler words so that the sums come out as before. Keyed with the run's secret, the keys of every word are
    # unknown to them, and whatever keys they assume (none, another secret), the part is refused; only with the
    # run's own keys would the same forgery pass.
    plan, bucket, buffer, digest = _packed_bucket(version=3)
    assert all(piece.offset % 8 == 0 and piece.nbytes % 8 == 0 for piece in bucket.parts[0])  # words where they lie
    fillers, index = (40, 41, 42, 43), 7
    guesses = {"the unkeyed sum": (0, codec._GOLDEN), "another secret": codec.part_keys(3, bucket.index, 0, bytes(16))}
    for assumed, (seed, step) in guesses.items():
        with pytest.raises(SyncError, match="is corrupt"):
            Staging(plan, 3, KEY).add(bucket.index, 0, _forged(buffer, seed, step, index, 1000.0, fillers), digest)
    own = _forged(buffer, *codec.part_keys(3, bucket.index, 0, KEY), index, 1000.0, fillers)
    staging = Staging(plan, 3, KEY)
    staging.add(bucket.index, 0, own, digest)  # the forgery itself is sound: the secret is what stops it
    first = bucket.parts[0][0]
    assert staging.tensors[first.name].reshape(-1)[index] == 1000.0


def test_a_checksum_key_that_is_not_sixteen_bytes_is_refused():
    plan, bucket, buffer, digest = _packed_bucket()
    for key in (b"", bytes(8), "0123456789abcdef"):
        with pytest.raises(ValueError, match="^weight sync: the checksum key must be 16 random bytes"):
            Staging(plan, 3, key)


def test_a_sender_and_an_engine_agree_whichever_has_the_native_loop(monkeypatch):
    assert native.copy_hash() is not None, "no C compiler for the native copy-and-hash loop"
    plan, bucket, native_packed, native_digest = _packed_bucket()
    with monkeypatch.context() as without_native:
        without_native.setattr(native, "copy_hash", lambda: None)
        Staging(plan, 3, KEY).add(bucket.index, 0, native_packed, native_digest)  # the engine hashes with numpy
        _, _, numpy_packed, numpy_digest = _packed_bucket()  # the sender packs with numpy
        corrupt = numpy_packed.copy()
        corrupt[100] ^= 4
        _refused(plan, bucket, corrupt, numpy_digest)
    assert numpy_digest == native_digest and np.array_equal(numpy_packed, native_packed)
    Staging(plan, 3, KEY).add(bucket.index, 0, numpy_packed, numpy_digest)
    _refused(plan, bucket, corrupt, numpy_digest)


# ---------------------------------------------------------------- the compiled loop's cache


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """RLPIPE_CACHE in a fresh folder, and copy_hash() looked up anew (it is cached per process) before and after."""
    monkeypatch.setenv("RLPIPE_CACHE", str(tmp_path / "cache"))
    native.copy_hash.cache_clear()
    yield tmp_path / "cache"
    native.copy_hash.cache_clear()


def _plant_library(path, marker) -> None:
    """What another user could put at the library's path in a shared cache: loaded, it writes `marker` (it could
    run anything as the run's user), and its copy_hash calls every value NaN."""
    import subprocess

    source = path.parent / "planted.c"
    source.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {{\n'
                      f'    FILE *file = fopen("{marker}", "w");\n    if (file) fclose(file);\n}}\n'
                      "int copy_hash(void) { return 1; }\n")
    subprocess.run([native._compiler(), "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    source.unlink()


def _hashes_as_numpy() -> None:
    source = np.arange(4096, dtype=np.uint8)
    sums, bad = native.copy_hash()(source, None, 0, 0, 7, 11, 0)  # width 0: no check for NaN
    assert (sums, bad) == (codec.word_sums(source, 7, 11, 0), False)


def test_the_cache_holds_the_library_for_this_user_alone_whatever_the_umask(private_cache):
    assert native._compiler() is not None, "no C compiler for the native copy-and-hash loop"
    old = os.umask(0o002)  # a group-writable default, as some systems set it
    try:
        _hashes_as_numpy()
    finally:
        os.umask(old)
    library = native.library_path(native._compiler())
    modes = {path: path.stat().st_mode & 0o777 for path in (private_cache, library.parent, library)}
    assert modes == {private_cache: 0o700, library.parent: 0o700, library: 0o755}
    built = library.stat().st_ino
    native.copy_hash.cache_clear()
    _hashes_as_numpy()
    assert library.stat().st_ino == built  # taken from the cache, not built again


@pytest.mark.parametrize("planted", ["another_users_library", "library_others_may_write",
                                     "folder_others_may_write", "cache_of_another_user"])
def test_a_library_another_user_could_have_put_in_the_cache_is_never_loaded(private_cache, planted):
    """The library's path is computable, so in a shared cache another user can plant one first: it is loaded only
    when it and the folders above it up to the cache's root are this user's and writable by no one else. Else the
    loop is built anew: in place where the folders are this user's own, in a private folder where they are not."""
    import warnings

    assert native._compiler() is not None, "no C compiler for the native copy-and-hash loop"
    library = native.library_path(native._compiler())
    library.parent.mkdir(parents=True, mode=0o700)
    private_cache.chmod(0o700)
    marker = private_cache.parent / "planted-library-ran"
    _plant_library(library, marker)
    changed = {
        "another_users_library": lambda: os.chown(library, 65534, 65534),
        "library_others_may_write": lambda: library.chmod(0o666),
        "folder_others_may_write": lambda: library.parent.chmod(0o777),
        "cache_of_another_user": lambda: os.chown(private_cache, 65534, 65534),
    }
    changed[planted]()
    planted_bytes = library.read_bytes()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        _hashes_as_numpy()
    assert not marker.exists(), "the planted library was loaded"
    folders_trusted = planted in ("another_users_library", "library_others_may_write")
    said = [str(w.message) for w in warned if "copy-and-hash" in str(w.message)]
    if folders_trusted:  # rebuilt in place: the cache now holds this user's library
        assert said == [] and library.read_bytes() != planted_bytes
        assert (library.stat().st_uid, library.stat().st_mode & 0o777) == (os.geteuid(), 0o755)
    else:  # left as it is; the loop built in a private folder, and said so
        problem = (f"{library.parent} is writable by others (mode 777)" if planted == "folder_others_may_write" else
                   f"{private_cache} belongs to uid 65534, not to this user (uid {os.geteuid()})")
        assert said == [f"weight sync: {problem}; the copy-and-hash loop is built in a private folder instead of "
                        "the cache"]
        assert library.read_bytes() == planted_bytes


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_never_leave_the_learner(monkeypatch, dtype, bad, use_native):
    # float32 is the plain-copy path (checked in the native loop, or by numpy), bfloat16 the casting one.
    if not use_native:
        monkeypatch.setattr(native, "copy_hash", lambda: None)
    shapes = _hf_shapes(kv_heads=2)
    plan = plan_sync(shapes, 1, _layout(1, 2, dtype), 1 << 20)
    weights = _full_tensors(shapes)
    weights["model.layers.0.mlp.down_proj.weight"].view(-1)[77] = bad
    transport = make_transport("ray")
    with pytest.raises(NonFiniteWeights, match=r"v6: model\.layers\.0\.mlp\.down_proj\.weight holds NaN or inf "
                                              r"\(element 77 of learner rank 0's rows\); the training step that "
                                              r"produced version 6 diverged"):
        for _ in stream_parts(plan, 0, weights, transport, 6, KEY):
            pass
    assert not issubclass(NonFiniteWeights, SyncError)  # a transfer fault is worth repeating; this is not


def test_the_finiteness_check_finds_the_first_bad_value_in_every_float_dtype():
    for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.float64]:
        values = torch.linspace(-3e4, 3e4, 1000, dtype=torch.float32).to(dtype)
        assert codec.first_non_finite(values.view(torch.uint8).numpy(), dtype) is None, dtype
        for bad in [float("nan"), float("inf"), -float("inf")]:
            broken = values.clone()
            broken[[613, 900]] = bad
            assert codec.first_non_finite(broken.view(torch.uint8).numpy(), dtype) == 613, (dtype, bad)


def test_a_shard_that_does_not_match_the_plan_is_refused():
    shapes = _hf_shapes(kv_heads=2)
    plan = plan_sync(shapes, 2, _layout(1, 2), 1 << 20)
    wrong = _local_shards(_full_tensors(shapes), 0, 1)  # whole tensors where rank 0 of 2 should hold half
    buffer = np.empty(plan.buckets[0].part_bytes(0), dtype=np.uint8)
    with pytest.raises(SyncError, match="rank 0 holds .* but the sync plan expects"):
        pack_part(plan.buckets[0], 0, wrong, torch.float32, buffer, key=KEY)


# ---------------------------------------------------------------- transports


def _receive_all(transport_name, parts, plan, results, connect=None):
    try:
        transport = make_transport(transport_name)
        if connect:
            transport.connect(*connect)
        staging = Staging(plan, 1, KEY, whole_buckets=transport.whole_buckets)
        for bucket, rank, handle, nbytes, digest in parts:
            with transport.receive(handle, rank, nbytes) as buffer:
                staging.add(bucket, rank, buffer, digest)
        results.put({name: t.numpy().copy() for name, t in staging.complete().items()})
    except Exception as err:
        results.put(repr(err))


def _send_over_gloo(port, plan, results):
    try:
        transport = make_transport("gloo")
        transport.connect("127.0.0.1", port, 0, 1, 2, 60)
        for part in stream_parts(plan, 0, _full_tensors(plan.shapes), transport, 1, KEY):
            part.deliver()
        results.put("sent")
    except Exception as err:
        results.put(repr(err))


@pytest.mark.parametrize("transport_name, ranks", [("shm", 1), ("shm", 2), ("gloo", 1)])
@pytest.mark.heavy
def test_transport_carries_every_bucket_to_another_process(transport_name, ranks):
    from multiprocessing import shared_memory

    shapes = _hf_shapes(kv_heads=2)
    full = _full_tensors(shapes)
    plan = plan_sync(shapes, ranks, _layout(1, 2), 30_000)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    if transport_name == "shm":
        senders = [make_transport("shm") for _ in range(ranks)]
        for sender in senders:  # every rank writes into rank 0's segments
            sender.share_buffers(senders[0].buffer_prefix())
        parts = [(p.bucket, p.rank, p.handle, p.nbytes, p.checksum)
                 for rank, sender in enumerate(senders)
                 for p in stream_parts(plan, rank, _local_shards(full, rank, ranks), sender, 1, KEY)]
        assert len({handle.name for _, _, handle, _, _ in parts}) == len(plan.buckets)  # one segment per bucket
        receiver = context.Process(target=_receive_all, args=("shm", parts, plan, results))
        receiver.start()
        received = results.get(timeout=120)
        receiver.join()
        for sender in reversed(senders):
            sender.close()
            if sender is not senders[0]:
                shared_memory.SharedMemory(name=parts[0][2].name).close()  # rank 0's segments outlive the others
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=parts[0][2].name)
    else:
        # gloo handles carry nothing: the receiver knows sizes and checksums travel beside the bytes.
        parts = []
        for bucket in plan.buckets:
            buffer = np.empty(bucket.part_bytes(0), dtype=np.uint8)
            parts.append((bucket.index, 0, None, len(buffer),
                          pack_part(bucket, 0, full, torch.float32, buffer, version=1, key=KEY)))
        port = find_free_port()
        sent = context.Queue()
        sender_proc = context.Process(target=_send_over_gloo, args=(port, plan, sent))
        receiver = context.Process(target=_receive_all, args=("gloo", parts, plan, results, ("127.0.0.1", port, 1, 1, 2, 60)))
        sender_proc.start()
        receiver.start()
        received = results.get(timeout=120)
        assert sent.get(timeout=60) == "sent"
        receiver.join()
        sender_proc.join()
    assert not isinstance(received, str), received
    for name, tensor in full.items():
        np.testing.assert_array_equal(received[name], tensor.numpy())


def test_shared_memory_alternates_two_segment_sets_and_is_freed_on_close():
    from multiprocessing import shared_memory

    transport = make_transport("shm")
    first, _ = transport.send(transport.allocate(64, bucket=0, version=1))
    transport.release()  # the version is done; its segment waits for a later one
    after_next, _ = transport.send(transport.allocate(64, bucket=0, version=3))
    next_version, _ = transport.send(transport.allocate(64, bucket=0, version=2))  # never the previous version's
    other, _ = transport.send(transport.allocate(64, bucket=1, version=1))
    assert after_next == first and len({first.name, next_version.name, other.name}) == 3
    assert first.partner == next_version.name and next_version.partner == first.name  # the bucket's other segment
    transport.close()
    for handle in (first, next_version, other):
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=handle.name)


def _mapped_and_resident(name: str) -> list[tuple[int, int]]:
    """(size, resident) in bytes of each of this process's mappings of the shared-memory segment `name`, from
    /proc/self/smaps: resident counts the pages this process has mapped (Rss), not those merely allocated."""
    mappings, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line: address range, perms, ... path
                current = fields[-1] == f"/dev/shm/{name}"
            elif current and fields[0] == "Size:":
                mappings.append([int(fields[1]) * 1024, None])
            elif current and fields[0] == "Rss:":
                mappings[-1][1] = int(fields[1]) * 1024
    return [tuple(mapping) for mapping in mappings]


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads this process's mappings from /proc")
def test_shared_memory_sets_up_both_segment_sets_once_and_faults_them_in():
    # Versions alternate two segments per bucket; both are created, and mapped page by page by every sender rank
    # and the receiver, with the first version (a rank that did not create a segment maps it when the version is
    # released), so that no later version creates, maps or faults in anything.
    shapes = _hf_shapes(kv_heads=2)
    plan = plan_sync(shapes, 2, _layout(1, 2), 30_000)
    senders = [make_transport("shm") for _ in range(2)]
    for sender in senders:
        sender.share_buffers(senders[0].buffer_prefix())
    receiver = make_transport("shm")
    handles = {}
    try:
        for version in range(1, 6):
            full = _full_tensors(shapes, seed=version)
            staging = Staging(plan, version, KEY, whole_buckets=True)
            for rank, sender in enumerate(senders):
                for part in stream_parts(plan, rank, _local_shards(full, rank, 2), sender, version, KEY):
                    handles.setdefault(version % 2, set()).add(part.handle.name)
                    with receiver.receive(part.handle, part.rank, part.nbytes) as buffer:
                        staging.add(part.bucket, part.rank, buffer, part.checksum)
            for name, tensor in staging.complete().items():
                torch.testing.assert_close(tensor, full[name], rtol=0, atol=0)
            for sender in senders:
                sender.release()
            # Two segments per bucket, each opened once per process, all with the first version.
            assert [t.segments_opened for t in (*senders, receiver)] == [2 * len(plan.buckets)] * 3
            if version == 1:
                names = [senders[0].buffer_prefix().name(bucket.index, parity)
                         for bucket in plan.buckets for parity in (0, 1)]
                for name in names:  # the next version's segments too: three mappings, every page mapped in each
                    mappings = _mapped_and_resident(name)
                    assert len(mappings) == 3 and all(size > 0 and resident == size for size, resident in mappings)
        assert set(handles) == {0, 1} and all(len(named) == len(plan.buckets) for named in handles.values())
        assert handles[0].isdisjoint(handles[1]) and handles[0] | handles[1] == set(names)
    finally:
        receiver.close()
        for sender in reversed(senders):
            sender.close()
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in names)


def test_a_dev_shm_without_room_for_the_segments_fails_with_a_clear_error(monkeypatch):
    # Writing into a segment that tmpfs has no room for raises SIGBUS; the segments get their memory up front.
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    transport = make_transport("shm")
    with pytest.raises(RuntimeError, match=r"no room in /dev/shm for segment .*\(or use sync.transport=ray\)"):
        transport.allocate(4096, bucket=0, version=1)
    name = transport.buffer_prefix().name(0, 1)
    assert os.path.exists(f"/dev/shm/{name}")
    transport.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def _segment_path(transport, bucket: int, parity: int) -> str:
    """Where the learner's segment for `bucket` and the versions of `parity` lies."""
    return f"/dev/shm/{transport.buffer_prefix().name(bucket, parity)}"


@another_user
@pytest.mark.parametrize("size", [4096, 0], ids=["sized", "empty"])
def test_a_learner_refuses_a_segment_another_user_made_under_its_name(size):
    # A neighbour who guessed the name of a bucket's segment for the next versions makes it first, open to all: the
    # learner, which would pack the weights into the neighbour's file, refuses it (an empty one too, at once).
    transport = make_transport("shm")
    ours, theirs = _segment_path(transport, 0, 1), _segment_path(transport, 0, 0)  # version 1: parity 1 first
    make_as_nobody([theirs], size)
    try:
        with pytest.raises(SyncError) as refused:
            transport.allocate(4096, bucket=0, version=1)
        assert str(refused.value) == (f"weight sync: shared-memory file {theirs} belongs to uid {NOBODY}, not to the "
                                      f"run's uid {os.geteuid()} (made by another user?); refusing to use it")
        assert untouched(theirs, size)
        transport.close()
        assert not os.path.exists(ours) and os.path.exists(theirs)  # the run's own unlinked, the other left as it is
    finally:
        os.unlink(theirs)


def test_a_learner_refuses_a_segment_open_to_group_or_others():
    transport = make_transport("shm")
    path = _segment_path(transport, 0, 1)
    make_open_to_all(path, 4096)
    try:
        expected = (f"weight sync: shared-memory file {path} has mode 0666: group or others may use it, where the "
                    "run's own files are 0600; refusing to use it")
        with pytest.raises(SyncError, match=f"^{re.escape(expected)}$"):
            transport.allocate(4096, bucket=0, version=1)
        assert untouched(path, 4096)
    finally:
        transport.close()
        os.unlink(path)


@another_user
@pytest.mark.parametrize("foreign", ["segment", "partner"])
def test_an_engine_refuses_a_segment_another_user_made(foreign):
    # A handle naming a file another user made, as the part's segment or as the bucket's segment for the next
    # versions (which the engine maps ahead): the engine maps nothing of it.
    sender, receiver = make_transport("shm"), make_transport("shm")
    theirs = SegmentNames.new().name(0, 0)
    path = f"/dev/shm/{theirs}"
    make_as_nobody([path], 4096)
    try:
        ours = sender.send(sender.allocate(4096, bucket=0, version=1))[0].name
        handle = SegmentHandle(theirs, ours) if foreign == "segment" else SegmentHandle(ours, theirs)
        with pytest.raises(SyncError, match=rf"^weight sync: shared-memory file {re.escape(path)} belongs to uid "
                                            rf"{NOBODY}, not to the run's uid {os.geteuid()}"):
            with receiver.receive(handle, 0, 4096):
                pass
        assert theirs not in receiver._attached and untouched(path, 4096)
    finally:
        receiver.close()
        sender.close()
        os.unlink(path)


def test_no_segment_name_tells_another():
    # A neighbour who sees one segment in /dev/shm cannot name the others (say, by counting bucket and parity up) to
    # make them first: every name ends in bits of its own.
    ours = f"rlpipe-{os.getpid()}-"
    before = set(os.listdir("/dev/shm"))
    transport = make_transport("shm")
    try:
        for bucket in range(3):
            transport.allocate(64, bucket=bucket, version=1)
        made = sorted(name for name in set(os.listdir("/dev/shm")) - before if name.startswith(ours))
        assert len(made) == 6
        stem = made[0].rsplit("-", 2)[0]
        assert not {f"{stem}-{bucket}-{parity}" for bucket in range(3) for parity in (0, 1)} & set(made)
        assert len({name.rsplit("-", 1)[1] for name in made}) == 6
        assert len({name.rsplit("-", 1)[0] for name in made}) == 1  # one prefix: the orphan sweep finds them all
    finally:
        transport.close()


def test_a_rank_waits_for_a_shared_segment_another_rank_is_still_sizing():
    # SharedMemory(create=True) creates the segment, then sets its size: a rank attaching in between must wait.
    import _posixshmem
    import threading

    owner = make_transport("shm")
    other = make_transport("shm")
    other.share_buffers(owner.buffer_prefix())
    name = owner.buffer_prefix().name(0, 1)
    descriptor = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    sizing = threading.Timer(0.3, os.ftruncate, (descriptor, 4096))
    sizing.start()
    try:
        buffer = other.allocate(4096, bucket=0, version=1)  # attaches once the size is there, does not fail
        assert buffer.nbytes == 4096 and other.send(buffer)[0].name == name
    finally:
        sizing.join()
        os.close(descriptor)
        other.close()
        for left in (name, owner.buffer_prefix().name(0, 0)):  # and the other parity's, which it created
            assert os.path.exists(f"/dev/shm/{left}")  # not the owner: it leaves the segments
            _posixshmem.shm_unlink("/" + left)
        owner.close()


def _allocate_and_die(names) -> None:
    transport = make_transport("shm")
    names.send(transport.send(transport.allocate(64, bucket=0, version=1))[0].name)  # sent before returning
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no resource tracker run: as when the OOM killer strikes


@MACHINE_WIDE  # its dead process's segment would otherwise be an orphan the fault-tolerance test could see
@pytest.mark.heavy
def test_segments_of_a_killed_learner_are_removed_by_the_next_one():
    from multiprocessing import shared_memory

    context = multiprocessing.get_context("spawn")
    names, child_end = context.Pipe(duplex=False)
    dead = context.Process(target=_allocate_and_die, args=(child_end,))
    dead.start()
    assert names.poll(120)
    orphan = names.recv()
    dead.join()
    assert dead.exitcode == -signal.SIGKILL
    assert os.path.exists(f"/dev/shm/{orphan}")
    transport = make_transport("shm")
    own = transport.send(transport.allocate(64, bucket=0, version=1))[0].name
    assert not os.path.exists(f"/dev/shm/{orphan}")
    assert os.path.exists(f"/dev/shm/{own}")  # a live process's segments stay
    transport.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=own)


def test_unknown_transport_names_the_key():
    with pytest.raises(ValueError, match="sync.transport: unknown transport 'nccl'"):
        make_transport("nccl")


# ---------------------------------------------------------------- mixture of experts

EXPERTS, EXPERT_INTERMEDIATE = 4, 6


def _moe_shapes() -> dict[str, tuple[int, ...]]:
    prefix = "model.layers.0.mlp"
    return {
        f"{prefix}.gate.weight": (EXPERTS, HIDDEN),
        f"{prefix}.experts.gate_up_proj": (EXPERTS, 2 * EXPERT_INTERMEDIATE, HIDDEN),
        f"{prefix}.experts.down_proj": (EXPERTS, HIDDEN, EXPERT_INTERMEDIATE),
    }


def _moe_layout(tp: int, engine_params=(), dtype: str = "float32") -> EngineLayout:
    config = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "hidden_size": HIDDEN,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": EXPERT_INTERMEDIATE,
        "vocab_size": VOCAB,
    }
    return EngineLayout.from_hf_config(config, tp, dtype, engine_params=engine_params)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_plan_maps_stacked_experts_to_vllms_fused_moe_layout(tp):
    """Each tensor-parallel rank's w13 holds its slice of every expert's gate rows, then the same slice of the up
    rows; w2 holds the same slice of the intermediate (input) columns; the router is replicated."""
    names = ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.routed_experts.w13_weight",
             "model.layers.0.mlp.experts.routed_experts.w2_weight"]
    layout = _moe_layout(tp, names)
    assert layout.expert_params == ("routed_experts.w13_weight", "routed_experts.w2_weight")
    plan = plan_sync(_moe_shapes(), 2, layout, 1 << 20)
    assert plan.engine_params() == set(names)
    full = _full_tensors(_moe_shapes())
    gate_up, down = full["model.layers.0.mlp.experts.gate_up_proj"], full["model.layers.0.mlp.experts.down_proj"]
    gate, up = gate_up[:, :EXPERT_INTERMEDIATE], gate_up[:, EXPERT_INTERMEDIATE:]
    per_rank = EXPERT_INTERMEDIATE // tp
    for rank in range(tp):
        built = engine_tensors(plan, full, tp_rank=rank)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        want_w13 = torch.cat([gate[:, mine], up[:, mine]], dim=1)
        torch.testing.assert_close(built[names[1]], want_w13, rtol=0, atol=0)
        torch.testing.assert_close(built[names[2]], down[:, :, mine], rtol=0, atol=0)
        torch.testing.assert_close(built[names[0]], full["model.layers.0.mlp.gate.weight"], rtol=0, atol=0)
    # A learner rank sends whole experts: SimpleFSDP shards the stacked tensors on the expert dimension.
    pieces = [piece for bucket in plan.buckets for piece in bucket.parts[1] if "experts" in piece.name]
    assert {(piece.start, piece.stop) for piece in pieces} == {(EXPERTS // 2, EXPERTS)}


def test_plan_names_rlpipes_own_expert_tensors_inside_vllm():
    names = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    plan = plan_sync(_moe_shapes(), 1, _moe_layout(1, names), 1 << 20)
    assert set(names) <= plan.engine_params()
    full = _full_tensors(_moe_shapes())
    built = engine_tensors(plan, full, tp_rank=0)
    for name in names:
        torch.testing.assert_close(built[name], full[name], rtol=0, atol=0)


def test_a_decoded_probe_is_compared_up_to_where_the_continuations_part():
    from rlpipe.weightsync import DecodedProbe, decoded_gaps

    learner = DecodedProbe([5, 6, 7, 8], [-0.5, -0.25, -1.0, -2.0])
    same = DecodedProbe([5, 6, 7, 8], [-0.5, -0.75, -1.0, -2.5])
    assert decoded_gaps(same, learner) == [0.0, 0.5, 0.0, 0.5]
    # Parted at the third token: it is compared (each side's top token), the context after it is not the same.
    parted = DecodedProbe([5, 6, 9, 1], [-0.5, -0.25, -1.5, -9.0])
    assert decoded_gaps(parted, learner) == [0.0, 0.0, 0.5]
    assert decoded_gaps(DecodedProbe([4, 6, 7, 8], [-3.0, -0.25, -1.0, -2.0]), learner) == [2.5]


def test_the_engine_finds_each_given_tensor_where_its_model_holds_it():
    from rlpipe.rollout.vllm_worker import _held_rows

    prefix = "model.layers.0.self_attn"
    given = {f"{prefix}.q_proj.weight": torch.randn(8, 4), f"{prefix}.k_proj.weight": torch.randn(2, 4),
             f"{prefix}.v_proj.weight": torch.randn(2, 4), "model.embed_tokens.weight": torch.randn(10, 4),
             "model.norm.weight": torch.randn(4), "model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(3, 4)}
    params = {f"{prefix}.qkv_proj.weight": torch.cat([given[f"{prefix}.{p}_proj.weight"] for p in "qkv"]),
              "model.embed_tokens.weight": torch.cat([given["model.embed_tokens.weight"], torch.zeros(6, 4)]),
              "model.norm.weight": given["model.norm.weight"].clone()}
    fused = {part: ("qkv_proj", ["q_proj", "k_proj", "v_proj"]) for part in ["q_proj", "k_proj", "v_proj"]}
    rows = {name: tensor.shape[0] for name, tensor in given.items()}
    for name, start in [(f"{prefix}.q_proj.weight", 0), (f"{prefix}.k_proj.weight", 8), (f"{prefix}.v_proj.weight", 10),
                        ("model.embed_tokens.weight", 0), ("model.norm.weight", 0)]:
        held, at = _held_rows(name, given[name], params, fused, rows)
        assert at == start and torch.equal(held, given[name]), name  # vocabulary padding rows are left out
    assert _held_rows("model.layers.0.mlp.experts.0.up_proj.weight", given["model.layers.0.mlp.experts.0.up_proj.weight"],
                      params, fused, rows) == (None, 0)  # not held as given: not compared
    assert _held_rows("model.norm.weight", given["model.norm.weight"].to(torch.bfloat16), params, fused, rows) == (None, 0)


def test_the_engines_comparison_after_a_write_is_bit_for_bit():
    from rlpipe.rollout.vllm_worker import _equal_bytes

    given = torch.randn(64, 32)
    held = torch.cat([torch.randn(8, 32), given])[8:]  # rows of a larger parameter, as a fused one holds them
    assert _equal_bytes(held, given)
    for index in (0, 777, given.numel() - 1):  # one value one ulp off, at the start, inside, at the end
        changed = given.clone()
        changed.view(-1)[index] = changed.view(-1)[index].nextafter(torch.tensor(float("inf")))
        assert not _equal_bytes(held, changed), index
    assert not _equal_bytes(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, other bits
    assert _equal_bytes(given.t(), given.t().clone())  # not contiguous: compared by value
    assert not _equal_bytes(given, given.to(torch.float64)) and not _equal_bytes(given, given[:, :31])
