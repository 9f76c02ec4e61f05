"""Malformed model files and checkpoints through the real CLI: `rlpipe plan`, `rlpipe train` (its start-up model
check, and `--resume`) and `rlpipe export`. Each case breaks one file of an input that passes (see the controls at
the end) and must stop with exit code 2 and one stderr line `rlpipe: ...` naming the file and what is wrong in it,
with no traceback, before anything is written. A count such as a million layers is refused from config.json alone,
so it never gets to build anything that size.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rlpipe.cli import main
# tripwire is autouse: here too it stops a case whose input slips through before Ray starts
from tests.unit.test_bad_input import GOOD_ROWS as ROWS, ReachedRay, tripwire  # noqa: F401

RUN_NAME = "bad-model-files"


# ---------------------------------------------------------------- how files are broken


def edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))


def edit_header(file: Path, change) -> None:
    """Rewrite a safetensors file's header through `change(header)`, its tensor data as it was."""
    data = file.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    change(header)
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def replace_tensor(file: Path, name: str, tensor) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})


def write_index(model: Path, weight_map: dict[str, str]) -> None:
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def stored_names(model: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(model / "model.safetensors", framework="pt") as tensors:
        return list(tensors.keys())


# ---------------------------------------------------------------- the model-folder corpus: name -> (break, expected)
# `expected` are substrings of the one error line; CONFIG_CASES break config.json alone (what `rlpipe plan` reads).

CONFIG_CASES = {
    "heads_zero": (lambda m: edit_config(m, num_attention_heads=0), ["config.json: num_attention_heads is 0, must be at least 1"]),
    "layers_a_million_as_a_float": (
        lambda m: edit_config(m, num_hidden_layers=1e6),
        ["config.json: num_hidden_layers must be an integer, found a number 1000000.0"],
    ),
    "layers_a_million": (
        lambda m: edit_config(m, num_hidden_layers=10**6),
        ["config.json: num_hidden_layers is 1000000, must be at most 1024"],
    ),
    "hidden_not_a_multiple_of_heads": (
        lambda m: edit_config(m, model_type="llama", num_attention_heads=3, num_key_value_heads=...),
        ["config.json: hidden_size (64) must be a multiple of num_attention_heads (3)"],
    ),
    "kv_heads_not_dividing_heads": (
        lambda m: edit_config(m, num_key_value_heads=3),
        ["config.json: num_key_value_heads (3) must divide num_attention_heads (4)"],
    ),
    "vocab_negative": (lambda m: edit_config(m, vocab_size=-5), ["config.json: vocab_size is -5, must be at least 1"]),
    "size_as_a_string": (
        lambda m: edit_config(m, hidden_size="64"), ['config.json: hidden_size must be an integer, found a string "64"']
    ),
    "intermediate_zero": (lambda m: edit_config(m, intermediate_size=0), ["config.json: intermediate_size is 0"]),
    "vocab_missing": (lambda m: edit_config(m, vocab_size=...), ["config.json: vocab_size is missing"]),
    "eps_zero": (lambda m: edit_config(m, rms_norm_eps=0), ["config.json: rms_norm_eps is 0, must be > 0"]),
    "rope_theta_negative": (lambda m: edit_config(m, rope_theta=-1.0), ["config.json: rope_theta is -1.0, must be > 0"]),
    "rope_factors_crossed": (
        lambda m: edit_config(m, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                               "high_freq_factor": 1.0, "original_max_position_embeddings": 128}),
        ["config.json: rope_scaling.low_freq_factor (4.0) must be below high_freq_factor (1.0)"],
    ),
    "tied_flag_as_a_string": (
        lambda m: edit_config(m, tie_word_embeddings="yes"), ["config.json: tie_word_embeddings must be true or false"]
    ),
    "more_experts_per_token_than_experts": (
        lambda m: edit_config(m, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=9, moe_intermediate_size=64),
        ["config.json: num_experts_per_tok is 9, must be at most 4"],
    ),
    "a_billion_experts": (
        lambda m: edit_config(m, model_type="qwen3_moe", num_experts=10**9),
        ["config.json: num_experts is 1000000000, must be at most 4096"],
    ),
    "config_a_list": (lambda m: (m / "config.json").write_text("[1, 2]"), ["config.json: must hold a JSON object"]),
}


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-100])


def _header_longer_than_file(file: Path) -> None:
    file.write_bytes(struct.pack("<Q", 10**12) + file.read_bytes()[8:])


def _index_with_missing_shard(model: Path) -> None:
    names = stored_names(model)
    write_index(model, {**dict.fromkeys(names[1:], "model.safetensors"), names[0]: "model-00002-of-00002.safetensors"})


def _index_naming_absent_tensor(model: Path) -> None:
    write_index(model, {**dict.fromkeys(stored_names(model), "model.safetensors"), "model.extra.weight": "model.safetensors"})


