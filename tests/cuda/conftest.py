"""The CUDA lane: its tests run only where torch sees a GPU (scripts/device-check.sh runs them there), or on the CPU
under RLPIPE_CHECK_DEVICE=cpu."""

import pytest

from tests.cuda import NO_GPU, gpu_missing


def pytest_runtest_setup(item):
    if gpu_missing():
        pytest.skip(NO_GPU)
