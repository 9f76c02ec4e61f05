"""The TPU contract lane (bash scripts/test-tpu-contract.sh): rlpipe's TPU code against the packages the `tpu` extra
installs (torch-tpu, vllm-torchtpu, jax; Python 3.12), imported and introspected for real on a host without a TPU.
Where those packages are not installed (the main environment) the folder is not collected."""

import importlib.util

import pytest

if importlib.util.find_spec("vllm_torchtpu") is None or importlib.util.find_spec("torch_tpu") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tpu_device_name():
    """The `tpu` device name, which torch_tpu registers on a TPU host only and vLLM's config parses (tensors stay
    on the CPU)."""
    import torch

    if torch._C._get_privateuse1_backend_name() != "tpu":
        torch.utils.rename_privateuse1_backend("tpu")


@pytest.fixture(scope="session", autouse=True)
def _one_launch_helper_per_environment():
    """torch_tpu's launch helper started once for each job environment the lane's checks ask it about."""
    from tests.tpu_contract.launch_helpers import one_helper_per_environment

    with one_helper_per_environment():
        yield
