"""Training-state checkpoints: atomic step directories, a `latest` pointer, the last K kept.

Layout under a run directory:

    checkpoints/
      step_000004/          a complete checkpoint (only complete ones ever carry this name)
        learner/            model shards and optimizer state, torch.distributed.checkpoint (every rank writes its own);
                            with learner.lora only the adapters and their optimizer state (the base is model.path's)
        trainer.json        step, policy version, sampler position, RNG states, the resolved config, the model
                            folder model.path resolved to, metrics so far
      latest                the name of the newest complete checkpoint (one line)

A save writes everything into `checkpoints/.partial-step_NNNNNN`, fsyncs every file and the directory, renames it
to `step_NNNNNN`, fsyncs `checkpoints/`, and only then moves `latest` (written to a temporary file, fsynced,
renamed). A process killed at any point leaves either the previous `latest` or the new one, each pointing at a
complete directory; a partial directory is never read and is removed by the next save. `trainer.json` is written
last inside the partial directory, so a step directory without it is not a checkpoint. A step directory is never
overwritten, and pruning renames a directory before deleting it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from rlpipe.config import one_line

T = TypeVar("T")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer.json"
LEARNER_STATE = "learner"
FORMAT = 1
_PARTIAL = ".partial-"
_DELETING = ".deleting-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def begin_save(run_dir: str | os.PathLike, step: int) -> Path:
    """A fresh, empty partial directory for `step` (leftovers of interrupted saves are removed first)."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for leftover in [*root.glob(f"{_PARTIAL}*"), *root.glob(f"{_DELETING}*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    partial = root / f"{_PARTIAL}{step_name(step)}"
    partial.mkdir()
    return partial


def save(run_dir: str | os.PathLike, step: int, write_learner: Callable[[str], T], trainer_state: Callable[[T], dict],
         keep: int, passthrough: tuple[type[BaseException], ...] = ()) -> Path:
    """The whole save: `write_learner(directory)` writes the learner state (returning what `trainer_state` needs to
    build trainer.json), then `finish_save`. A failure anywhere — a full disk, a rank that died while writing —
    removes everything this save wrote, leaves `latest` as it was, and raises one CheckpointError naming the cause.
    Errors of the `passthrough` types are the run's rather than the save's (a worker lost for good, which a restart
    may cure): they are raised as they are, after the same clean-up."""
    partial = None
    try:
        partial = begin_save(run_dir, step)
        written = write_learner(str(partial / LEARNER_STATE))
        return finish_save(partial, trainer_state(written), keep)
    except BaseException as err:  # torch.distributed.checkpoint reports a failed write as a BaseException
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, (KeyboardInterrupt, SystemExit, *passthrough)):
            raise
        latest = Path(run_dir) / CHECKPOINTS / LATEST
        kept = latest.read_text().strip() if latest.is_file() else "none"
        raise CheckpointError(
            f"checkpoint {step_name(step)} could not be written in {Path(run_dir) / CHECKPOINTS} ({_cause(err)}); "
            f"nothing of it was kept, the latest complete checkpoint is still {kept}"
        ) from None


def _cause(err: BaseException) -> str:
    """One line for an error that may come wrapped: by Ray (`.cause`) or by torch.distributed.checkpoint (a per-rank
    report whose last line is the cause)."""
    while getattr(err, "cause", None) is not None and err.cause is not err:
        err = err.cause
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def finish_save(partial: Path, trainer_state: dict, keep: int) -> Path:
    """Write trainer.json last, make the partial directory durable, publish it, move `latest`, prune to `keep`."""
    _write_durably(partial / TRAINER_STATE, json.dumps({"format": FORMAT, **trainer_state}, indent=1))
    for path in sorted(partial.rglob("*"), reverse=True):  # files first, then their directories
        _fsync(path)
    _fsync(partial)
    root = partial.parent
    final = root / partial.name[len(_PARTIAL) :]
    if final.exists():  # replacing it could leave `latest` pointing at nothing; a checkpoint is never overwritten
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"checkpoint {final} already exists; it is not overwritten")
    pointer = root / LATEST
    previous = pointer.read_text() if pointer.is_file() else None
    os.rename(partial, final)
    try:
        _fsync(root)
        _write_durably(pointer, final.name + "\n")
    except BaseException:  # not published after all: the pointer as it was, the directory back under its partial name
        _restore(pointer, previous)
        os.rename(final, partial)
        raise
    _prune(root, keep, final.name)
    return final


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from a step directory, a `checkpoints/` directory or a run directory (their
    `latest`). Raises CheckpointError naming what is missing."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path}: no such file or directory")
    for root in (path, path / CHECKPOINTS):
        pointer = root / LATEST
        if pointer.is_file():
            try:
                name = pointer.read_text().strip()
            except (OSError, UnicodeDecodeError) as err:
                raise CheckpointError(f"{pointer}: unreadable ({one_line(err)})") from None
            if not name.startswith("step_") or "/" in name or os.sep in name:
                raise CheckpointError(f"{pointer}: names {name[:40]!r}, not a checkpoint directory beside it")
            return validate(root / name)
    return validate(path)


