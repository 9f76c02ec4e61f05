"""Model files checked before anything is built or read from them: that each lies inside the folder, config.json's
fields, the safetensors headers and the shard index, and the two against each other.

Every problem raises a ModelFileError whose message is one line, `<file>: <what>`. Nothing here allocates a
tensor or reads tensor data: config.json is checked field by field before a model (even on `meta`) is built from
it, and a safetensors file is judged by its header alone, whose stated length is compared with the file's size
before it is read.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
PICKLE_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
# Folders of a model folder whose files are read too: transformers reads the chat templates kept there.
READ_SUBFOLDERS = ("additional_chat_templates",)

# Far beyond any released model (the deepest Llama has 126 layers, the widest MoE a few hundred experts), and small
# enough that building the module tree or walking the layers stays quick.
MAX_LAYERS = 1024
MAX_EXPERTS = 4096
MAX_SIZE = 2**31 - 1  # one dimension of a weight, as torch's int32 kernels index it
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses a larger header
# safetensors' dtype names -> bytes an element; the ones rlpipe reads (see hf.py) are a subset.
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
FLOATING_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_NAME = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


class ModelFileError(ValueError):
    """A model file that cannot be used; the message is `<file>: <what>`."""

    def __init__(self, file: str | os.PathLike, what: str):
        super().__init__(f"{file}: {what}")


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, from its header: where its bytes start in the file, its dtype, its shape."""

    file: Path
    start: int
    dtype: str
    shape: tuple[int, ...]


# ---------------------------------------------------------------- links


def check_links(folder: str | os.PathLike) -> None:
    """Every file of a model folder (and of its READ_SUBFOLDERS) lies inside it once links are followed: a file
    linked to one outside (`chat_template.jinja` -> a host file) would put that file into every reader's hands, the
    tokenizer's chat template into every prompt. The one exception is Hugging Face's cache, whose snapshot folders
    link each file to its repository's blobs folder. Raises ModelFileError naming the file."""
    folder = Path(folder)
    real = Path(os.path.realpath(folder))
    inside = [real, *([real.parent.parent / "blobs"] if real.parent.name == "snapshots" else [])]
    for entry in _entries(folder):
        target = Path(os.path.realpath(entry))
        if not any(target == root or root in target.parents for root in inside):
            raise ModelFileError(entry, f"links to {target}, outside the model folder; put the file itself there")


def _entries(folder: Path) -> list[Path]:
    """The folder's entries, then those of its READ_SUBFOLDERS (each listed after the subfolder itself)."""
    try:
        entries = sorted(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):  # the caller says what the folder is not
        return []
    except OSError as err:
        raise ModelFileError(folder, f"unreadable ({err.strerror})") from None
    for name in READ_SUBFOLDERS:
        if (folder / name).is_dir():
            entries += sorted((folder / name).iterdir())
    return entries


# ---------------------------------------------------------------- config.json


