"""The learner's weights, as each weight form (rlpipe/weightsync/form.py) has them: one view per form, chosen once when
the train engine starts (`weights_view`). A view answers what the model loads (with adapters or without), what a
weight sync sends (its shapes and this rank's rows of it), what a checkpoint stores, what an export writes and how
the KL reference is read.

- `FullView`: every weight trains, syncs, is checkpointed and exported; the KL reference is a frozen copy.
- `MergedView`: learner.lora's adapters on a frozen base; a sync sends the merged weights W + s·B·A (each rank
  merges its own rows, one weight at a time as the sync reads it); a checkpoint holds the adapters alone; an export
  is a PEFT adapter folder, or the merged weights; the KL reference is the base itself, read with the adapters off.
- `AdapterView`: as `MergedView`, but a sync sends this rank's rows of each adapter alone (the base never leaves
  the device).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from rlpipe.training.lora import (
    MergedWeights, WeightsWithAdapters, adapter_rows, add_adapters, adapters_off, is_adapter_key, merged,
    merged_stream, save_adapter,
)
from rlpipe.weightsync.form import Kind, WeightForm

Tensors = Iterable[tuple[str, torch.Tensor]]


class FullView:
    """No adapters: the model's every weight is the policy's."""

    def __init__(self, form: WeightForm, strategy, rank: int, world_size: int, model_path: str):
        self.form, self.strategy, self.rank, self.world_size, self.model_path = (
            form, strategy, rank, world_size, model_path
        )

    def weights_to_load(self, model, weights):
        """What `model` (built on meta) loads: the model folder's `weights`."""
        return weights

    def synced(self, name: str) -> bool:
        """Whether a weight sync sends the state-dict entry `name`."""
        return True

    def local_weights(self, model) -> dict[str, torch.Tensor]:
        """This rank's rows of every tensor a sync sends, no gather."""
        return self.strategy.local_weights(model)

    def full_state_dict(self, model) -> dict[str, torch.Tensor]:
        """The policy's whole tensors under Hugging Face names (a collective when sharded)."""
        return self.strategy.full_state_dict(model)

    def checkpointed(self, name: str) -> bool:
        """Whether a checkpoint stores the state-dict entry `name`."""
        return True

    def export(self, tensors: Tensors, out_dir: str, merge: bool) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The tensors of a Hugging Face folder to write from the model's whole `tensors`; None where this view
        wrote its own export (rank 0) and nothing is left to write."""
        return iter(tensors)

    def frozen_reference(self, engine):
        """The model the KL reference reads: a frozen copy of the starting model."""
        return engine.frozen_copy()

    def reference_logprobs(self, engine, rows, reference) -> torch.Tensor:
        return engine.logprobs(rows, reference)


class MergedView(FullView):
    """learner.lora's adapters on a frozen base; a sync sends the merged weights."""

    def weights_to_load(self, model, weights):
        return WeightsWithAdapters(weights, add_adapters(model, self.form.lora))

    def synced(self, name: str) -> bool:
        return not is_adapter_key(name)

    def local_weights(self, model) -> dict[str, torch.Tensor]:
        # B's rows are the weight's rows and A is whole on every rank: each rank merges its own rows.
        return MergedWeights(self.strategy.local_weights(model), self.form.scaling)

    def full_state_dict(self, model) -> dict[str, torch.Tensor]:
        return merged(self.strategy.full_state_dict(model), self.form.scaling)

    def checkpointed(self, name: str) -> bool:
        return is_adapter_key(name)  # the base is the model folder's, unchanged

    def export(self, tensors: Tensors, out_dir: str, merge: bool) -> Iterator[tuple[str, torch.Tensor]] | None:
        if merge:
            return merged_stream(tensors, self.form.scaling)
        adapters = {name: value for name, value in tensors if is_adapter_key(name)}
        if self.rank == 0:
            save_adapter(adapters, self.form.lora, self.model_path, out_dir)
        return None

    def frozen_reference(self, engine):
        return None  # the base itself, read with the adapters off: no second copy of the model

    def reference_logprobs(self, engine, rows, reference) -> torch.Tensor:
        with adapters_off(engine.model):
            return engine.logprobs(rows, engine.model)


class AdapterView(MergedView):
    """learner.lora's adapters on a frozen base; a sync sends the adapters alone."""

    def synced(self, name: str) -> bool:
        return is_adapter_key(name)

    def local_weights(self, model) -> dict[str, torch.Tensor]:
        # The frozen base never leaves the device; a tensor every rank holds whole (A) is cut to this rank's rows.
        adapters = self.strategy.local_weights(model, keep=is_adapter_key)
        shapes = {name: tuple(value.shape) for name, value in model.state_dict().items() if self.synced(name)}
        return adapter_rows(adapters, shapes, self.rank, self.world_size)


VIEWS = {Kind.FULL: FullView, Kind.MERGED: MergedView, Kind.ADAPTERS: AdapterView}


def weights_view(form: WeightForm, strategy, rank: int, world_size: int, model_path: str) -> FullView:
    """The view of `form`'s weights for one learner rank."""
    return VIEWS[form.kind](form, strategy, rank, world_size, model_path)
