"""What one weight sync sends, in parameters: the whole model, or learner.lora's adapters alone. The learner's host
RAM at a sync, an engine host's staged copies and its /dev/shm all count this."""

from __future__ import annotations

from rlpipe.config import Config
from rlpipe.plan.model_size import ModelSize


def synced_params(cfg: Config, arch: ModelSize) -> int:
    """Parameters a weight sync sends: the whole model, or learner.lora's adapters where they go alone
    (`Config.lora_sync`)."""
    lora = cfg.learner.lora
    if lora is not None and cfg.lora_sync(moe=bool(arch.moe_layers))[0] == "adapters":
        return arch.adapter_params(lora.rank, lora.target_modules)
    return arch.params
