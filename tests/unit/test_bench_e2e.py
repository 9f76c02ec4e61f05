"""`rlpipe bench e2e` without training: the three systems get one workload, TRL sees rlpipe's prompts in rlpipe's
order and templating, and the TRL reward wrapper scores as rlpipe's reward runner does."""

import json

import pytest

from rlpipe.bench.e2e import E2ESpec, TrlReward, _e2e_config, _trl_dataset_rows, e2e_settings, e2e_workload
from rlpipe.rewards import RewardRunner
from rlpipe.cli import main

STEPS = 3


@pytest.fixture(scope="module")
def spec(tiny_qwen3, tmp_path_factory):
    return E2ESpec(tiny_qwen3, STEPS, output_dir=str(tmp_path_factory.mktemp("e2e-runs")))


@pytest.fixture(scope="module")
def settings(spec):
    return e2e_settings(spec, ("hf", "vllm-colocate"))


def test_rlpipe_modes_differ_only_in_staleness(settings):
    sync, asynchronous = settings["rlpipe-sync"]["overrides"], settings["rlpipe-async"]["overrides"]
    only_sync, only_async = set(sync) - set(asynchronous), set(asynchronous) - set(sync)
    assert only_sync == {"train.max_staleness=0", "run.name=rlpipe-sync"}
    assert only_async == {"train.max_staleness=1", "run.name=rlpipe-async"}


def test_every_system_gets_the_same_workload(spec, settings):
    pytest.importorskip("trl")
    workloads = {name: e2e_workload(name, value, spec) for name, value in settings.items()}
    assert set(workloads) == {"rlpipe-sync", "rlpipe-async", "rlpipe-xla", "trl-hf", "trl-vllm-colocate"}
    reference = workloads["rlpipe-sync"]
    assert reference["steps"] == STEPS and reference["optimizer_steps_per_step"] == 1
    assert len(reference["rows"]) == STEPS * reference["prompts_per_step"]
    for name, workload in workloads.items():
        differing = {key: (reference[key], workload[key]) for key in reference if workload[key] != reference[key]}
        assert not differing, f"{name} differs from rlpipe-sync: {differing}"


def test_trl_reads_the_prompts_rlpipe_draws_in_its_order_and_templating(spec, settings):
    from rlpipe.controller import prepare
    from rlpipe.data import render_prompt

    cfg = _e2e_config(spec, settings["rlpipe-sync"]["overrides"])
    run = prepare(cfg)  # the controller's own prompt set and sampler
    run.log.close()
    drawn = [p for _ in range(STEPS) for p in run.train_set.prompts(run.sampler.next(cfg.train.prompts_per_step))]
    trl = settings["trl-hf"]
    assert [row["question"] for row in trl["rows"]] == [p.question for p in drawn]
    assert [json.loads(row["entry"]) for row in trl["rows"]] == [json.loads(json.dumps(p.columns["entry"])) for p in drawn]
    tokenizer = run.train_set.tokenizer
    for row, prompt in zip(_trl_dataset_rows(trl["rows"], trl["system_prompt"]), drawn):
        # How TRL tokenizes a conversational prompt (GRPOTrainer._tokenize_prompts), against rlpipe's tokens.
        ids = tokenizer.apply_chat_template(
            conversation=[row["prompt"]], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"][0]
        assert list(ids) == prompt.token_ids == render_prompt(tokenizer, row["question"], cfg.data.system_prompt)


def test_trl_batches_make_one_optimizer_step_per_grpo_step(settings):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    for name in ("trl-hf", "trl-vllm-colocate"):
        args = GRPOConfig(**settings[name]["grpo_config"])
        assert args.generation_batch_size == args.per_device_train_batch_size * args.gradient_accumulation_steps
        assert args.steps_per_generation == args.gradient_accumulation_steps
        assert not args.bf16 and not args.gradient_checkpointing and args.beta == 0.0
    colocate = settings["trl-vllm-colocate"]["grpo_config"]
    assert colocate["vllm_importance_sampling_mode"] == "token_truncate"
    assert colocate["vllm_importance_sampling_clip_max"] == 2.0  # rlpipe's algo.tis_cap


def _rows():
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=7, min_terms=2, max_terms=2)
    return [{"question": e["question"], "answer": str(e["answer"]), "entry": e} for e in dataset]


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_trl_reward_wrapper_scores_as_the_reward_runner(weight):
    rows = _rows()
    texts = []
    for row in rows:
        answer = row["answer"]
        texts += [answer, f"Let me see... so the result is {answer}.", f"<answer>{answer}</answer>", "<answer>0.5</answer>",
                  "no idea", f"\\boxed{{{int(answer) + 1}}}", ""]
    per_row = len(texts) // len(rows)
    samples = [rows[i // per_row] for i in range(len(texts))]
    spec = {"name": "rlpipe.rewards.reasoning_gym:verifier", "weight": weight, "kwargs": {}, "group": False}
    expected = RewardRunner([spec]).score(
        [r["question"] for r in samples],
        texts,
        {"answer": [r["answer"] for r in samples], "entry": [r["entry"] for r in samples],
         "completion_tokens": [len(t) for t in texts], "finish_reason": ["stop"] * len(texts),
         "max_tokens": [64] * len(texts)},
    ).totals
    assert set(expected) == {0.0, weight}  # the hand-made completions hold right and wrong answers

    # What GRPOTrainer._calculate_rewards passes: chat messages, the dataset's other columns (entry as JSON text),
    # completion ids and its own extras.
    reward = TrlReward(**spec, max_tokens=64, eos_token_id=2)
    system = {"role": "system", "content": "Reply with only the final answer, a single number."}
    got = reward(
        prompts=[[system, {"role": "user", "content": r["question"]}] for r in samples],
        completions=[[{"role": "assistant", "content": t}] for t in texts],
        completion_ids=[[5] * 3 + [2] for _ in texts],
        question=[r["question"] for r in samples],
        answer=[r["answer"] for r in samples],
        entry=[json.dumps(r["entry"]) for r in samples],
        trainer_state=object(),
        log_extra=lambda *a: None,
        log_metric=lambda *a: None,
    )
    assert got == expected
    assert reward.__name__ == "verifier"


def test_cli_rejects_an_unknown_trl_generation(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "e2e", "--trl", "hf,bogus"])
    assert exit_info.value.code == 2
    assert "bogus" in capsys.readouterr().err
