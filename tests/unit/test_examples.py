"""The examples: GSM8K data preparation (examples/gsm8k), an installable reward package (examples/reward_package) and
the TRL-to-rlpipe mapping (examples/trl_grpo), each checked against rlpipe's own config, data loader and reward pool.

The examples use rlpipe's public surface only (config keys, the reward contract, the entry-point group): nothing in
examples/ imports rlpipe."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlpipe.config import describe, load_config
from rlpipe.data.prompts import PromptSet, load_rows, reward_columns
from rlpipe.rewards import RewardRunner
from tests.conftest import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PREPARE = EXAMPLES / "gsm8k" / "prepare.py"
GSM8K_RECIPE = EXAMPLES / "gsm8k" / "recipe.yaml"
TRL_DIR = EXAMPLES / "trl_grpo"
TRL_RECIPE = TRL_DIR / "recipe.yaml"
TRL_PAGE = TRL_DIR / "README.md"

# Rows of GSM8K's train and test splits, in its schema (question; answer: worked solution, then `#### N`).
GSM8K_TRAIN = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
                 "many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
               "in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much "
                 "did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it "
                 "take?",
     "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 bolts of "
               "fabric\n#### 3"},
]
GSM8K_TEST = [
    {"question": "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
                 "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 per "
                 "fresh duck egg. How much in dollars does she make every day at the farmers' market?",
     "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day at "
               "the farmer\u2019s market.\n#### 18"},
    {"question": "A shop sells 30 pens a day for 40 days. How many pens does it sell?",
     "answer": "It sells 30 * 40 = <<30*40=1200>>1200 pens.\n#### 1,200"},
]


def score_with_recipe(cfg, train: list[dict], completions: list[str]):
    """The recipe's reward functions on `completions`, each answering the first training row."""
    runner = RewardRunner([dataclasses.asdict(f) for f in cfg.reward.functions], cfg.reward.timeout_s,
                          columns=reward_columns(train, cfg.data.prompt_field))
    rows = [train[0]] * len(completions)
    return runner.score([r["prompt"] for r in rows], completions, batch_columns(rows, completions, "prompt"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def gsm8k_folder(folder: Path) -> Path:
    write_jsonl(folder / "train.jsonl", GSM8K_TRAIN)
    write_jsonl(folder / "test.jsonl", GSM8K_TEST)
    return folder


def run_prepare(*args) -> subprocess.CompletedProcess:
    """prepare.py as a user runs it: its own process, no PYTHONPATH to rlpipe needed."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(PREPARE), *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def prepare_module():
    spec = importlib.util.spec_from_file_location("gsm8k_prepare", PREPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def batch_columns(rows: list[dict], completions: list[str], prompt_field: str) -> dict[str, list]:
    """The columns the reward pool passes with a batch: the rows' own (but the prompt) and its per-sample ones."""
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != prompt_field}
    columns.update(completion_tokens=[len(c.split()) for c in completions], finish_reason=["stop"] * len(completions),
                   max_tokens=[64] * len(completions))
    return columns


# ---------------------------------------------------------------- examples/gsm8k


def test_gsm8k_prepare_writes_chat_splits_that_the_example_recipe_reads(tmp_path, tokenizer, prepare_module):
    out = tmp_path / "gsm8k-chat"
    done = run_prepare(gsm8k_folder(tmp_path / "gsm8k"), "--out", out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"train: 3 rows -> {out}/train.parquet, test: 2 rows -> {out}/test.parquet"
    assert sorted(p.name for p in out.iterdir()) == ["test.parquet", "train.parquet"]

    # rlpipe's loader, with the example recipe's data settings: train rows from train.parquet, held-out from test.
    cfg = load_config(GSM8K_RECIPE, [f"data.path={out}"])
    train, held_out = load_rows(cfg.data, cfg.run.seed)
    assert [row["solution"] for row in train] == ["72", "10", "3"]
    assert [row["solution"] for row in held_out] == ["18", "1200"]  # GSM8K's thousands comma dropped
    assert reward_columns(train, cfg.data.prompt_field) == ["answer", "solution"]
    system = {"role": "system", "content": prepare_module.SYSTEM_PROMPT}
    for row, source in zip(train + held_out, GSM8K_TRAIN + GSM8K_TEST, strict=True):
        assert row["prompt"] == [system, {"role": "user", "content": source["question"]}]
        assert row["answer"] == source["answer"]

    prompt = PromptSet(train, tokenizer, cfg.data).prompt(0)
    assert prompt.messages == train[0]["prompt"]  # the data's own system message, no second one
    assert prompt.columns == {"answer": GSM8K_TRAIN[0]["answer"], "solution": "72"}
    rendered = tokenizer.decode(prompt.token_ids)
    assert rendered.startswith("<|im_start|>system\nSolve the problem") and rendered.endswith("<|im_start|>assistant\n")

    # The recipe's rewards take these columns, and score the format the system prompt asks for.
    result = score_with_recipe(cfg, train, ["48 / 2 = 24 in May, 48 + 24 = 72.\n#### 72", "#### 71", "The answer is 72"])
    assert result.per_function == {"numeric_answer": [1.0, 0.0, 1.0], "format_regex": [1.0, 1.0, 0.0]}


def test_gsm8k_prepare_reads_the_hub_layout_and_one_file(tmp_path, prepare_module, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub = tmp_path / "gsm8k-snapshot"  # as `hf download openai/gsm8k --repo-type dataset` lays it out
    for subset, rows in (("main", GSM8K_TRAIN), ("socratic", GSM8K_TRAIN[:1])):
        (hub / subset).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), hub / subset / "train-00000-of-00001.parquet")
        pq.write_table(pa.Table.from_pylist(GSM8K_TEST), hub / subset / "test-00000-of-00001.parquet")
    assert prepare_module.main([str(hub), "--out", str(tmp_path / "a"), "--format", "jsonl", "--system-prompt", ""]) == 0
    written = [json.loads(line) for line in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    assert [row["solution"] for row in written] == ["72", "10", "3"]  # main, not socratic
    assert written[1]["prompt"] == [{"role": "user", "content": GSM8K_TRAIN[1]["question"]}]

    one_file = write_jsonl(tmp_path / "all.jsonl", GSM8K_TRAIN + GSM8K_TEST)
    assert prepare_module.main([str(one_file), "--out", str(tmp_path / "b"), "--test-size", "2", "--limit", "2"]) == 0
    cfg = load_config(GSM8K_RECIPE, [f"data.path={tmp_path / 'b'}"])
    train, held_out = load_rows(cfg.data, cfg.run.seed)
    assert [row["solution"] for row in train] == ["72", "10"] and [row["solution"] for row in held_out] == ["18", "1200"]
    capsys.readouterr()


@pytest.mark.parametrize("case", ["missing file", "no ####", "no answer field", "nothing after ####", "empty file",
                                  "not json", "no train split"])
def test_gsm8k_prepare_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, prepare_module, capsys, case):
    source = tmp_path / "gsm8k.jsonl"
    rows = [dict(row) for row in GSM8K_TRAIN]
    if case == "missing file":
        source = tmp_path / "missing.jsonl"
    elif case == "no ####":
        rows[1]["answer"] = "Weng earns 12/60 = $0.2 per minute, so 10 in all."
    elif case == "no answer field":
        del rows[2]["answer"]
    elif case == "nothing after ####":
        rows[0]["answer"] += "\n####  "
    if case == "empty file":
        source.write_text("")
    elif case == "not json":
        source.write_text(json.dumps(rows[0]) + "\n{question: 1}\n")
    elif case == "no train split":
        source = gsm8k_folder(tmp_path / "folder")
        (source / "train.jsonl").rename(source / "validation.jsonl")
    elif case != "missing file":
        write_jsonl(source, rows)
    out = tmp_path / "out"

    assert prepare_module.main([str(source), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("prepare.py: ") and captured.err.count("\n") == 1
    expected = {
        "missing file": "missing.jsonl: no such file or folder",
        "no ####": "(train split) row 1: the answer has no '#### <final answer>'",
        "no answer field": "(train split) row 2: no answer field",
        "nothing after ####": "(train split) row 0: nothing follows the answer's '####'",
        "empty file": "(train split): no rows",
        "not json": "gsm8k.jsonl line 2: malformed JSON",
        "no train split": "folder: no train*",
    }[case]
    assert expected in captured.err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_gsm8k_prepare_as_a_command_exits_2_and_never_replaces_output(tmp_path):
    done = run_prepare(tmp_path / "missing.jsonl", "--out", tmp_path / "out")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"prepare.py: {tmp_path / 'missing.jsonl'}: no such file or folder\n"
    assert not (tmp_path / "out").exists()

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    done = run_prepare(gsm8k_folder(tmp_path / "gsm8k"), "--out", tmp_path / "out")
    assert done.returncode == 2 and "is not empty (pass --overwrite" in done.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


# ---------------------------------------------------------------- examples/reward_package

_PACKAGE_CHECK = r"""
import importlib, inspect, json, sys

api = importlib.import_module("rlpipe.rewards")
import example_rewards.answers as answers

report = {"final_number": api.load_reward("final_number") is answers.final_number,
          "brevity": api.load_reward("brevity") is answers.brevity,
          "from": inspect.getsourcefile(answers)}
specs = [{"name": "final_number"}, {"name": "brevity", "weight": 0.5, "kwargs": {"target_tokens": 4}}]
runner = api.RewardRunner(specs, columns=["solution"])
completions = ["6 x 7 = 42", "it is 41", "1,000", "no number"]
text = runner.score(["q"] * 4, completions, {"solution": ["42", "42", "1000", "7"], "completion_tokens": [5, 3, 1, 2],
                    "finish_reason": ["stop"] * 4, "max_tokens": [8] * 4}, completion_ids=[[1] * 5, [1] * 3, [1], [1, 1]])
chat = runner.score([[{"role": "user", "content": "q"}]], ["so 42"], {"solution": ["42"], "completion_tokens": [2],
                    "finish_reason": ["stop"], "max_tokens": [8]}, completion_ids=[[1, 1]])
report.update(text=text.per_function, totals=text.totals, chat=chat.per_function)
try:
    api.RewardRunner([{"name": "final_number"}], columns=["answer"])
except api.RewardConfigError as err:
    report["refused"] = str(err)
print("REPORT " + json.dumps(report))
"""


def install_reward_package(folder: Path) -> Path:
    """pip-installs examples/reward_package into `folder`/site-packages (offline: no build isolation, no
    dependencies to fetch) and returns that folder; on PYTHONPATH it is found as site-packages would be."""
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources it builds.
    source = shutil.copytree(EXAMPLES / "reward_package", folder / "reward_package")
    site = folder / "site-packages"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--disable-pip-version-check", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr
    assert (site / "rlpipe_example_rewards-0.1.0.dist-info" / "entry_points.txt").read_text().startswith(
        "[rlpipe.rewards]")
    return site


@pytest.mark.heavy
def test_the_reward_package_installs_and_rlpipe_finds_its_functions_by_name(tmp_path):
    site = install_reward_package(tmp_path)

    # A fresh interpreter with the installed folder on its path: importlib.metadata finds the package's dist-info
    # there, as it would in site-packages.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", _PACKAGE_CHECK], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, done.stderr[-3000:]
    report = json.loads(lines[-1].removeprefix("REPORT "))
    assert report["final_number"] and report["brevity"]
    assert report["from"].startswith(str(site))  # the installed copy, not the example's sources
    assert report["text"] == {"final_number": [1.0, 0.0, 1.0, 0.0], "brevity": [0.0, 0.25, 0.75, 0.5]}
    assert report["totals"] == [1.0, 0.125, 1.375, 0.25]
    assert report["chat"] == {"final_number": [1.0], "brevity": [0.5]}  # conversational completions too
    assert "final_number" in report["refused"] and "solution" in report["refused"]


# ---------------------------------------------------------------- examples/trl_grpo


def mapping_tables(page: Path) -> dict[str, list[list[str]]]:
    """The page's markdown tables by their first header cell: {header: rows of cells}."""
    tables, current = {}, None
    for line in page.read_text().splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if current is None:
            current = tables.setdefault(cells[0], [])
        elif not set("".join(cells)) <= set("-: "):
            current.append(cells)
    return tables


def spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


RLPIPE_KEYS = {key for key, _, _ in describe()}
SECTIONS = {key.split(".")[0] for key in RLPIPE_KEYS}


def rlpipe_spans(row: list[str]) -> tuple[list[str], list[str]]:
    """(the rlpipe column's spans, the notes' spans that name rlpipe keys: those starting with a config section)."""
    named = spans(row[1])
    noted = [s for s in spans(row[2]) if s.split(".")[0] in SECTIONS and "." in s.split("=")[0]]
    return named, noted


def test_every_rlpipe_key_in_the_mapping_page_exists():
    tables = mapping_tables(TRL_PAGE)
    rows = tables["GRPOConfig field"] + tables["GRPOTrainer argument"]
    assert len(tables["GRPOConfig field"]) >= 40 and len(tables["GRPOTrainer argument"]) >= 5
    checked = 0
    for row in rows:
        named, noted = rlpipe_spans(row)
        if row[1] != "—":
            assert named, row
        for span in named + noted:
            key, _, value = span.partition("=")
            assert key in RLPIPE_KEYS, f"{row[0]}: {key} is not an rlpipe config key"
            if value:
                load_config(None, [span])  # the value is one the key takes
            checked += 1
    assert checked >= 60


@pytest.mark.heavy
def test_every_trl_name_in_the_mapping_page_exists_in_trl():
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    arguments = set(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    tables = mapping_tables(TRL_PAGE)
    for table, known in (("GRPOConfig field", fields), ("GRPOTrainer argument", arguments)):
        for row in tables[table]:
            for name in spans(row[0]):
                assert name in known, f"{name} is not a {table.split()[0]} {table.split()[1]} in trl {trl.__version__}"


def test_the_mapping_page_covers_every_field_grpo_config_declares():
    """Every field of TRL's GRPOConfig class itself (its own and the TrainingArguments fields it gives GRPO defaults)
    has a row: mapped, different or not supported (—)."""
    trl = pytest.importorskip("trl")
    declared = set(trl.GRPOConfig.__annotations__)
    on_page = {name for row in mapping_tables(TRL_PAGE)["GRPOConfig field"] for name in spans(row[0])}
    assert len(declared) >= 79
    assert not declared - on_page, f"GRPOConfig fields missing from {TRL_PAGE.name}: {sorted(declared - on_page)}"


def test_the_mapping_page_covers_the_training_arguments_for_evaluation_the_hub_and_resuming():
    """The TrainingArguments fields GRPOConfig inherits that GRPO scripts set for evaluation during training, the Hub
    push and resuming have rows too: rlpipe has eval.every, metrics.push_to_hub and --resume for them."""
    trl = pytest.importorskip("trl")
    inherited = {f.name for f in dataclasses.fields(trl.GRPOConfig)} - set(trl.GRPOConfig.__annotations__)
    wanted = {"eval_strategy", "eval_steps", "load_best_model_at_end", "metric_for_best_model", "push_to_hub",
              "hub_model_id", "hub_private_repo", "hub_token", "resume_from_checkpoint", "optim", "use_cpu"}
    assert wanted <= inherited
    on_page = {name for row in mapping_tables(TRL_PAGE)["GRPOConfig field"] for name in spans(row[0])}
    assert not wanted - on_page, f"missing from {TRL_PAGE.name}: {sorted(wanted - on_page)}"


def trl_script_calls() -> tuple[dict, dict]:
    """The keyword arguments train_trl.py passes to GRPOConfig and GRPOTrainer, read from its source (TRL not needed):
    literal values as they are, names (variables, functions) as their text."""

    def value(node):
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.List):
            return [value(element) for element in node.elts]
        return ast.literal_eval(node)

    calls = {}
    for node in ast.walk(ast.parse((TRL_DIR / "train_trl.py").read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("GRPOConfig", "GRPOTrainer"):
            calls[node.func.id] = {keyword.arg: value(keyword.value) for keyword in node.keywords}
    return calls["GRPOConfig"], calls["GRPOTrainer"]


def test_the_trl_recipe_says_what_the_trl_script_says():
    args, trainer = trl_script_calls()
    cfg = load_config(TRL_RECIPE)
    epsilon = args.get("epsilon", 0.2)
    steps_per_generation = args.get("steps_per_generation", args.get("gradient_accumulation_steps", 1))
    generation_batch = args["per_device_train_batch_size"] * steps_per_generation  # one device
    aggregation = {"dapo": ("grpo", "token-mean"), "grpo": ("grpo", "seq-mean-token-mean"), "dr_grpo": ("dr_grpo", None)}
    schedule = {"constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}
    assert {
        "run": (f"{cfg.run.output_dir}/{cfg.run.name}", cfg.run.seed),
        "model": Path(cfg.model.path).name,
        "samples per step": cfg.samples_per_step,
        "group": cfg.rollout.group_size,
        "micro": cfg.train.micro_batch_size,
        "optimizer steps per step": cfg.samples_per_step // (cfg.train.mini_batch_size or cfg.samples_per_step),
        "steps": cfg.train.steps,
        "sampling": (cfg.rollout.max_tokens, cfg.rollout.temperature, cfg.rollout.top_p),
        "optimizer": (cfg.train.lr, cfg.train.lr_schedule, cfg.train.warmup_steps, cfg.train.grad_clip),
        "loss": (cfg.algo.loss, cfg.algo.loss_agg, cfg.algo.advantage_scale, cfg.algo.advantage_std),
        "clip": (cfg.algo.clip_low, cfg.algo.clip_high),
        "kl": (cfg.algo.kl_beta, cfg.algo.kl_estimator, cfg.algo.kl_bias_correction),
        "passes": cfg.train.num_iterations,
        "truncated": cfg.algo.mask_truncated_completions,
        "rewards": [(f.name, f.weight) for f in cfg.reward.functions],
        "precision": (cfg.model.dtype, cfg.learner.param_dtype),
        "activation checkpointing": cfg.learner.activation_checkpointing,
        "checkpoints": (cfg.train.checkpoint_every, cfg.train.keep_checkpoints),
        "template": cfg.data.chat_template_kwargs,
        "engine memory": cfg.rollout.gpu_memory_utilization,
        "eval": cfg.data.eval_size > 0,
    } == {
        "run": (args["output_dir"], args["seed"]),
        "model": trainer["model"].rpartition("/")[2],
        "samples per step": generation_batch,
        "group": args["num_generations"],
        "micro": args["per_device_train_batch_size"],
        "optimizer steps per step": steps_per_generation // args["gradient_accumulation_steps"],
        "steps": args["max_steps"] * args["gradient_accumulation_steps"] // steps_per_generation,
        "sampling": (args["max_completion_length"], args["temperature"], args["top_p"]),
        "optimizer": (args["learning_rate"], schedule[args["lr_scheduler_type"]], args["warmup_steps"],
                      args["max_grad_norm"]),
        "loss": (*aggregation[args["loss_type"]], args["scale_rewards"], "unbiased"),  # TRL's nanstd is Bessel's
        "clip": (epsilon, args.get("epsilon_high") or epsilon),
        "kl": (args["beta"], "k3", args.get("use_bias_correction_kl", True)),
        "passes": args.get("num_iterations", 1),
        "truncated": args.get("mask_truncated_completions", False),
        "rewards": [(f"gsm8k_rewards:{name}", weight) for name, weight in zip(trainer["reward_funcs"],
                                                                                args["reward_weights"], strict=True)],
        "precision": ("float32", "bfloat16" if args["bf16"] else None),
        "activation checkpointing": args["gradient_checkpointing"],
        "checkpoints": (args["save_steps"], args["save_total_limit"]),
        "template": args["chat_template_kwargs"],
        "engine memory": args["vllm_gpu_memory_utilization"],
        "eval": "eval_dataset" in trainer,
    }


def test_the_trl_script_rewards_pass_rlpipe_start_up_check_on_the_prepared_data(tmp_path, monkeypatch, prepare_module):
    monkeypatch.syspath_prepend(str(TRL_DIR))  # as PYTHONPATH=examples/trl_grpo does for `rlpipe train`
    out = tmp_path / "gsm8k-chat"
    assert prepare_module.main([str(gsm8k_folder(tmp_path / "gsm8k")), "--out", str(out)]) == 0
    cfg = load_config(TRL_RECIPE, [f"data.path={out}"])
    train, _ = load_rows(cfg.data, cfg.run.seed)
    result = score_with_recipe(cfg, train, ["48 + 24 = 72\n#### 72", "#### 1,000", "72"])
    assert result.per_function == {"correctness_reward": [1.0, 0.0, 0.0], "format_reward": [0.2, 0.2, 0.0]}
    assert result.failures == {"correctness_reward": 0, "format_reward": 0}

    # The script's own dataset.map(to_conversation) makes the rows prepare.py wrote.
    pytest.importorskip("trl")
    train_trl = importlib.import_module("train_trl")
    assert train_trl.SYSTEM_PROMPT == prepare_module.SYSTEM_PROMPT
    for source, row in zip(GSM8K_TRAIN, train, strict=True):
        mapped = {**source, **train_trl.to_conversation(source)}
        del mapped["question"]  # remove_columns=["question"]
        assert mapped == row
    assert train_trl.correctness_reward is importlib.import_module("gsm8k_rewards").correctness_reward
