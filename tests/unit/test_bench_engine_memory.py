"""bench/engine_memory.py's sampling and table (the measurements themselves are not tested)."""

import os
import subprocess
import sys

from rlpipe.bench.engine_memory import TreeSampler, format_table


def test_the_sampler_sums_the_process_tree_and_the_engines_own_shared_files(tmp_path):
    import time

    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
    prefix = f"rlpipe-{os.getpid()}-host-test-"
    path = f"/dev/shm/{prefix}x"
    try:
        with open(path, "wb") as file:
            file.write(b"\1" * (8 << 20))
        time.sleep(1.0)  # the child has its 64 MiB
        with TreeSampler(os.getpid(), prefix) as sampler:
            pass
        own = psutil.Process().memory_full_info()
        assert sampler.samples >= 2
        # Other processes' comings and goings move this process's own PSS by megabytes, so the child's share and the
        # file are checked with room to spare rather than against a second sample.
        assert sampler._shm_files() == 8 << 20  # the file counts although no process maps it
        assert sampler.peak_rss >= own.rss + (48 << 20)  # the child's 64 MiB are in the tree's sum
        assert sampler.peak_pss >= own.pss + (48 << 20) + (8 << 20)
        assert TreeSampler(os.getpid(), None)._shm_files() == 0
    finally:
        child.kill()
        child.wait()
        os.unlink(path)


def test_the_table_sets_after_against_before():
    def result(peak: float, rest: float) -> dict:
        return {"model_bytes": 10**9, "rows": [{"sync": "v2", "rest_rss": rest * 1e9, "rest_pss": rest * 1e9,
                                                "peak_rss": peak * 1e9, "peak_pss": peak * 1e9, "write_s": 1.0}]}

    table = format_table(result(10.0, 6.0), result(7.0, 6.0))
    assert "| v2 | 10.00 GB | 7.00 GB | 0.70 |" in table
    assert "| 4.00 GB | 1.00 GB | 0.25 |" in table