def validate(path: Path) -> Path:
    """`path` if it is a complete checkpoint this version can read."""
    _read_state_file(path)
    return path


def _read_state_file(path: Path) -> dict:
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise CheckpointError(f"checkpoint {path}: not a complete checkpoint (no {TRAINER_STATE})")
    if not (path / LEARNER_STATE / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path}: the learner state is missing ({LEARNER_STATE}/.metadata)")
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: {TRAINER_STATE} is unreadable ({err})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_file}: must hold a JSON object, found {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {state.get('format')!r}, this rlpipe reads {FORMAT}")
    return state


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_sampler_state(value) -> bool:
    counts = ("size", "epoch", "position")
    seed = value.get("seed") if isinstance(value, dict) else None
    return (isinstance(value, dict) and all(_is_count(value.get(key)) for key in counts) and isinstance(seed, int)
            and not isinstance(seed, bool) and value["position"] <= value["size"])


def _is_model_config(value) -> bool:
    model = value.get("model") if isinstance(value, dict) else None
    return (isinstance(model, dict) and isinstance(model.get("path"), str) and bool(model["path"])
            and isinstance(model.get("tokenizer"), (str, type(None))))


def _is_rng_state(value) -> bool:
    """Whether `value` is what `rng_state` writes: tried on fresh generators, never on this process's own."""
    import random

    import numpy as np

    try:
        version, internal, gauss = value["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        kind, keys, position, has_gauss, cached = value["numpy"]
        np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
        return _is_torch_rng_text(value["torch"])
    except Exception:  # each library rejects a malformed state with its own error type
        return False


def _is_torch_rng_text(value) -> bool:
    import base64
    import binascii

    import torch

    if not isinstance(value, str):
        return False
    try:
        torch.Generator().set_state(torch.frombuffer(bytearray(base64.b64decode(value, validate=True)), dtype=torch.uint8))
    except (binascii.Error, ValueError, RuntimeError):
        return False
    return True


# What trainer.json holds (controller.save_checkpoint writes it): key -> (test, what the key must be).
TRAINER_FIELDS = {
    "step": (_is_count, "a step number"),
    "policy_version": (_is_count, "a version number"),
    "sampler": (_is_sampler_state, "a sampler state {size, seed, epoch, position} with position <= size"),
    "rng": (_is_rng_state, "the Python, NumPy and torch RNG states rlpipe writes"),
    "learner_rng": (lambda v: isinstance(v, list) and all(map(_is_torch_rng_text, v)), "a list of torch RNG states"),
    "config": (_is_model_config, "a resolved config with model.path and model.tokenizer"),
    "model_path": (lambda v: v is None or isinstance(v, str), "a folder name or null"),
    "tokenizer_path": (lambda v: v is None or isinstance(v, str), "a folder name or null"),
    "metrics": (lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v), "a list of metric records"),
    "summary": (lambda v: isinstance(v, dict), "an object"),
}
# What a resumed run reads; an export reads only the model's folders.
RESUME_FIELDS = tuple(TRAINER_FIELDS)
EXPORT_FIELDS = ("config",)


def read_trainer_state(path: Path, needs: tuple[str, ...] = ()) -> dict:
    """A checkpoint's trainer.json, refused in one line naming the file and the key unless each key of `needs` is
    there and every key it holds has the form rlpipe writes."""
    state = _read_state_file(path)
    state_file = path / TRAINER_STATE
    for key in needs:
        if key not in state:
            raise CheckpointError(f"{state_file}: {key} is missing")
    for key, (fits, what) in TRAINER_FIELDS.items():
        if key in state and not fits(state[key]):
            found = json.dumps(state[key])
            raise CheckpointError(f"{state_file}: {key} must be {what}, found {found[:40]}{'...' * (len(found) > 40)}")
    return state


def rng_state() -> dict:
    """This process's Python, NumPy and torch RNG states, as JSON."""
    import random

    import numpy as np

    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), position, has_gauss, cached],
        "torch": torch_rng_text(),
    }


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
    set_torch_rng_text(state["torch"])