def link_out(model: Path, name: str, target: Path | None = None) -> None:
    """`name` in the model folder made a link to `target` outside it (a host file, another user's file); without
    `target`, to the file itself moved out, whose content then passes every other check."""
    if target is None:
        target = model.parent / f"outside-{name.replace('/', '-')}"
        (model / name).rename(target)
    else:
        (model / name).unlink(missing_ok=True)
    (model / name).symlink_to(target)


def _host_file(model: Path) -> Path:
    secret = model.parent / "host-secret.txt"
    secret.write_text("host-secret")
    return secret


def _templates_folder_outside(model: Path, file_linked: bool) -> None:
    """additional_chat_templates/ with one template, linked out itself or holding a link out."""
    folder = model / "additional_chat_templates"
    folder.mkdir()
    (folder / "tool_use.jinja").write_text("{{ messages[0]['content'] }}")
    link_out(model, "additional_chat_templates/tool_use.jinja" if file_linked else "additional_chat_templates")


def _set_dtype(header: dict, dtype: str) -> None:
    header["model.norm.weight"]["dtype"] = dtype


WEIGHT_CASES = {
    "layers_more_than_the_weights_hold": (
        lambda m: edit_config(m, num_hidden_layers=500, layer_types=...),
        ["config.json: num_hidden_layers is 500, the weights hold 2"],
    ),
    "safetensors_truncated": (lambda m: _truncate(m / "model.safetensors"), ["model.safetensors: is not a complete safetensors file: its header describes"]),
    "safetensors_header_longer_than_the_file": (
        lambda m: _header_longer_than_file(m / "model.safetensors"),
        ["model.safetensors: is not a complete safetensors file: its header is 1000000000000 bytes"],
    ),
    "safetensors_garbage": (
        lambda m: (m / "model.safetensors").write_bytes(struct.pack("<Q", 16) + b"not a header!!!!" + b"\0" * 64),
        ["model.safetensors: is not a safetensors file: its header is not JSON"],
    ),
    "safetensors_shorter_than_its_prefix": (
        lambda m: (m / "model.safetensors").write_bytes(b"\1\2\3"), ["model.safetensors: is not a safetensors file"]
    ),
    "index_shard_missing": (
        _index_with_missing_shard,
        ["model.safetensors.index.json: lists shards that are not there: model-00002-of-00002.safetensors"],
    ),
    "index_names_a_tensor_its_shard_lacks": (
        _index_naming_absent_tensor,
        ["model.safetensors.index.json: maps model.extra.weight to model.safetensors, which does not hold it"],
    ),
    "index_not_an_object": (
        lambda m: (m / "model.safetensors.index.json").write_text('"weights"'),
        ["model.safetensors.index.json: must hold a JSON object"],
    ),
    "tensor_with_the_wrong_shape": (
        lambda m: replace_tensor(m / "model.safetensors", "model.norm.weight", __import__("torch").ones(65)),
        ["its weights do not fit its config.json", "model.norm.weight (65,) (expected (64,))"],
    ),
    "tensor_with_an_integer_dtype": (
        lambda m: replace_tensor(m / "model.safetensors", "model.norm.weight", __import__("torch").ones(64, dtype=__import__("torch").int64)),
        ["model.safetensors: model.norm.weight is stored as I64; model weights are floating point"],
    ),
    "tensor_with_an_unknown_dtype": (
        lambda m: edit_header(m / "model.safetensors", lambda h: _set_dtype(h, "C64")),
        ["model.safetensors: model.norm.weight is stored as C64, which rlpipe does not read"],
    ),
    "tensor_bytes_do_not_match_its_shape": (
        lambda m: edit_header(m / "model.safetensors", lambda h: h["model.norm.weight"].update(shape=[32])),
        ["model.safetensors: model.norm.weight spans 256 bytes, its shape [32] in F32 needs 128"],
    ),
}
# Files whose real path leaves the folder: whatever the link names would be read (a host file into every prompt).
LINK_CASES = {
    "chat_template_linked_to_a_host_file": (
        lambda m: link_out(m, "chat_template.jinja", _host_file(m)),
        ["chat_template.jinja: links to", "host-secret.txt, outside the model folder; put the file itself there"],
    ),
    "config_linked_outside": (lambda m: link_out(m, "config.json"), ["config.json: links to", "outside-config.json"]),
    "weights_linked_outside": (lambda m: link_out(m, "model.safetensors"), ["model.safetensors: links to"]),
    "folder_of_chat_templates_linked_outside": (
        lambda m: _templates_folder_outside(m, file_linked=False), ["additional_chat_templates: links to"]
    ),
    "chat_template_in_its_folder_linked_outside": (
        lambda m: _templates_folder_outside(m, file_linked=True),
        ["additional_chat_templates/tool_use.jinja: links to"],
    ),
}
MODEL_CASES = {**CONFIG_CASES, **WEIGHT_CASES, **LINK_CASES}


