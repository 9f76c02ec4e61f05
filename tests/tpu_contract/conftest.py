"""The TPU contract lane (bash scripts/test-tpu-contract.sh): rlpipe's TPU code against the packages the `tpu` extra
installs (torch-tpu, vllm-torchtpu, jax; Python 3.12), imported and introspected for real on a host without a TPU.
Where those packages are not installed (the main environment) the folder is not collected."""

import importlib.util

if importlib.util.find_spec("vllm_torchtpu") is None or importlib.util.find_spec("torch_tpu") is None:
    collect_ignore_glob = ["test_*.py"]
