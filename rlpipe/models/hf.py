"""Hugging Face model folders: config.json plus safetensors weights, single-file or sharded with an index.

Only safetensors are read: pickle checkpoints (`pytorch_model.bin`) can run arbitrary code when loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlpipe.models.checks import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX_FILE,
    ModelFileError,
    check_config,
    check_stored_against_config,
    read_config,
    safetensors_files,
    stored_tensors,
)
from rlpipe.models.llama import CausalLM
from rlpipe.models.moe import split_expert_weights, stack_expert_weights
from rlpipe.models.registry import build_model

MAX_SHARD_BYTES = 2**31
# safetensors' names of the dtypes it stores.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # a written safetensors shard's size, and what a streamed export holds at once

# Files a model folder needs besides weights and config to be usable for generation: tokenizer, chat template,
# sampling defaults.
COMPANION_FILE_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
    "generation_config.json",
)
COMPANION_DIRECTORIES = ("additional_chat_templates",)

# Old checkpoints stored RoPE tables, which are recomputed from the config.
_IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(path: str | os.PathLike) -> dict:
    """The config.json of a Hugging Face model folder, as a dict, its fields checked (rlpipe/models/checks.py)."""
    return read_config(path)


def load_state_dict(path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor in the folder's safetensors file(s), floating-point ones cast to `dtype` when given. Tensors read
    as stored are views of a private mapping of the file: for reading (a model built to be trained reads its
    weights through `CheckpointWeights`, into memory of its own)."""
    state: dict[str, torch.Tensor] = {}
    stored_tensors(path)  # headers checked against the files before safetensors maps them
    for file in safetensors_files(Path(path)):
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                tensor = tensors.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = tensor
    return state


