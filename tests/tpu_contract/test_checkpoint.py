"""A TorchTPU learner's checkpoint on its own process group: torch.distributed.checkpoint plans a save and a load with
object collectives (all_gather_object, broadcast_object), which torch sends to the default group's cpu backend where
it has one, else to its only backend. Two real processes join the group as a learner rank does (rlpipe's
`init_distributed` with the tpu row's backend string), each saving and loading its shards of a sharded state through
rlpipe's checkpoint code. Without a chip, `tpu_dist` stands in as torch's fake process group, which answers every
collective without moving a byte: a plan routed through it is garbage, so the save or the load fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from rlpipe.hardware.device import backend
from rlpipe.parallel.mesh import find_free_port

_RANK = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.distributed_c10d import _get_object_coll_device
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import _create_fake_pg

    from rlpipe.training.checkpoint import load_tensors, single_process_dcp
    from rlpipe.hardware.device import backend
    from rlpipe.parallel.mesh import destroy_distributed, init_distributed, make_mesh

    rank, port, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.utils.rename_privateuse1_backend("tpu")  # the device torch_tpu names its chips
    dist.Backend.register_backend("tpu_dist", _create_fake_pg, extended_api=True, devices=["tpu"])
    init_distributed(backend("tpu").dist_backend, rank, 2, "127.0.0.1", port, timeout_s=120)
    print("OBJECTS ON", _get_object_coll_device(), flush=True)
    mesh = make_mesh(2, "cpu")  # the learner's mesh is on `tpu`; its shards' bytes are beside the point here

    def state(fill):
        rows = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)[rank * 2:rank * 2 + 2] if fill else None
        local = rows if fill else torch.zeros(2, 3)
        return {"model.w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
                "optim.step": torch.tensor(7 if fill else 0), "learner.policy_version": torch.tensor(3 if fill else 0)}

    with single_process_dcp(False):  # as TrainEngine.save_checkpoint writes it
        dcp.save(state(True), checkpoint_id=directory)
    loaded = state(False)
    load_tensors(loaded, directory, "this model")
    expected = state(True)
    assert torch.equal(loaded["model.w"].to_local(), expected["model.w"].to_local())
    assert int(loaded["optim.step"]) == 7 and int(loaded["learner.policy_version"]) == 3
    destroy_distributed()
    print("RANK OK", rank, flush=True)
""")


def test_a_tpu_learners_checkpoint_saves_and_loads_on_its_process_group(tmp_path):
    spec = backend("tpu").dist_backend
    assert dict(pair.split(":") for pair in spec.split(",")) == {"cpu": "gloo", "tpu": "tpu_dist"}
    port = find_free_port()
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp_path))}
    ranks = [
        subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(port), str(tmp_path / "step")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    outputs = []
    for rank in ranks:
        try:
            outputs.append(rank.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:  # a rank left waiting on a collective its peer never joined
            rank.kill()
            outputs.append(rank.communicate()[0] + "\n(timed out)")
    for rank, output in enumerate(outputs):
        assert f"RANK OK {rank}" in output, output[-3000:]
        assert "OBJECTS ON cpu" in output
