"""Fixtures of the integration tests."""

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """Every test of a module shares the local Ray cluster its first run starts; shut down after the module."""
    import ray

    yield
    ray.shutdown()