def load_model_weights(path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The folder's weights under the model's own names: as stored, except that per-expert tensors of a
    mixture-of-experts model are stacked (rlpipe/models/moe.py)."""
    num_experts = meta_model(path).architecture.num_experts
    state = load_state_dict(path, dtype)
    return stack_expert_weights(state, num_experts) if num_experts else state


def load_model(
    path: str | os.PathLike, dtype: torch.dtype | None = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """The model of a Hugging Face folder with its weights on `device`; `dtype=None` keeps the stored dtypes. Read
    tensor by tensor (`CheckpointWeights`): besides the model, the host holds one tensor at a time."""
    model = meta_model(path)  # no memory goes to random weights that the checkpoint replaces anyway
    CheckpointWeights(path, model, dtype).load_into(model, device)
    return model


class CheckpointWeights:
    """A model folder's weights under the names of `model` (built on `meta`, `meta_model`), read straight from its
    safetensors files a tensor, or a range of a tensor's first dimension, at a time: whoever loads a model, or a
    shard of one, never holds the whole state. Checks at once, from the files' headers, that they hold exactly the
    weights `model` has, with its shapes. Floating-point tensors come in `dtype` (None: as stored), in memory of
    their own (parameters are trained in place)."""

    def __init__(self, path: str | os.PathLike, model: CausalLM, dtype: torch.dtype | None = torch.float32):
        self.dtype = dtype
        self.num_experts = model.architecture.num_experts
        # stored name -> (file, where its bytes start, dtype, shape), from the checked headers. Read with plain file
        # reads, not through safetensors' memory map: every mapped page a read touches counts as this process's
        # memory while the mapping lives, so rows would cost their bytes twice and a whole load the whole file.
        tensors = stored_tensors(path)
        check_stored_against_config(model.architecture, tensors, Path(path))
        self._entries = {
            name: (tensor.file, tensor.start, _SAFETENSORS_DTYPES[tensor.dtype], tensor.shape)
            for name, tensor in tensors.items()
        }
        stored = {name: torch.empty(tensor.shape, device="meta") for name, tensor in tensors.items()}
        _check_weights_match(model, _as_model_state(model, stored), path)

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """The model's weight `name`, or rows `rows` of its first dimension."""
        if name not in self._entries and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            return self._read_experts(name, rows)
        file, where, dtype, shape = self._entries[name]
        first, stop = (0, shape[0] if shape else 1) if rows is None else rows.indices(shape[0])[:2]
        out = torch.empty((max(0, stop - first), *shape[1:]) if shape else (), dtype=dtype)
        buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(file, "rb", buffering=0) as handle:
            handle.seek(where + first * out[0].nbytes if out.dim() and len(out) else where)
            done = 0
            while done < len(buffer):  # one read(2) moves at most about 2 GiB
                count = handle.readinto(buffer[done:])
                if not count:
                    raise ValueError(f"{file} ends inside {name}")
                done += count
        if self.dtype is not None and out.is_floating_point() and out.dtype != self.dtype:
            return out.to(self.dtype)
        return out

    def _read_experts(self, name: str, rows: slice | None) -> torch.Tensor:
        """A stacked expert weight (rlpipe/models/moe.py) from the per-expert tensors of the experts in `rows`, each
        read into its place."""
        experts, _, stacked = name.rpartition(".")
        projections = ("gate_proj", "up_proj") if stacked == "gate_up_proj" else ("down_proj",)
        chosen = range(self.num_experts)[rows if rows is not None else slice(None)]
        parts = [self._entries[f"{experts}.0.{projection}.weight"] for projection in projections]
        height, width = sum(shape[0] for *_, shape in parts), parts[0][3][1]
        dtype = self.dtype if self.dtype is not None else parts[0][2]
        out = torch.empty((len(chosen), height, width), dtype=dtype)
        for slot, index in enumerate(chosen):
            top = 0
            for projection in projections:
                matrix = self.read(f"{experts}.{index}.{projection}.weight")
                out[slot, top : top + len(matrix)] = matrix
                top += len(matrix)
        return out

    def load_into(self, model: CausalLM, device: str | torch.device, placed=None) -> None:
        """Give every parameter of `model` (on `meta`) its whole weight on `device`, one tensor at a time, each
        handed to `placed` (if given) as soon as it is there (e.g. to lay it out over devices before the next)."""
        # A parameter two modules share (tied) is read once, under its first name.
        loaded: dict[int, torch.nn.Parameter] = {}
        for module_name, module in model.named_modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in loaded:
                    weight = self.read(f"{module_name}.{name}" if module_name else name).to(device)
                    loaded[id(param)] = torch.nn.Parameter(weight, requires_grad=param.requires_grad)
                    if placed is not None:
                        placed(loaded[id(param)])
                module._parameters[name] = loaded[id(param)]


def check_weights(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of the model config.json describes, after checking that the folder's safetensors
    hold exactly those weights with those shapes, in floating-point dtypes. Only config.json and the files' headers
    are read, and config.json's counts are compared with the files before a model is built (on `meta`): a truncated
    or misshapen file fails here, not when a learner or an engine loads it."""
    path = Path(path)
    architecture = check_config(read_config(path), path / CONFIG_FILE)
    tensors = stored_tensors(path)
    check_stored_against_config(architecture, tensors, path)
    model = meta_model(path)
    stored = {name: torch.empty(tensor.shape, device="meta") for name, tensor in tensors.items()}
    _check_weights_match(model, _as_model_state(model, stored), path)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def meta_model(path: str | os.PathLike, impl: str = "auto") -> CausalLM:
    """The module tree config.json describes, in the code `impl` (model.impl) chooses, on the meta device: shapes
    without memory."""
    with torch.device("meta"):
        return build_model(read_hf_config(path), impl)


def _as_model_state(model: CausalLM, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A folder's tensors under the names `model` loads: experts stacked, RoPE tables and a tied lm_head dropped."""
    if model.architecture.num_experts:
        state = stack_expert_weights(state, model.architecture.num_experts)
    state = {name: tensor for name, tensor in state.items() if not name.endswith(_IGNORED_CHECKPOINT_SUFFIXES)}
    if model.architecture.tie_word_embeddings:
        # Some tied checkpoints still carry a copy of the embedding as lm_head; the embedding is authoritative.
        state.pop("lm_head.weight", None)
    return state


def _check_weights_match(model: CausalLM, state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    problem = shape_mismatch(expected, {name: tuple(tensor.shape) for name, tensor in state.items()})
    if problem:
        raise ModelFileError(path, f"its weights do not fit its config.json: {problem}")


def shape_mismatch(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> str | None:
    """What differs between two sets of named weight shapes, in one line (None: nothing)."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    misshapen = [
        f"{name} {found[name]} (expected {shape})"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing ({', '.join(missing[:4])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:4])})")
    if misshapen:
        problems.append(f"{len(misshapen)} with the wrong shape ({', '.join(misshapen[:4])})")
    return "; ".join(problems) or None


def save_state_dict(
    state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    hf_config: dict,
    out_dir: str | os.PathLike,
    *,
    source_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write whole tensors under the model's names as a Hugging Face folder that transformers and vLLM load:
    config.json (with its dtype set to the weights'), safetensors shards of at most `max_shard_bytes` (one tensor
    larger than that gets a shard of its own), and tokenizer / chat template / generation config copied from
    `source_dir`. Stacked experts are written per expert, as Hugging Face checkpoints hold them. `state` is a mapping,
    or (name, tensor) pairs, which are written as they come, so that no more than one safetensors shard's worth is
    held at once (an export streamed from a sharded learner).

    The folder is assembled next to `out_dir` and renamed into place, so `out_dir` never holds a partial model.
    An existing `out_dir` is an error unless `overwrite`.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite=True to replace it)")

    pairs = state.items() if isinstance(state, Mapping) else state
    tensors = (
        (name, tensor.detach().to("cpu").contiguous())
        for pair in pairs
        for name, tensor in split_expert_weights(dict([pair])).items()
    )
    staging_dir = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging_dir.mkdir(parents=True)
    try:
        dtype_counts = _write_weights(tensors, staging_dir, max_shard_bytes)
        config = dict(hf_config)
        config["dtype"] = str(dtype_counts.most_common(1)[0][0]).removeprefix("torch.")  # what readers load it in
        if "torch_dtype" in config:  # the name transformers 4.x reads; keep it in step for older readers
            config["torch_dtype"] = config["dtype"]
        (staging_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if source_dir is not None:
            _copy_companion_files(Path(source_dir), staging_dir)
        _move_into_place(staging_dir, out_dir)
    except BaseException:
        shutil.rmtree(staging_dir, ignore_errors=True)
        raise
    return out_dir


def _write_weights(tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, max_shard_bytes: int) -> Counter:
    """Write the tensors into safetensors shards of at most `max_shard_bytes` (one larger tensor gets a shard of its
    own), each as soon as it is full; returns the parameter count per dtype."""
    metadata = {"format": "pt"}  # the format tag transformers writes and checks on load
    written: list[tuple[str, list[str]]] = []  # (file, its tensors' names)
    dtype_counts: Counter = Counter()
    total_size = 0
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0

    def flush() -> None:
        name = f"part-{len(written):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=metadata)
        written.append((name, list(shard)))

    for name, tensor in tensors:
        tensor_bytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + tensor_bytes > max_shard_bytes:
            flush()
            shard, shard_bytes = {}, 0
        shard[name] = tensor
        shard_bytes += tensor_bytes
        total_size += tensor_bytes
        dtype_counts[tensor.dtype] += tensor.numel()
    flush()

    if len(written) == 1:
        (folder / written[0][0]).rename(folder / SAFETENSORS_FILE)
        return dtype_counts
    weight_map = {}
    for number, (file, names) in enumerate(written, start=1):
        shard_name = f"model-{number:05d}-of-{len(written):05d}.safetensors"
        (folder / file).rename(folder / shard_name)
        weight_map.update(dict.fromkeys(names, shard_name))
    index = {
        "metadata": {"total_size": total_size, "total_parameters": sum(dtype_counts.values())},
        "weight_map": weight_map,
    }
    (folder / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return dtype_counts


def _copy_companion_files(source_dir: Path, destination: Path) -> None:
    for pattern in COMPANION_FILE_PATTERNS:
        for file in source_dir.glob(pattern):
            if file.is_file():
                shutil.copy2(file, destination / file.name)
    for name in COMPANION_DIRECTORIES:
        if (source_dir / name).is_dir():
            shutil.copytree(source_dir / name, destination / name)


def _move_into_place(staging_dir: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        staging_dir.rename(out_dir)
        return
    retired_dir = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
    out_dir.rename(retired_dir)
    staging_dir.rename(out_dir)
    shutil.rmtree(retired_dir)
