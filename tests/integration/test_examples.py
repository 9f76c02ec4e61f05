"""The examples' recipes through one real GRPO step each, with a tiny random model: the TRL example's (data from
examples/gsm8k/prepare.py, the TRL script's own reward functions) and the GSM8K example's with the installed reward
package's functions added, found by their entry-point names in the reward workers."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from rlpipe.config import load_config
from rlpipe.run.controller import train
from tests.unit.test_examples import GSM8K_RECIPE, TRL_DIR, TRL_RECIPE, gsm8k_folder, install_reward_package, run_prepare

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def examples_on_path(tmp_path_factory):
    """PYTHONPATH as a user of the examples sets it: examples/trl_grpo (the TRL script's rewards) and a folder the
    reward package is installed into. Set before the module's Ray cluster starts, so its workers inherit it."""
    site = install_reward_package(tmp_path_factory.mktemp("reward-package"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join([str(TRL_DIR), str(site), os.environ.get("PYTHONPATH", "")]))
        patch.syspath_prepend(str(TRL_DIR))
        patch.syspath_prepend(str(site))
        yield


@pytest.fixture
def prepared_gsm8k(tmp_path):
    data = tmp_path / "gsm8k-chat"
    done = run_prepare(gsm8k_folder(tmp_path / "gsm8k"), "--out", data)
    assert done.returncode == 0, done.stderr
    return data


def one_small_step(tmp_path, model, data) -> list[str]:
    return [
        f"run.output_dir={tmp_path / 'runs'}",
        f"model.path={model}",
        f"data.path={data}",
        "data.max_prompt_tokens=440",  # the tiny tokenizer spends a token on most characters
        "rollout.group_size=4",
        "rollout.max_tokens=16",
        "rollout.max_model_len=456",
        "train.steps=1",
        "train.prompts_per_step=2",
        "train.micro_batch_size=4",
        "train.warmup_steps=0",
        "ray.num_cpus=6",  # one local cluster serves both tests
        "metrics.loggers=[jsonl]",
        "metrics.export=false",
        "metrics.plot=false",
    ]


def read_step(run_dir) -> tuple[dict, list[dict]]:
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    groups = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["samples_trained"] == 8
    return record, groups


def test_the_trl_example_recipe_takes_a_grpo_step(tmp_path, tiny_qwen3, examples_on_path, ray_cluster, prepared_gsm8k):
    cfg = load_config(TRL_RECIPE, one_small_step(tmp_path, tiny_qwen3, prepared_gsm8k) + [
        "rollout.dtype=float32",  # the tiny model's probe tolerance is float32's
        "learner.param_dtype=null",
    ])
    assert cfg.algo.kl_beta > 0 and cfg.algo.kl_bias_correction  # the recipe's KL (TRL's) to a reference model runs too
    train(cfg)
    record, groups = read_step(tmp_path / "runs" / cfg.run.name)
    assert record["reward/failures/correctness_reward"] == 0 and record["reward/failures/format_reward"] == 0
    assert "kl" in record and record["sync/probe_max_abs"] < 1e-4
    assert {len(group["reward_parts"]["correctness_reward"]) for group in groups} == {4}


def test_the_gsm8k_recipe_takes_a_grpo_step_with_the_reward_package(
    tmp_path, tiny_qwen3, examples_on_path, ray_cluster, prepared_gsm8k
):
    # The recipe's built-ins, and the package's functions by the names its entry points give them.
    functions = yaml.safe_load(GSM8K_RECIPE.read_text())["reward"]["functions"] + [
        {"name": "final_number"}, {"name": "brevity", "weight": 0.1, "kwargs": {"target_tokens": 16}}]
    cfg = load_config(GSM8K_RECIPE, one_small_step(tmp_path, tiny_qwen3, prepared_gsm8k) + [
        "data.eval_size=2", f"reward.functions={json.dumps(functions)}"])
    summary = train(cfg)
    record, groups = read_step(tmp_path / "runs" / cfg.run.name)
    for name in ("numeric_answer", "format_regex", "final_number", "brevity"):
        assert record[f"reward/failures/{name}"] == 0, name
    for group in groups:  # brevity's score is the package's formula on the sampled lengths
        expected = [max(0.0, 1 - n / 16) for n in group["completion_tokens"]]
        assert group["reward_parts"]["brevity"] == pytest.approx(expected)
    assert summary["eval_before"] is not None and summary["eval_after"] is not None  # GSM8K's test split
