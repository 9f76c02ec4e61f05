"""The PyTorch/XLA lane (bash scripts/test-xla.sh): these tests need torch_xla, which needs torch 2.9.0 exactly and
so lives in its own environment. Where torch_xla is not installed (the main environment) the folder is not
collected at all; importing torch_xla next to another torch would fail."""

import importlib.util
import os

if importlib.util.find_spec("torch_xla") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    # XLA on the host CPU through PJRT: the only XLA device these machines have.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