def torch_rng_text() -> str:
    """torch's CPU generator state as base64 text (JSON has no bytes)."""
    import base64

    import torch

    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def set_torch_rng_text(text: str) -> None:
    import base64

    import torch

    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8))


@contextmanager
def single_process_dcp(single_process: bool) -> Iterator[None]:
    """torch.distributed.checkpoint warns on every save and load made without a process group that it assumes a
    single process — even when told so (`no_dist=True`). That is the intent of a one-rank learner, which forms no
    group, and of `rlpipe export`: there the warning is dropped. With more ranks it would mean a rank working alone,
    so there it stays."""
    with warnings.catch_warnings():
        if single_process:
            warnings.filterwarnings(
                "ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent "
                r"is to (save|load) in a single process",
            )
        yield


def load_tensors(state: dict, directory: str, target: str, single_process: bool = False) -> None:
    """Fill `state` in place from a torch.distributed.checkpoint directory (resharding as needed), or raise a
    one-line CheckpointError saying that it does not fit `target` (DCP wraps each rank's failure in a long report,
    and in a BaseException: see `_cause`). Nothing in the directory is unpickled except through `read_metadata`.
    `single_process`: this process loads on its own (see single_process_dcp)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_metadata(directory)  # a foreign or broken .metadata is refused in one line before DCP reads it again
    try:
        with single_process_dcp(single_process):
            dcp.load(state, storage_reader=_safe_reader(directory))
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"checkpoint {directory}: does not fit {target} ({_cause(err)})") from None


def model_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """The shape of every model weight in a learner-state directory, under the model's own names, from its metadata
    alone (no tensor is read)."""
    metadata = read_metadata(directory).state_dict_metadata
    return {name[len("model.") :]: tuple(item.size) for name, item in metadata.items() if name.startswith("model.")}


def check_fits(path: Path, shapes: dict[str, tuple[int, ...]], model: str) -> None:
    """Refuse a checkpoint whose model weights, as its metadata lists them, are not exactly `shapes` (or, for a
    checkpoint of LoRA adapters, that do not fit weights of `shapes`): another model's, found before any tensor is
    read."""
    from rlpipe.training.lora import adapter_shapes_problem
    from rlpipe.models.hf import shape_mismatch

    stored = model_shapes(path / LEARNER_STATE)
    if holds_adapters(stored):
        problem = adapter_shapes_problem(shapes, stored)
    else:
        problem = shape_mismatch(shapes, stored)
    if problem:
        raise CheckpointError(f"checkpoint {path}: its weights do not fit {model}: {problem}")


def holds_adapters(stored: dict[str, tuple[int, ...]]) -> bool:
    """Whether a checkpoint's model weights (`model_shapes`) are LoRA adapters alone."""
    from rlpipe.training.lora import is_adapter_key

    return bool(stored) and all(map(is_adapter_key, stored))


def check_trains_alike(path: Path, lora: bool) -> None:
    """Refuse to resume a checkpoint of LoRA adapters in a run that trains every parameter (`lora` False), or the
    reverse."""
    adapters = holds_adapters(model_shapes(path / LEARNER_STATE))
    if adapters != lora:
        held, wanted = ("LoRA adapters", "set") if adapters else ("whole weights", "null")
        raise CheckpointError(f"checkpoint {path}: it holds {held}; learner.lora must be {wanted} to resume from it")


