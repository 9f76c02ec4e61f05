"""The run's own Ray cluster: services on loopback, token authentication left on (Ray is not started)."""

from __future__ import annotations

import logging
import os

import pytest

import rlpipe.actors.cluster
from rlpipe.config import load_config


@pytest.mark.parametrize("auth_mode", [None, "disabled"])
def test_the_local_cluster_binds_loopback_and_leaves_token_authentication_to_ray(monkeypatch, caplog, auth_mode):
    # Ray turns token authentication on for a new local cluster only while RAY_AUTH_MODE is unset, and caches the
    # mode per process: start_ray must neither set it (the cache would go stale) nor hide that a user turned it off.
    monkeypatch.setenv("RAY_AUTH_MODE", "placeholder")  # so that monkeypatch restores the variable afterwards
    if auth_mode is None:
        monkeypatch.delenv("RAY_AUTH_MODE")
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", auth_mode)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setattr(rlpipe.actors.cluster.ray_constants, "ENABLE_RAY_CLUSTER", rlpipe.actors.cluster.ray_constants.ENABLE_RAY_CLUSTER)
    calls = []
    monkeypatch.setattr(rlpipe.actors.cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(rlpipe.actors.cluster.ray, "init", lambda **kwargs: calls.append((kwargs, os.environ.get("RAY_AUTH_MODE"))))
    with caplog.at_level(logging.WARNING, logger="rlpipe"):
        rlpipe.actors.cluster.start_ray(load_config(None, ["ray.num_cpus=2"]))
    [(kwargs, seen_mode)] = calls
    assert seen_mode == auth_mode
    assert kwargs["address"] == "local" and kwargs["_node_ip_address"] == kwargs["dashboard_host"] == "127.0.0.1"
    warned = [r.getMessage() for r in caplog.records if "RAY_AUTH_MODE" in r.getMessage()]
    assert warned == ([] if auth_mode is None else ["RAY_AUTH_MODE=disabled: the local Ray cluster runs without token authentication"])


@pytest.mark.parametrize("callers", ["rlpipe train's", "none"])
def test_a_sigterm_handler_the_caller_installed_outlives_ray_init(monkeypatch, callers):
    # ray.init installs SIGTERM handlers of its own, the last its core worker's, which aborts the process: `rlpipe
    # train`'s handler, which ends the run as Ctrl-C does, must be the one in force once the cluster is joined.
    import signal

    def rays(signum, frame):
        pass

    def rlpipe_trains(signum, frame):
        pass

    monkeypatch.setattr(rlpipe.actors.cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(rlpipe.actors.cluster.ray, "init", lambda **kwargs: signal.signal(signal.SIGTERM, rays))
    before = signal.signal(signal.SIGTERM, rlpipe_trains if callers != "none" else signal.SIG_DFL)
    try:
        rlpipe.actors.cluster.start_ray(load_config(None, ["ray.address=127.0.0.1:6379"]))
        assert signal.getsignal(signal.SIGTERM) is (rlpipe_trains if callers != "none" else rays)
    finally:
        signal.signal(signal.SIGTERM, before)
