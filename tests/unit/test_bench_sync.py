"""`rlpipe bench sync` rows: the first sync apart from the steady state (the timings themselves are not tested)."""

import pytest

from rlpipe.bench.sync import format_in_run, format_row, in_run_summary, sync_row


def _sync(seconds: float, memcpy: float, streaming: float | None = None) -> dict:
    return {"s": seconds, "memcpy_gbps": memcpy, "streaming_copy_gbps": streaming, "receiver_busy_s": 0.0,
            "release_s": 0.0, "sender_faults": 0, "receiver_faults": 0}


def test_the_first_sync_is_reported_apart_and_each_sync_against_the_memcpy_measured_before_it():
    # 1 GB: 2 s first, then 0.1 s at 20 GB/s memcpy, 0.2 s at 10 GB/s, 0.125 s at 16 GB/s (all 50 %).
    syncs = [_sync(2.0, 20.0), _sync(0.1, 20.0, 25.0), _sync(0.2, 10.0, 10.0), _sync(0.125, 16.0, 8.0)]
    row = sync_row("smollm2-135m", 1, "shm", 10**9, syncs)
    assert row["first_s"] == 2.0 and row["first_pct_memcpy"] == pytest.approx(2.5)
    assert row["steady_s"] == 0.125  # the median of the syncs after the first
    # Paired with the copy measured just before each sync, the steady share does not move with the machine's speed.
    assert row["steady_pct_memcpy"] == pytest.approx(50.0)
    assert row["steady_pct_streaming_copy"] == pytest.approx(50.0)  # median of 40, 50, 100
    assert [sync["pct_memcpy"] for sync in row["syncs"][1:]] == pytest.approx([50.0, 50.0, 50.0])
    assert "first  2.00 s" in format_row(row) and "steady  0.12 s" in format_row(row)


def test_a_single_sync_has_no_steady_state():
    row = sync_row("smollm2-135m", 2, "ray", 10**9, [_sync(1.0, 10.0)])
    assert row["steady_s"] is None and row["steady_pct_memcpy"] is None
    assert "steady    -" in format_row(row)


def test_a_runs_syncs_are_its_first_steps_and_the_median_of_the_later_ones():
    def step(transfer: float, write: float, phase: float) -> dict:
        return {"sync/transfer_s": transfer, "sync/write_s": write, "time/sync": phase, "time/step": 9.0}

    steps = [step(0.3, 0.9, 1.5), {"time/step": 5.0}, step(0.1, 0.5, 0.8), step(0.2, 0.4, 0.7), step(0.1, 0.6, 0.9)]
    run = in_run_summary(steps, {"sync/transfer_s": 1.2, "sync/write_s": 3.0})
    assert run["rehearsal"] == {"transfer_s": 1.2, "write_s": 3.0}
    assert run["first_step"] == {"transfer_s": 0.3, "write_s": 0.9, "transfer_write_s": pytest.approx(1.2), "sync_s": 1.5}
    # A step that trained on nothing did not sync and is left out; the medians are over the three after the first.
    assert run["steady"] == pytest.approx({"transfer_s": 0.1, "write_s": 0.5, "transfer_write_s": 0.6, "sync_s": 0.8})
    assert len(run["steps"]) == 4


def test_a_runs_probe_times_are_kept_where_its_steps_have_them():
    steps = [{"sync/transfer_s": 0.1, "sync/write_s": 0.2, "sync/probe_s": 0.3, "sync/reference_s": 0.4,
              "time/sync": 1.1} for _ in range(3)]
    run = in_run_summary(steps, {"sync/transfer_s": 1.2, "sync/write_s": 3.0})
    assert run["steady"] == pytest.approx({"transfer_s": 0.1, "write_s": 0.2, "transfer_write_s": 0.3,
                                           "probe_s": 0.3, "reference_s": 0.4, "sync_s": 1.1})
    run.update(transport="shm", round=1)
    assert "engine's probe 0.300 s, learner's probe 0.400 s" in format_in_run(run)


def test_the_benchs_first_sync_is_committed_as_a_runs_rehearsal_so_the_next_version_finds_its_memory_ready():
    """A run's first sync is the start-up rehearsal, after which the engine holds memory for the next version, laid
    out and written once; the bench's first sync does the same, so its steady state is a training step's (version 2
    does not fault in a fresh copy of the weights)."""
    from rlpipe.bench.sync import commit_as_a_run_does
    from rlpipe.weightsync import WeightReceiver, make_transport, plan_sync, stream_parts
    from tests.unit.test_weightsync import KEY, _full_tensors, _hf_shapes, _layout, _local_shards

    shapes = _hf_shapes(kv_heads=2)
    plan = plan_sync(shapes, 1, _layout(1, 2), 30_000)
    sender = make_transport("shm")
    receiver = WeightReceiver(make_transport("shm"), write=lambda weights: None,
                              probe=lambda tokens: [0.0] * len(tokens), initial_weights=dict, tolerance=0.0,
                              exact=True)
    try:
        for version in (1, 2):
            receiver.begin(plan, version, KEY)
            for part in stream_parts(plan, 0, _local_shards(_full_tensors(shapes, seed=version), 0, 1), sender,
                                     version, KEY):
                receiver.receive(version, part.bucket, part.rank, part.handle, part.nbytes, part.checksum)
                part.deliver()
            sender.release()
            if version == 1:
                commit_as_a_run_does(receiver, version)
                ready = {name: tensor.data_ptr() for name, tensor in receiver._spare_owned.items()}
                assert set(ready) == set(shapes)
        staged_into = {name: tensor.data_ptr() for name, tensor in receiver._staging.owned.items()}
        assert staged_into == ready  # version 2 is staged into the memory the rehearsal made ready
        commit_as_a_run_does(receiver, 2)
        assert receiver.policy_version == 2
    finally:
        receiver.close()
        sender.close()
