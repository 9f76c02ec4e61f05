"""The weight form: what a version of the policy is, and so what each weight sync sends. Decided once at start-up
(`weight_form`, by the controller; `rlpipe plan` asks the same rule, `decide_weight_form`) and handed to whoever
needs it: the learner ranks (their weights view), the rollout engines (their writer) and the memory plan.

- `full`: no adapters; every weight trains and every weight is sent.
- `merged`: `learner.lora`'s adapters train on a frozen base; each sync sends the merged weights W + s·B·A, which
  the engines take as whole weights. `why_merged` says why the adapters do not go alone.
- `adapters`: the adapters train and go alone; the engines load the base once and apply the adapters through
  vLLM's LoRA support.

The adapters' settings (rank, alpha, dropout, target modules) travel in the form, so both sides read the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from rlpipe.config.learner import LoraConfig

if TYPE_CHECKING:
    from rlpipe.config import Config


class Kind(str, Enum):
    FULL = "full"
    MERGED = "merged"
    ADAPTERS = "adapters"


@dataclass(frozen=True)
class WeightForm:
    """One run's weight form: its `kind`, the adapters' settings (`lora`, None for `full`) and, for `merged`, why
    the adapters do not go alone."""

    kind: Kind = Kind.FULL
    lora: LoraConfig | None = None
    why_merged: str = ""

    def __post_init__(self) -> None:
        if (self.kind is Kind.FULL) != (self.lora is None):
            raise ValueError(f"weight form {self.kind.value}: adapter settings are given exactly when adapters train")

    @property
    def adapters(self) -> bool:
        """Each sync sends the adapters alone (the engines apply them as a LoRA adapter)."""
        return self.kind is Kind.ADAPTERS

    @property
    def scaling(self) -> float:
        """The adapters' scale, alpha / rank."""
        return self.lora.alpha / self.lora.rank

    def describe(self, adapter_bytes: float | None = None) -> str:
        """The form in words, for the run's log; `adapter_bytes`: what one version of the adapters weighs."""
        if self.kind is Kind.ADAPTERS:
            size = f" ({adapter_bytes / 1e6:.2f} MB a version)" if adapter_bytes is not None else ""
            return f"LoRA adapters only{size}"
        if self.kind is Kind.MERGED:  # the engines hold no adapter: each sync sends W + (alpha / rank) B A
            return f"merged LoRA weights ({self.why_merged})"
        return "full weights"


FULL = WeightForm()


def decide_weight_form(cfg: Config, moe: bool = False) -> WeightForm:
    """The rule: the form of `cfg`'s run, for a model with mixture-of-experts layers or not (`moe`, whose adapter
    syncs `sync.lora: auto` sends merged). Without learner.lora, full; with it, the adapters alone unless
    `sync.lora: merged` or the engines cannot take them (`Config.adapters_refused`)."""
    lora = cfg.learner.lora
    if lora is None:
        return FULL
    if cfg.sync.lora == "merged":
        return WeightForm(Kind.MERGED, lora, "sync.lora: merged")
    refused = cfg.adapters_refused()
    if refused is None and moe and cfg.sync.lora == "auto":
        refused = "adapter syncs of mixture-of-experts models are not verified in vLLM"
    return WeightForm(Kind.MERGED, lora, refused) if refused else WeightForm(Kind.ADAPTERS, lora)


def weight_form(cfg: Config, model_path: str) -> WeightForm:
    """`decide_weight_form` for the model in `model_path` (whether it has mixture-of-experts layers is read from its
    config.json)."""
    if cfg.learner.lora is None:
        return FULL
    from rlpipe.models.hf import read_hf_config
    from rlpipe.models.registry import model_architecture

    return decide_weight_form(cfg, moe=bool(model_architecture(read_hf_config(model_path)).moe_layers))