def read_metadata(directory: str | os.PathLike):
    """The `.metadata` of a torch.distributed.checkpoint directory. DCP stores it as a pickle, which could run any
    code while loading; it is unpickled here admitting only the types DCP writes there for a state of tensors
    (`_METADATA_GLOBALS`), and it must list tensors only, in files inside the directory. Raises a one-line
    CheckpointError for anything else."""
    path = Path(directory) / ".metadata"
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except _ForeignGlobal as err:
        raise CheckpointError(f"checkpoint {directory}: refusing to load {path.name}: {err}") from None
    except OSError as err:
        raise CheckpointError(f"checkpoint {directory}: {path.name} is unreadable ({err.strerror})") from None
    except Exception as err:  # a damaged pickle fails with any of several types
        reason = f"{type(err).__name__}: {one_line(err)}"
        raise CheckpointError(f"checkpoint {directory}: {path.name} is unreadable ({reason})") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise CheckpointError(f"checkpoint {directory}: refusing to load {path.name}: {problem}")
    return metadata


def _metadata_problem(metadata) -> str | None:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        return "it is not torch.distributed.checkpoint metadata"
    entries = metadata.state_dict_metadata.values()
    if not all(isinstance(item, TensorStorageMetadata) and isinstance(item.size, torch.Size) for item in entries):
        return "it lists entries that are not tensors"  # DCP would read those with torch.load(weights_only=False)
    files = metadata.storage_data.values() if isinstance(metadata.storage_data, dict) else [None]
    if not all(isinstance(info, _StorageInfo) and _is_plain_file_name(info.relative_path) for info in files):
        return "its storage entries name files outside the checkpoint"
    return None


def _is_plain_file_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name


class _ForeignGlobal(pickle.UnpicklingError):
    """A pickle names something that the metadata of an rlpipe checkpoint never holds."""


# What the `.metadata` pickle of a state of tensors refers to (torch 2.9 and 2.13 write the same), besides torch
# dtypes: DCP's metadata dataclasses, torch.Size, torch's layout lookup, and the saved path. Each is a plain value
# type whose construction runs no code a checkpoint could choose.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),  # where Python 3.13 defines it
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what `_METADATA_GLOBALS` lists and torch dtypes; any other global stops the load."""

    def find_class(self, module: str, name: str):
        import torch

        is_dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise _ForeignGlobal(
            f"it refers to {module}.{name}, which the metadata of an rlpipe checkpoint never holds (a pickle from "
            "elsewhere can run code when loaded)"
        )


def _safe_reader(directory: str):
    """DCP's file-system reader, its metadata read by `read_metadata` instead of `pickle.load`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata files, which rlpipe never writes
                raise CheckpointError(f"checkpoint {directory}: per-rank metadata is not read")
            metadata = read_metadata(directory)
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(directory)


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    root = Path(run_dir) / CHECKPOINTS
    return sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []


def _prune(root: Path, keep: int, newest: str) -> None:
    """Best effort: the new checkpoint is published already, and an old one left behind is pruned by the next save."""
    complete = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in complete[: max(0, len(complete) - keep)]:
        if old.name != newest:
            # Renamed first, so a deletion cut short never leaves a half-deleted directory under a checkpoint's name.
            doomed = root / f"{_DELETING}{old.name}"
            try:
                os.rename(old, doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)