# ---------------------------------------------------------------- running the CLI


def run_cli(argv: list[str], capfd) -> str:
    """The one stderr line of a refused command (exit code 2, no traceback)."""
    capfd.readouterr()
    code = main(argv)
    out, err = capfd.readouterr()
    assert code == 2, (code, err)
    assert "Traceback" not in err + out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlpipe: "), err
    return lines[0]


def train_args(model: Path, root: Path) -> list[str]:
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return ["train", f"model.path={model}", f"run.output_dir={root / 'runs'}", f"run.name={RUN_NAME}",
            "data.source=file", f"data.path={data}", "data.eval_size=0", "reward.functions=[{name: format_tags}]",
            "metrics.loggers=[jsonl]", "train.steps=1", f"train.prompts_per_step={len(ROWS)}"]


def broken_model(tiny_qwen3: str, tmp_path: Path, case: str) -> tuple[Path, list[str]]:
    import shutil

    model = Path(shutil.copytree(tiny_qwen3, tmp_path / "model"))
    breaks, expected = MODEL_CASES[case]
    breaks(model)
    return model, expected


def save_checkpoint(root: Path, model: Path, **changes) -> Path:
    """A step-1 checkpoint of the tiny model (zeros), as the run above would write it; `changes` edit trainer.json
    (a value of ... removes the key)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rlpipe.training import checkpoint
    from rlpipe.models.hf import check_weights

    path = root / "checkpoint"
    with checkpoint.single_process_dcp(True):
        dcp.save({f"model.{name}": torch.zeros(shape) for name, shape in check_weights(model).items()},
                 checkpoint_id=str(path / checkpoint.LEARNER_STATE), no_dist=True)
    state = {
        "format": checkpoint.FORMAT, "step": 1, "policy_version": 1,
        "sampler": {"size": len(ROWS), "seed": 0, "epoch": 0, "position": 0}, "rng": checkpoint.rng_state(),
        "learner_rng": [checkpoint.torch_rng_text()], "config": {"model": {"path": str(model), "tokenizer": None}},
        "model_path": str(model), "tokenizer_path": None, "metrics": [], "summary": {"eval_before": None},
    }
    state.update(changes)
    (path / checkpoint.TRAINER_STATE).write_text(json.dumps({k: v for k, v in state.items() if v is not ...}))
    return path


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_plan_refuses_a_malformed_config(case, tiny_qwen3, tmp_path, capfd):
    model, expected = broken_model(tiny_qwen3, tmp_path, case)
    line = run_cli(["plan", f"model.path={model}"], capfd)
    assert line.startswith("rlpipe: config error: model.path: ")
    for text in expected:
        assert text in line, (text, line)


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_train_refuses_a_malformed_model_folder(case, tiny_qwen3, tmp_path, capfd):
    model, expected = broken_model(tiny_qwen3, tmp_path, case)
    line = run_cli(train_args(model, tmp_path), capfd)
    assert line.startswith(f"rlpipe: config error: model.path: {model}")
    for text in expected:
        assert text in line, (text, line)
    assert not (tmp_path / "runs").exists()


# export runs the same check as train: a sample of the corpus, one of each kind of file.
EXPORT_MODEL_CASES = ["heads_zero", "layers_a_million", "hidden_not_a_multiple_of_heads", "vocab_negative",
                      "size_as_a_string", "layers_more_than_the_weights_hold", "safetensors_truncated",
                      "safetensors_header_longer_than_the_file", "index_shard_missing", "tensor_with_the_wrong_shape",
                      "tensor_with_an_integer_dtype", "chat_template_linked_to_a_host_file"]


@pytest.mark.parametrize("case", EXPORT_MODEL_CASES)
def test_export_refuses_a_checkpoint_whose_model_folder_is_malformed(case, tiny_qwen3, tmp_path, capfd):
    checkpoint = save_checkpoint(tmp_path, Path(tiny_qwen3))
    model, expected = broken_model(tiny_qwen3, tmp_path, case)
    edit = json.loads((checkpoint / "trainer.json").read_text())
    edit["model_path"] = edit["config"]["model"]["path"] = str(model)
    (checkpoint / "trainer.json").write_text(json.dumps(edit))
    line = run_cli(["export", str(checkpoint), str(tmp_path / "hf")], capfd)
    assert line.startswith(f"rlpipe: {model}")
    for text in expected:
        assert text in line, (text, line)
    assert not (tmp_path / "hf").exists()


def _latest_pointing_outside(checkpoint: Path) -> None:
    (checkpoint / "latest").write_text("../../etc\n")


# trainer.json and the learner state: name -> (changes to trainer.json, or a function of the checkpoint, expected)
CHECKPOINT_CASES = {
    "trainer_json_malformed": (lambda c: (c / "trainer.json").write_text("{step: 1"), ["trainer.json is unreadable"]),
    "trainer_json_a_list": (lambda c: (c / "trainer.json").write_text("[1]"), ["trainer.json: must hold a JSON object"]),
    "step_missing": ({"step": ...}, ["trainer.json: step is missing"]),
    "step_a_string": ({"step": "one"}, ['trainer.json: step must be a step number, found "one"']),
    "sampler_malformed": ({"sampler": {"size": "x"}}, ["trainer.json: sampler must be a sampler state"]),
    "rng_malformed": ({"rng": {"python": 1}}, ["trainer.json: rng must be the Python, NumPy and torch RNG states"]),
    "learner_rng_not_rng_states": ({"learner_rng": ["AAAA"]}, ["trainer.json: learner_rng must be a list of torch"]),
    "metrics_not_a_list": ({"metrics": {"loss": 1}}, ["trainer.json: metrics must be a list of metric records"]),
    "config_without_the_model": ({"config": {"run": {}}}, ["trainer.json: config must be a resolved config"]),
    "latest_pointing_outside": (_latest_pointing_outside, ["latest: names '../../etc', not a checkpoint directory"]),
    "latest_not_text": (lambda c: (c / "latest").write_bytes(b"\xff\xfe"), ["latest: unreadable"]),
    "metadata_truncated": (
        lambda c: (c / "learner" / ".metadata").write_bytes((c / "learner" / ".metadata").read_bytes()[:40]),
        [".metadata is unreadable"],
    ),
}
# Only an export reads these (a resumed run takes its model from model.path).
EXPORT_CASES = {
    "model_path_pointing_at_nothing": (
        lambda c: _set_model(c, c.parent / "no-such-model"), ["the model folder it names", "no-such-model) does not exist"]
    ),
    "model_path_pointing_at_a_file": (
        lambda c: _set_model(c, c / "trainer.json"), ["the model folder it names", "trainer.json) is a file"]
    ),
    "model_path_not_a_string": ({"model_path": 7}, ["trainer.json: model_path must be a folder name or null, found 7"]),
}


def _set_model(checkpoint: Path, model: Path) -> None:
    state = json.loads((checkpoint / "trainer.json").read_text())
    state["model_path"] = state["config"]["model"]["path"] = str(model)
    (checkpoint / "trainer.json").write_text(json.dumps(state))


def broken_checkpoint(tiny_qwen3: str, tmp_path: Path, cases: dict, case: str) -> tuple[Path, list[str]]:
    change, expected = cases[case]
    if callable(change):
        path = save_checkpoint(tmp_path, Path(tiny_qwen3))
        change(path)
    else:
        path = save_checkpoint(tmp_path, Path(tiny_qwen3), **change)
    return path, expected


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_resume_refuses_a_malformed_checkpoint(case, tiny_qwen3, tmp_path, capfd):
    path, expected = broken_checkpoint(tiny_qwen3, tmp_path, CHECKPOINT_CASES, case)
    line = run_cli([*train_args(Path(tiny_qwen3), tmp_path), "--resume", str(path)], capfd)
    for text in expected:
        assert text in line, (text, line)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", [c for c in {**CHECKPOINT_CASES, **EXPORT_CASES} if not c.startswith(("step", "sampler", "rng", "learner_rng", "metrics"))])
def test_export_refuses_a_malformed_checkpoint(case, tiny_qwen3, tmp_path, capfd):
    path, expected = broken_checkpoint(tiny_qwen3, tmp_path, {**CHECKPOINT_CASES, **EXPORT_CASES}, case)
    line = run_cli(["export", str(path), str(tmp_path / "hf")], capfd)
    for text in expected:
        assert text in line, (text, line)
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- the controls: unbroken, each input gets through


def test_the_unbroken_inputs_pass(tiny_qwen3, tmp_path, capfd):
    """The model folder and checkpoint the cases start from pass every check: plan runs, train reaches Ray (the
    tripwire), resuming reaches Ray, export writes the checkpoint's weights."""
    from safetensors.torch import load_file

    model = Path(tiny_qwen3)
    assert main(["plan", f"model.path={model}"]) in (0, 1)  # a verdict, whichever it is
    with pytest.raises(ReachedRay):
        main(train_args(model, tmp_path))
    path = save_checkpoint(tmp_path, model)
    with pytest.raises(ReachedRay):
        main([*train_args(model, tmp_path), "--resume", str(path)])
    assert main(["export", str(path), str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported and all(not tensor.any() for tensor in exported.values())  # the checkpoint's zeros
    assert "Traceback" not in capfd.readouterr().err
