"""Fixtures of the integration tests."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster():
    """Every test of a module shares the local Ray cluster its first run starts; shut down after the module."""
    import ray

    yield
    ray.shutdown()


def node_environment() -> dict[str, str]:
    """This process's environment for starting Ray nodes: without the single-machine switch that `start_ray` leaves
    in a process that started a local cluster (an earlier test in this worker), under which `ray start` refuses a
    node of a multi-node cluster."""
    return {key: value for key, value in os.environ.items() if key != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}


def lane_python(venv_variable: str, default_folder: str, required_variable: str, setup_script: str) -> str:
    """The interpreter of a lane's own environment (.venv-xla, .venv-tpu): the folder `venv_variable` names, else
    `default_folder` in the checkout. Without it the calling test is skipped — or fails where `required_variable`
    is 1 (scripts/test.sh sets it once it has built the environment)."""
    python = Path(os.environ.get(venv_variable, ROOT / default_folder)) / "bin" / "python"
    if not python.is_file():
        message = f"no environment at {python.parent.parent} (bash scripts/{setup_script} builds it)"
        if os.environ.get(required_variable) == "1":
            pytest.fail(message)
        pytest.skip(message)
    return str(python)


@pytest.fixture(scope="module")
def hosts(request):
    """A cluster of hosts on this machine (tests/integration/hosts.py), laid out as the module's HOSTS says and
    shared by its tests; skipped where the machine cannot make namespaces. Nothing of it may outlive the module."""
    from tests.integration.hosts import HostCluster, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"no cluster of hosts on this machine: {reason}")
    cluster = HostCluster(request.module.HOSTS)
    yield cluster
    cluster.close()
    assert not cluster.leftovers()


@pytest.fixture(scope="module")
def xla_python() -> str:
    """The interpreter of .venv-xla, which holds torch_xla (torch 2.9)."""
    return lane_python("RLPIPE_XLA_VENV", ".venv-xla", "RLPIPE_REQUIRE_XLA_ENV", "setup-xla.sh")
