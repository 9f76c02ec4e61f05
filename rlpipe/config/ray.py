"""The `ray` section: the cluster the run starts or joins."""

from __future__ import annotations

from dataclasses import dataclass

from rlpipe.config.errors import require
from rlpipe.config.keys import key


@dataclass
class RayConfig:
    address: str | None = key(None, "join this Ray cluster; null starts a local one on 127.0.0.1")
    num_cpus: int | None = key(None, "logical CPUs of the local cluster (null: enough for the actors)")
    dashboard: bool = key(False, "start the Ray dashboard (bound to 127.0.0.1)")
    dashboard_port: int = key(8265, "port of that dashboard; it must be free")
    placement_timeout_s: float = key(120.0, "how long to wait for the cluster to place a role's actors")
    start_timeout_s: float = key(
        1800.0, "how long the roles may take to start (model load, process groups) and a restarted engine to load"
    )

    def check(self) -> None:
        require(0 < self.dashboard_port < 65536, "ray.dashboard_port: must be a port number (1-65535)")
        require(self.placement_timeout_s > 0, "ray.placement_timeout_s: must be > 0")
        require(self.start_timeout_s > 0, "ray.start_timeout_s: must be > 0")
