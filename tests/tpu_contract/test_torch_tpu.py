"""rlpipe's learner side against the installed torch-tpu on a host without a TPU: the availability check answers
instead of raising, and the compile backend rlpipe's device table names is registered."""

from __future__ import annotations

import torch


def test_the_tpu_device_is_reported_unavailable_without_raising():
    from rlpipe.device import device_unavailable

    assert device_unavailable("tpu") == "torch_tpu finds no TPU on this host"


def test_the_device_tables_tpu_row_names_what_torch_tpu_registers():
    import torch._dynamo
    import torch_tpu  # noqa: F401

    from rlpipe.device import backend

    row = backend("tpu")
    assert row.compile_backend in torch._dynamo.list_backends(exclude_tags=())
    assert (row.torch_device, row.dist_backend) == ("tpu", "tpu_dist")  # registered on a TPU host only



def test_learner_ranks_get_what_torch_tpus_own_launch_helper_derives():
    """`torch.tpu.distributed.set_tpu_launch_env` (what a torchrun user calls) run for host 1 of two 4-chip hosts,
    against the environment rlpipe gives that host's ranks."""
    import json
    import os
    import subprocess
    import sys

    from rlpipe.device import torchtpu_process_env

    hosts = ["10.0.0.1", "10.0.0.2"]
    script = (
        "import json, os, torch, torch_tpu\n"
        "from torch.tpu import distributed\n"
        "distributed.set_tpu_launch_env(nproc_per_node=4)\n"
        "print('ENV', json.dumps(dict(os.environ)))\n"
    )
    env = {**os.environ, "TPU_WORKER_HOSTNAMES": ",".join(hosts), "JOB_COMPLETION_INDEX": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ENV ")]
    assert lines, done.stderr[-3000:]
    theirs = json.loads(lines[-1][4:])
    for chip in range(4):
        ours = torchtpu_process_env(hosts, 4, worker_index=1, local_chip=chip)
        for key in ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "NNODES", "NODE_RANK", "MASTER_ADDR", "TPU_WORKER_HOSTNAMES"):
            assert ours[key] == theirs[key], key
