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
