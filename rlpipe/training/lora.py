"""LoRA adapters on the learner's own model classes (rlpipe/models), read and written in PEFT's format.

A targeted `nn.Linear` becomes a `LoraLinear` in place (its class is swapped, its weight and bias stay where they
are) and gains two children, `lora_A` [rank, in] and `lora_B` [out, rank], so that its output is
`x W^T + b + scaling * B A x` with `scaling = alpha / rank`. The model's state-dict then holds the base weights
under their Hugging Face names and the adapters under `<module>.lora_A.weight` / `<module>.lora_B.weight`: PEFT's
saved names without the `base_model.model.` prefix, so an adapter folder is written and read by renaming alone.

Why not PEFT's LoraModel itself: it wraps each layer (`q_proj.base_layer.weight`), which renames the base weights
that the sharding, the weight-sync plan and checkpoints address by their Hugging Face names, and its layers carry
per-adapter dictionaries and hooks that the compiled step would trace through. A swapped class keeps every name,
shards like any other module (rlpipe/parallel/simple_fsdp.py), and its forward is three plain ops.

Initialisation follows PEFT's default: A as nn.Linear initialises it (Kaiming-uniform), B zero, so a fresh adapter
leaves the model unchanged. `lora_A` is replicated rather than sharded when the learner shards (it is rank x in,
small), so that every rank merges its own rows of `W + scaling * B A` from the rows of B it holds, with no
collective: that is what the merged-weights sync sends.

A sync of the adapters alone (`sync.lora`) sends each rank's rows of every adapter as the sync plan assigns them
(`adapter_rows`: the rows of B it holds, and its share of the rows of the replicated A). The engine has vLLM load the
first version it receives from an adapter folder (`AdapterFolders`), and writes later versions straight into the
LoRA buffers vLLM set up for it (rlpipe/rollout/vllm_worker.py `rlpipe_write_adapters`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rlpipe.config.learner import is_targeted
from rlpipe.parallel.simple_fsdp import REPLICATED
from rlpipe.weightsync.layout import shard_rows
from rlpipe.orphans import remove_orphans

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class LoraLinear(nn.Linear):
    """A Linear with a low-rank update beside it (see the module's docstring). Dropout acts on the adapters' input
    in the training forward only (grad enabled), so log-prob passes and weight-sync probes are deterministic."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_scaling: float
    lora_dropout: float
    lora_enabled: bool  # False inside `adapters_off`: the frozen base alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return out
        if self.lora_dropout and self.training and torch.is_grad_enabled():
            x = F.dropout(x, self.lora_dropout)
        return out + self.lora_B(self.lora_A(x)) * self.lora_scaling


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """`model` as its frozen base inside the context: every LoraLinear computes x W^T + b alone, exactly what the
    starting model computes. It is the KL reference under LoRA, so no second copy of the model is held."""
    layers = [module for module in model.modules() if isinstance(module, LoraLinear)]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.lora_enabled = True


def is_adapter_key(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def scaling(lora) -> float:
    """alpha / rank, PEFT's scaling without rsLoRA."""
    return lora.alpha / lora.rank


def targeted_modules(model: nn.Module, targets: list[str]) -> list[tuple[str, nn.Linear]]:
    """The Linear modules `targets` names (`is_targeted`)."""
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module, LoraLinear) or ".lora_" in f".{name}":
            continue
        if is_targeted(name, targets):
            chosen.append((name, module))
    return chosen


def add_adapters(model: nn.Module, lora) -> dict[str, torch.Tensor]:
    """Give every Linear `lora` (the learner.lora config section) targets an adapter and freeze everything else;
    returns the adapters' starting values under their state-dict names (on the CPU, from torch's generator, so
    ranks seeded alike start alike). `model` may be on `meta`: the values are then loaded with the base weights
    (`WeightsWithAdapters`)."""
    chosen = targeted_modules(model, lora.target_modules)
    if not chosen:
        raise ValueError(f"learner.lora.target_modules: {lora.target_modules} matches no Linear layer of the model")
    model.requires_grad_(False)
    initial: dict[str, torch.Tensor] = {}
    for name, module in chosen:
        device, dtype = module.weight.device, module.weight.dtype
        module.__class__ = LoraLinear
        module.lora_A = nn.Linear(module.in_features, lora.rank, bias=False, device=device, dtype=dtype)
        module.lora_B = nn.Linear(lora.rank, module.out_features, bias=False, device=device, dtype=dtype)
        module.lora_scaling = scaling(lora)
        module.lora_dropout = lora.dropout
        module.lora_enabled = True
        setattr(module.lora_A.weight, REPLICATED, True)
        a = torch.empty(lora.rank, module.in_features, dtype=dtype)
        nn.init.kaiming_uniform_(a, a=5**0.5)  # nn.Linear's own initialisation, as PEFT's default
        initial[f"{name}.lora_A.weight"] = a
        initial[f"{name}.lora_B.weight"] = torch.zeros(module.out_features, lora.rank, dtype=dtype)
    return initial


class WeightsWithAdapters:
    """A model folder's weights (rlpipe/models/hf.py `CheckpointWeights`) plus the adapters' starting values, read
    the same way (whole, or rows of the first dimension), so every strategy loads a model with adapters as it loads
    one without."""

    def __init__(self, weights, adapters: dict[str, torch.Tensor]):
        self.weights, self.adapters = weights, adapters

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        if name in self.adapters:
            value = self.adapters[name]
            return (value if rows is None else value[rows]).clone()
        return self.weights.read(name, rows)

    def load_into(self, model: nn.Module, device, placed=None) -> None:
        from rlpipe.models.hf import CheckpointWeights

        CheckpointWeights.load_into(self, model, device, placed)


def merged(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """`state` (base weights and adapters, whole or a rank's rows of each: B's rows are the weight's rows) with the
    adapters folded in: each targeted weight becomes W + scale * B A, computed in float32 and stored in W's dtype,
    and the adapter entries are gone."""
    return dict(MergedWeights(state, scale))


class MergedWeights(Mapping[str, torch.Tensor]):
    """`merged(state, scale)` computed one weight at a time, when it is read: the weight sync packs bucket by
    bucket, so a learner rank holds one merged tensor at a time, never a merged copy of the model."""

    def __init__(self, state: Mapping[str, torch.Tensor], scale: float):
        self._state, self._scale = state, scale
        self._names = [name for name in state if not is_adapter_key(name)]

    def __getitem__(self, name: str) -> torch.Tensor:
        if is_adapter_key(name):
            raise KeyError(name)
        value = self._state[name]
        module = name.removesuffix(".weight")
        a, b = self._state.get(f"{module}.lora_A.weight"), self._state.get(f"{module}.lora_B.weight")
        if a is not None and b is not None:
            value = (value.float() + self._scale * (b.float() @ a.float())).to(value.dtype)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def merged_stream(tensors: Iterable[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """`merged` over a stream of (name, tensor) in state-dict order, holding back one module's tensors at a time (a
    LoraLinear's weight and bias come just before its lora_A and lora_B)."""
    held: dict[str, torch.Tensor] = {}
    held_module = None
    for name, value in tensors:
        module = name.rpartition(".lora_")[0] if is_adapter_key(name) else name.rpartition(".")[0]
        if module != held_module:
            yield from merged(held, scale).items()
            held, held_module = {}, module
        held[name] = value
    yield from merged(held, scale).items()


def adapter_config(lora, modules: Iterable[str], base_path: str) -> dict:
    """adapter_config.json as PEFT writes it for this adapter; `modules` are the adapted modules' names, listed by
    their last component (PEFT's and vLLM's matching) so no reader needs to resolve all-linear itself."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in modules}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_adapter(adapters: dict[str, torch.Tensor], lora, base_path: str, out_dir: str | os.PathLike) -> Path:
    """Write a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) from the adapters under their
    state-dict names; `peft.PeftModel.from_pretrained(base, out_dir)` loads it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True)
    tensors = {PEFT_PREFIX + name: value.detach().cpu().contiguous() for name, value in adapters.items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    modules = {name.rsplit(".lora_", 1)[0] for name in adapters}
    config = adapter_config(lora, modules, base_path)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def adapter_shapes_problem(base: dict[str, tuple[int, ...]], adapters: dict[str, tuple[int, ...]]) -> str | None:
    """Why adapters of these shapes cannot sit on a model whose weights have the shapes `base`; None when they
    can (every adapter names a 2-D weight of the model, A reads its input width, B writes its output width, and A
    and B agree on the rank)."""
    for name, shape in sorted(adapters.items()):
        module, _, which = name.rpartition(".lora_")
        weight = base.get(f"{module}.weight")
        if weight is None or len(weight) != 2 or len(shape) != 2:
            return f"adapter {name} belongs to no linear weight of the model"
        if which == "A.weight" and shape[1] != weight[1] or which == "B.weight" and shape[0] != weight[0]:
            return f"adapter {name} {tuple(shape)} does not fit weight {module}.weight {tuple(weight)}"
        other = adapters.get(f"{module}.lora_{'B' if which == 'A.weight' else 'A'}.weight")
        if other is None or (shape[0] if which == "A.weight" else shape[1]) != (
            other[1] if which == "A.weight" else other[0]
        ):
            return f"adapter {name}: its lora_A and lora_B do not pair up"
    return None


def adapter_rows(
    local: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], rank: int, ranks: int
) -> dict[str, torch.Tensor]:
    """This rank's rows of every adapter in `local` (the rank's state: B's rows, and A whole, as SimpleFSDP holds
    it), as the sync plan has each rank send them: a tensor held whole on every rank (A) is cut to the rows
    `shard_rows` gives this rank, so the ranks send it once between them."""
    out = {}
    for name, value in local.items():
        rows = shapes[name][0]
        if ranks > 1 and value.shape[0] == rows:
            start, stop = shard_rows(rows, rank, ranks)
            value = value[start:stop]
        out[name] = value
    return out


ADAPTER_FOLDER_PREFIX = "rlpipe-adapters-"  # then the engine's process id


def adapter_root(directory: str | None = None) -> str:
    """A new private folder for an engine's adapter versions, named after this process. Folders of engines whose
    process is gone are removed first: an engine stopped by `ray.kill` never reaches its own clean-up."""
    directory = directory or tempfile.gettempdir()
    remove_orphans(directory, ADAPTER_FOLDER_PREFIX, lambda path: shutil.rmtree(path, ignore_errors=True))
    return tempfile.mkdtemp(prefix=f"{ADAPTER_FOLDER_PREFIX}{os.getpid()}-", dir=directory)


class AdapterFolders:
    """Where an engine writes a version of the adapters for vLLM to load, as a PEFT folder: two folders under
    `root`, used in turn, so the version served before the latest one stays on disk while the latest is written and
    loaded. `lora` is the learner.lora section, `base_path` the base model's folder."""

    def __init__(self, root: str | os.PathLike, lora, base_path: str):
        self.root, self.lora, self.base_path = Path(root), lora, base_path
        self.written = 0

    def write(self, adapters: dict[str, torch.Tensor]) -> Path:
        """Write `adapters` (under their state-dict names) into the folder not written last; returns it."""
        folder = self.root / ("a", "b")[self.written % 2]
        shutil.rmtree(folder, ignore_errors=True)  # two versions old
        save_adapter(adapters, self.lora, self.base_path, folder)
        self.written += 1
        return folder

    def clear(self) -> None:
        """Remove the folders written (the engine now serves a version that none of them holds)."""
        for folder in ("a", "b"):
            shutil.rmtree(self.root / folder, ignore_errors=True)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