def read_config(folder: str | os.PathLike) -> dict:
    """The config.json of a Hugging Face model folder, its files first checked to lie inside it (`check_links`),
    its fields checked (`check_config`)."""
    folder = Path(folder)
    config_file = folder / CONFIG_FILE
    if folder.is_file():
        raise ModelFileError(folder, "is a file, not a Hugging Face model folder")
    check_links(folder)
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ModelFileError(config_file, f"not found: {folder} is not a Hugging Face model folder") from None
    except OSError as err:
        raise ModelFileError(config_file, f"unreadable ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFileError(config_file, f"is not valid JSON ({err})") from None
    check_config(config, config_file)
    return config


def check_config(config, file: str | os.PathLike):
    """Check a config.json dict's fields (present, of the right type, in range, consistent) and return the
    architecture rlpipe reads from it. Raises ModelFileError naming `file` and the field."""
    from rlpipe.models.registry import model_architecture

    if not isinstance(config, dict):
        raise ModelFileError(file, f"must hold a JSON object, found {_json_type(config)}")
    _check_fields(config, file)
    try:
        return model_architecture(config)
    except (ValueError, TypeError, ArithmeticError) as err:
        raise ModelFileError(file, str(err)) from None


def _check_fields(config: dict, file) -> None:
    from rlpipe.models.registry import model_type_of

    def problem(what: str) -> ModelFileError:
        return ModelFileError(file, what)

    def integer(key: str, low: int = 1, high: int = MAX_SIZE, required: bool = True) -> int | None:
        value = config.get(key)
        if value is None:
            if required:
                raise problem(f"{key} is missing")
            return None
        if not _is_int(value):
            raise problem(f"{key} must be an integer, found {_json_value(value)}")
        if value < low:
            raise problem(f"{key} is {value}, must be at least {low}")
        if value > high:
            raise problem(f"{key} is {value}, must be at most {high}")
        return value

    def number(key: str, value, low: float = 0.0, high: float = math.inf, low_open: bool = True) -> None:
        if value is None:
            return
        if not _is_number(value) or not math.isfinite(value):
            raise problem(f"{key} must be a finite number, found {_json_value(value)}")
        if value < low or (low_open and value == low) or value > high:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            raise problem(f"{key} is {value!r}, must be {bound}" + (f" and <= {high:g}" if high < math.inf else ""))

    def typed(key: str, kind: type | tuple[type, ...], name: str) -> None:
        value = config.get(key)
        if value is not None and not isinstance(value, kind):
            raise problem(f"{key} must be {name}, found {_json_value(value)}")

    for key in ("model_type", "hidden_act", "dtype", "torch_dtype"):
        typed(key, str, "a string")
    architectures = config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(name, str) for name in architectures)
    ):
        raise problem(f"architectures must be a list of strings, found {_json_value(architectures)}")
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "norm_topk_prob",
                "output_router_logits"):
        typed(key, bool, "true or false")

    # rlpipe's own families name their sizes as Llama does; another family may name them its own way (GPT-2's n_embd,
    # XGLM's d_model), which its transformers config class reads: checked here where present.
    from rlpipe.models.registry import MODEL_BUILDERS

    model_type = model_type_of(config)
    own = model_type in MODEL_BUILDERS
    integer("vocab_size", required=own)
    hidden = integer("hidden_size", required=own)
    integer("intermediate_size", required=own)
    layers = integer("num_hidden_layers", high=MAX_LAYERS, required=own)
    heads = integer("num_attention_heads", required=own)
    head_dim = integer("head_dim", required=False)
    # head_dim defaults to hidden_size / heads (Qwen3: to 128), and transformers' Llama requires the division always.
    if hidden and heads and hidden % heads and ((head_dim is None and model_type != "qwen3") or model_type == "llama"):
        raise problem(f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads})")
    kv_heads = integer("num_key_value_heads", required=False, high=heads or MAX_SIZE)
    if kv_heads and heads and heads % kv_heads:
        raise problem(f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
    integer("max_position_embeddings", required=False)
    integer("sliding_window", low=0, required=False)  # 0 and null both mean no window
    integer("max_window_layers", low=0, required=False)
    number("rms_norm_eps", config.get("rms_norm_eps"), high=1.0)
    number("initializer_range", config.get("initializer_range"), low_open=False)
    number("router_aux_loss_coef", config.get("router_aux_loss_coef"), low_open=False)
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or not all(isinstance(kind, str) for kind in layer_types):
            raise problem(f"layer_types must be a list of strings, found {_json_value(layer_types)}")
        if layers is not None and len(layer_types) != layers:
            raise problem(f"layer_types has {len(layer_types)} entries for num_hidden_layers {layers}")
    _check_rope(config, problem, number)

    experts_key = "num_experts" if config.get("num_experts") is not None else "num_local_experts"
    experts = integer(experts_key, low=0, high=MAX_EXPERTS, required=False)
    if experts:
        integer("num_experts_per_tok", high=experts, required=False)
        integer("moe_intermediate_size", required=False)
    integer("decoder_sparse_step", required=False)
    only_dense = config.get("mlp_only_layers")
    if only_dense is not None and not (
        isinstance(only_dense, list) and all(_is_int(index) and 0 <= index < layers for index in only_dense)
    ):
        raise problem(f"mlp_only_layers must be a list of layer indices below {layers}, found {_json_value(only_dense)}")


def _check_rope(config: dict, problem, number) -> None:
    number("rope_theta", config.get("rope_theta"))
    for key in ("rope_scaling", "rope_parameters"):
        parameters = config.get(key)
        if parameters is None:
            continue
        if not isinstance(parameters, dict):
            raise problem(f"{key} must be a JSON object, found {_json_value(parameters)}")
        for name in ("rope_type", "type"):
            if parameters.get(name) is not None and not isinstance(parameters[name], str):
                raise problem(f"{key}.{name} must be a string, found {_json_value(parameters[name])}")
        number(f"{key}.rope_theta", parameters.get("rope_theta"))
        number(f"{key}.factor", parameters.get("factor"))
        for name in ("low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow"):
            number(f"{key}.{name}", parameters.get(name))
        for name in ("mscale", "mscale_all_dim", "partial_rotary_factor"):
            number(f"{key}.{name}", parameters.get(name), low_open=False)
        original = parameters.get("original_max_position_embeddings")
        if original is not None and (not _is_int(original) or original < 1):
            raise problem(f"{key}.original_max_position_embeddings must be a positive integer, found "
                          f"{_json_value(original)}")
        low, high = parameters.get("low_freq_factor"), parameters.get("high_freq_factor")
        if low is not None and high is not None and not low < high:
            raise problem(f"{key}.low_freq_factor ({low}) must be below high_freq_factor ({high})")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _json_value(value) -> str:
    text = json.dumps(value)
    return f"{_json_type(value)} {text if len(text) <= 40 else text[:37] + '...'}"


# ---------------------------------------------------------------- safetensors files


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    """The folder's safetensors files: the shards its index names (each a plain file name, each present), else its
    single model.safetensors."""
    folder = Path(folder)
    index_file = folder / SAFETENSORS_INDEX_FILE
    if index_file.is_file():
        return sorted(set(read_index(index_file).values()))
    if (folder / SAFETENSORS_FILE).is_file():
        return [folder / SAFETENSORS_FILE]
    if not folder.is_dir():
        raise ModelFileError(folder, "not a directory")
    pickled = sorted(file.name for pattern in PICKLE_WEIGHT_PATTERNS for file in folder.glob(pattern))
    if pickled:
        raise ModelFileError(
            folder,
            f"has only pickle weights ({', '.join(pickled[:3])}); safetensors is required because pickle "
            f"files can run code when loaded. Convert once with transformers: "
            f"AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder)",
        )
    raise ModelFileError(folder, f"has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX_FILE}")


def read_index(index_file: Path) -> dict[str, Path]:
    """A shard index's weight map, tensor name -> shard file, every shard a file beside the index."""
    try:
        index = json.loads(index_file.read_text())
    except OSError as err:
        raise ModelFileError(index_file, f"unreadable ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFileError(index_file, f"is not valid JSON ({err})") from None
    if not isinstance(index, dict):
        raise ModelFileError(index_file, f"must hold a JSON object, found {_json_type(index)}")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFileError(index_file, f"weight_map must be a non-empty object, found {_json_value(weight_map)}")
    shards: dict[str, Path] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or shard in ("", ".", "..") or "/" in shard or os.sep in shard:
            raise ModelFileError(index_file, f"weight_map[{name!r}] must name a file beside the index, "
                                             f"found {_json_value(shard)}")
        shards[name] = index_file.parent / shard
    missing = sorted({path.name for path in shards.values() if not path.is_file()})
    if missing:
        raise ModelFileError(index_file, f"lists shards that are not there: {', '.join(missing[:3])}")
    return shards


def read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, from its header, which is checked as safetensors checks it (a known
    dtype, a shape and a byte range each, the ranges tiling the data exactly) against the file's real size."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
            if length is None:
                raise ModelFileError(file, f"is not a safetensors file ({size} bytes, shorter than its 8-byte prefix)")
            if length > size - 8:
                raise ModelFileError(
                    file, f"is not a complete safetensors file: its header is {length} bytes, the file {size} bytes"
                )
            if length > MAX_HEADER_BYTES:
                raise ModelFileError(file, f"safetensors header of {length} bytes is larger than safetensors allows")
            raw = handle.read(length)
    except OSError as err:
        raise ModelFileError(file, f"unreadable ({err.strerror})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelFileError(file, "is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ModelFileError(file, f"is not a safetensors file: its header is {_json_type(header)}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values())
    ):
        raise ModelFileError(file, "safetensors __metadata__ must map names to strings")
    data_start, data_bytes = 8 + length, size - 8 - length
    tensors: dict[str, StoredTensor] = {}
    spans = []
    for name, entry in header.items():
        dtype, shape, offsets = _header_entry(file, name, entry)
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise ModelFileError(file, f"{name} is stored as {dtype}, which rlpipe does not read")
        needed = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
        if offsets[1] - offsets[0] != needed:
            raise ModelFileError(
                file, f"{name} spans {offsets[1] - offsets[0]} bytes, its shape {list(shape)} in {dtype} needs {needed}"
            )
        spans.append((offsets[0], offsets[1], name))
        tensors[name] = StoredTensor(file, data_start + offsets[0], dtype, shape)
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise ModelFileError(file, f"{name}'s bytes start at {begin}, expected {position} (gap or overlap)")
        position = end
    if position != data_bytes:
        what = "is not a complete safetensors file" if position > data_bytes else "has bytes past its last tensor"
        raise ModelFileError(
            file, f"{what}: its header describes {position} bytes of tensor data, the file holds {data_bytes}"
        )
    return tensors


def _header_entry(file: Path, name: str, entry) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    if not isinstance(entry, dict):
        raise ModelFileError(file, f"safetensors header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise ModelFileError(file, f"{name} has no dtype in the safetensors header")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise ModelFileError(file, f"{name}'s shape must be a list of sizes, found {_json_value(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(n) for n in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ModelFileError(file, f"{name}'s data_offsets must be [begin, end], found {_json_value(offsets)}")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def stored_tensors(folder: str | os.PathLike) -> dict[str, StoredTensor]:
    """Every tensor in the folder's safetensors files, from their checked headers; with an index, every tensor it
    names is in the shard it names, and no tensor is in two files."""
    folder = Path(folder)
    index_file = folder / SAFETENSORS_INDEX_FILE
    weight_map = read_index(index_file) if index_file.is_file() else None
    tensors: dict[str, StoredTensor] = {}
    for file in safetensors_files(folder):
        for name, tensor in read_header(file).items():
            if name in tensors:
                raise ModelFileError(file, f"{name} is also in {tensors[name].file.name}")
            tensors[name] = tensor
    for name, shard in (weight_map or {}).items():
        if name not in tensors or tensors[name].file != shard:
            raise ModelFileError(index_file, f"maps {name} to {shard.name}, which does not hold it")
    return tensors


def check_stored_against_config(architecture, tensors: dict[str, StoredTensor], folder: Path) -> None:
    """What can be compared before a model is built: the layers and experts the files hold against config.json's
    counts (a wrong count would otherwise build a model of that size first), and the weights' dtypes."""
    config_file = folder / CONFIG_FILE
    layers = {int(match.group(1)) for name in tensors if (match := _LAYER_NAME.match(name))}
    held = max(layers) + 1 if layers else 0
    # A family on transformers' code may name its layers its own way; its weights are compared name by name with
    # the model built on `meta` instead.
    if architecture.implementation == "rlpipe" and held != architecture.num_layers:
        raise ModelFileError(config_file, f"num_hidden_layers is {architecture.num_layers}, the weights hold "
                                          f"{held} layer(s)")
    experts = {int(match.group(1)) for name in tensors if (match := _EXPERT_NAME.match(name))}
    if experts and architecture.num_experts and max(experts) + 1 != architecture.num_experts:
        raise ModelFileError(
            config_file, f"the model has {architecture.num_experts} experts a layer, the weights hold {max(experts) + 1}"
        )
    for name, tensor in tensors.items():
        if tensor.dtype not in FLOATING_DTYPES:
            raise ModelFileError(tensor.file, f"{name} is stored as {tensor.dtype}; model weights are floating point")
