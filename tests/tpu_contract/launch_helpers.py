"""torch_tpu's launch helper kept running for each job environment the lane asks about: its process spends seconds
importing torch_tpu, and the lane's checks ask it about many hosts in a few environments (rlpipe/tpu/hosts.py's
`LaunchHelper`; an answer still comes from a fresh fork of the process, started with that environment)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator


@contextlib.contextmanager
def one_helper_per_environment() -> Iterator[None]:
    """Within it, every question rlpipe's code asks torch_tpu's launch helper goes to the one process started with
    the question's job environment."""
    from rlpipe.tpu import hosts

    helpers: dict[str, hosts.LaunchHelper] = {}

    def ask(generation, chips_per_host, host_coords, env, ranks_per_host):
        key = json.dumps(env, sort_keys=True)
        if key not in helpers:
            helpers[key] = hosts.LaunchHelper(env)
        try:
            return helpers[key].ask(generation, chips_per_host, host_coords, ranks_per_host)
        except RuntimeError:  # its process ended: the next question starts another
            helpers.pop(key).close()
            raise

    run = hosts._run_launch_helper
    hosts._run_launch_helper = ask
    try:
        yield
    finally:
        hosts._run_launch_helper = run
        for helper in helpers.values():
            helper.close()
