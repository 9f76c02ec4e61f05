"""What one weight sync sends, in parameters: the whole model, or learner.lora's adapters alone. The learner's host
RAM at a sync, an engine host's staged copies and its /dev/shm all count this."""

from __future__ import annotations

from rlpipe.config import Config
from rlpipe.plan.model_size import ModelSize
from rlpipe.weightsync.form import WeightForm, decide_weight_form


def planned_form(cfg: Config, arch: ModelSize) -> WeightForm:
    """The run's weight form, by the rule the controller's `rlpipe.weightsync.form.weight_form` applies."""
    return decide_weight_form(cfg, moe=bool(arch.moe_layers))


def synced_params(cfg: Config, arch: ModelSize) -> int:
    """Parameters a weight sync sends: the whole model, or learner.lora's adapters where they go alone."""
    form = planned_form(cfg, arch)
    if form.adapters:
        return arch.adapter_params(form.lora.rank, form.lora.target_modules)
    return arch.params
