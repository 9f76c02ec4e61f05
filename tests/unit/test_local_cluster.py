"""The run's own Ray cluster: services on loopback, token authentication set explicitly (Ray is not started)."""

from __future__ import annotations

import os

import actors.groups
from rlpipe.config import load_config


def test_the_local_cluster_binds_loopback_with_token_authentication(monkeypatch):
    # Unset, as Ray's default would leave it; never set to anything but token here: Ray reads it once per process.
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setattr(actors.groups.ray_constants, "ENABLE_RAY_CLUSTER", actors.groups.ray_constants.ENABLE_RAY_CLUSTER)
    calls = []
    monkeypatch.setattr(actors.groups.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(actors.groups.ray, "init", lambda **kwargs: calls.append((kwargs, os.environ["RAY_AUTH_MODE"])))
    actors.groups.start_ray(load_config(None, ["ray.num_cpus=2"]))
    [(kwargs, auth_mode)] = calls
    assert auth_mode == "token"
    assert kwargs["address"] == "local" and kwargs["_node_ip_address"] == kwargs["dashboard_host"] == "127.0.0.1"