def _write_durably(path: Path, text: str) -> None:
    """Write `path` so that it is either absent/old or complete: temporary file, fsync, rename, fsync dir."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync(path.parent)


def _restore(path: Path, text: str | None) -> None:
    """Put back a small file's earlier content (None: it did not exist)."""
    if text is None:
        path.unlink(missing_ok=True)
    elif not path.is_file() or path.read_text() != text:
        temporary = path.with_name(f".{path.name}.restore")
        temporary.write_text(text)
        os.replace(temporary, path)


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def export(path: str | os.PathLike, out_dir: str | os.PathLike, merge: bool = False) -> Path:
    """Write a checkpoint's weights as a Hugging Face folder (safetensors, config, tokenizer, generation config),
    whatever number of ranks saved it. The model's architecture and tokenizer come from the folders the run's
    `model.path` and `model.tokenizer` resolved to (recorded in the checkpoint; a Hub id's cached snapshot).
    A checkpoint of LoRA adapters is written as a PEFT adapter folder for that base, or with `merge` as a Hugging
    Face folder of the base with the adapters merged in."""
    import torch

    from rlpipe.config import ConfigError
    from rlpipe.models import read_hf_config, save_state_dict
    from rlpipe.models.builtin import resolve_model_path
    from rlpipe.models.checks import ModelFileError
    from rlpipe.models.hf import check_weights

    source = resolve(path)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise CheckpointError(f"export: {out_dir} already exists; it is not overwritten")
    trainer = read_trainer_state(source, needs=EXPORT_FIELDS)
    model_cfg = trainer["config"]["model"]

    def folder(recorded: str | None, given: str | None, key: str) -> str | None:
        """The folder the run resolved `key` to, as the checkpoint records it; else (an older checkpoint, a folder
        since removed) `key` resolved again."""
        if recorded and Path(recorded).is_dir():
            return recorded
        try:
            found = resolve_model_path(given, key) if given else None
        except ConfigError as err:
            raise CheckpointError(f"checkpoint {source}: {err}") from None
        if found is not None and not Path(found).is_dir():
            what = "is a file" if Path(found).exists() else "does not exist"
            named = f"{recorded} and {key} {given}" if recorded and recorded != found else f"{key} {given}"
            raise CheckpointError(f"{source / TRAINER_STATE}: the model folder it names ({named}) {what}")
        return found

    model_path = folder(trainer.get("model_path"), model_cfg["path"], "model.path")
    tokenizer_path = folder(trainer.get("tokenizer_path"), model_cfg["tokenizer"], "model.tokenizer")
    # The model folder and the checkpoint's metadata are checked against each other before any tensor is made.
    try:
        shapes = check_weights(model_path)
    except ModelFileError as err:
        raise CheckpointError(str(err)) from None
    check_fits(source, shapes, model_path)
    stored = model_shapes(source / LEARNER_STATE)
    adapters = holds_adapters(stored)
    wanted = stored if adapters else shapes
    state = {f"model.{name}": torch.empty(shape, dtype=torch.float32) for name, shape in wanted.items()}
    load_tensors(state, str(source / LEARNER_STATE), model_path, single_process=True)
    weights = {name[len("model.") :]: tensor for name, tensor in state.items()}
    if adapters:
        return _export_adapters(source, trainer, weights, model_path, tokenizer_path or model_path, out_dir, merge)
    return save_state_dict(weights, read_hf_config(model_path), out_dir, source_dir=tokenizer_path or model_path)


def _export_adapters(
    source: Path, trainer: dict, adapters: dict, model_path: str, tokenizer_path: str, out_dir: Path, merge: bool
) -> Path:
    """A LoRA checkpoint's adapters as a PEFT adapter folder, or merged into the base as a Hugging Face folder."""
    import torch

    from rlpipe.config.coerce import build
    from rlpipe.config.errors import ConfigError
    from rlpipe.config.learner import LoraConfig
    from rlpipe.training.lora import merged, save_adapter, scaling
    from rlpipe.models import read_hf_config, save_state_dict
    from rlpipe.models.hf import load_model_weights

    recorded = trainer["config"].get("learner", {}).get("lora")
    try:
        lora = build(LoraConfig, recorded, "learner.lora")
        lora.check()
    except (ConfigError, TypeError):
        raise CheckpointError(f"{source / TRAINER_STATE}: the checkpoint holds LoRA adapters but its config has no "
                              f"valid learner.lora ({json.dumps(recorded)[:60]})") from None
    if not merge:
        return save_adapter(adapters, lora, model_path, out_dir)
    base = load_model_weights(model_path, torch.float32)
    return save_state_dict(merged({**base, **adapters}, scaling(lora)), read_hf_config(model_path), out_dir,
                           source_dir=tokenizer_path)
