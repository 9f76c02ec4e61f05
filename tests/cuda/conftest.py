"""The CUDA lane: its tests run only where torch sees a GPU (scripts/device-check.sh runs them there)."""

import pytest
import torch


def pytest_runtest_setup(item):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
