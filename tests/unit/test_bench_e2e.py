"""`rlpipe bench e2e` without training: the three systems get one workload, TRL sees rlpipe's prompts in rlpipe's
order and templating, and the TRL reward wrapper scores as rlpipe's reward runner does."""

import json

import pytest

from rlpipe.bench.e2e import (
    E2ESpec,
    TrlReward,
    _e2e_config,
    _e2e_summary,
    _plot_e2e,
    _print_e2e,
    _rlpipe_steps,
    _trl_dataset_rows,
    _trl_steps,
    e2e_settings,
    e2e_workload,
)
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
    from rlpipe.run.controller import prepare
    from rlpipe.data.prompts import render_prompt

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


def test_the_summary_table_and_plot_take_trl_steps_which_time_no_phases(capsys, tmp_path):
    """The rows `rlpipe bench e2e` reports, made from a TRL run's result (TRL's steps have no phase times) next to an
    rlpipe run's: TRL's row has every figure but the learner's share of a step, which only rlpipe's has."""
    logged = [{"reward": reward, "completions/mean_length": 6.0} for reward in (0.0, 0.25, 0.5)]
    trl_result = {"steps": _trl_steps(100.0, [102.0, 103.5, 105.0], logged, samples=32), "setup_s": 7.0,
                  "last_log": logged[-1], "process_wall_s": 30.0}
    trl = _e2e_summary("trl-hf", trl_result, threshold=0.2)
    assert trl["error"] is None and trl["train_s_after_first"] is None
    assert trl["timed_s"] == 5.0 and trl["samples_per_s"] == 96 / 5.0 and trl["samples_per_s_after_first"] == 64 / 3.0
    assert trl["completion_tokens_per_s"] == 3 * 6.0 * 32 / 5.0
    assert trl["threshold_reached"] == {"step": 2, "seconds": 3.5} and trl["rewards"] == [0.0, 0.25, 0.5]

    history = [{"step": step, "time/step": 1.0 + step, "time/train": 0.5 * step, "time/generate": 0.4,
                "reward/mean": 0.1 * step, "samples_trained": 32.0, "completion_tokens": 150.0} for step in (1, 2, 3)]
    ours = _e2e_summary("rlpipe-sync", {"steps": _rlpipe_steps(history), "setup_s": 4.0, "process_wall_s": 20.0},
                        threshold=0.2)
    assert ours["train_s_after_first"] == (1.0 + 1.5) / 2 and ours["threshold_reached"] == {"step": 2, "seconds": 5.0}

    rows = [ours, trl]
    for row in rows:  # as bench_e2e ranks them: against the fastest TRL row
        row["ratio_to_trl"] = row["samples_per_s"] / trl["samples_per_s"]
    _print_e2e(rows, threshold=0.2)
    table = capsys.readouterr().out
    trl_line = next(line for line in table.splitlines() if line.startswith("trl-hf"))
    assert "failed" not in table and "1.00x" in trl_line and "3.5s (step 2)" in trl_line
    assert "learner seconds per step, steps 2+ (time/train): rlpipe-sync 1.25\n" in table
    png = _plot_e2e(rows, 0.2, "GRPO on a TRL-shaped result", str(tmp_path / "e2e.png"))
    assert (tmp_path / "e2e.png").stat().st_size > 0 and png == str(tmp_path / "e2e.png")
