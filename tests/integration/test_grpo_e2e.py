"""Two real GRPO steps: Ray actors, a vLLM engine, the torch learner and reward workers, on tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpipe.run import evaluation
from rlpipe.config import load_config
from rlpipe.run.controller import train
from rlpipe.training.lora import targeted_modules
from rlpipe.models import load_model

pytestmark = pytest.mark.integration


def _overrides(run_dir, model_path) -> list[str]:
    return [
        f"run.output_dir={run_dir}",
        f"model.path={model_path}",
        "rollout.group_size=4",
        "rollout.max_tokens=12",
        "rollout.max_model_len=128",
        "data.max_prompt_tokens=112",
        "data.eval_size=4",
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.micro_batch_size=4",
        "train.lr=1e-3",
        "ray.num_cpus=6",  # one local cluster serves every test of this module
        "metrics.tensorboard=true",
        "sync.probe_tolerance=1e-5",  # every engine checks itself against the learner after each sync
        "sync.bucket_mb=0.05",  # several buckets even for a tiny model
    ]


def _read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_run(run_dir, summary, route, samples_per_step=8, export=True):
    """`route`: the weight-sync route every learner-rank/engine pair should have taken (all on one host)."""
    records = _read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # The engine now holds exactly the learner's weights ...
        assert record["sync/probe_max_abs"] < 1e-5
        assert record["sync/bytes"] > 0
        # ... and they are new weights: the sampled tokens' logprobs moved.
        assert record["sync/policy_shift"] > 1e-3
        assert record["policy_version"] == record["step"]
        assert record["samples_trained"] == samples_per_step
        # The phase's parts, timed apart: the write alone, the engine's replay of the probe, and the learner's probe
        # forward (run before the transfer: the learner shares this host with the engines).
        assert record["sync/write_s"] > 0 and record["sync/probe_s"] > 0 and record["sync/reference_s"] > 0
        for key in ("reward/mean", "accuracy", "completion_len/mean", "truncated_fraction", "clip_fraction",
                    "entropy", "logprob_gap/mean_abs", "logprob_gap/max_abs", "time/generate", "time/reward",
                    "time/train", "time/sync", "tokens_per_s/generate"):
            assert key in record, key
    # The channel was checked end to end before training: every byte, the write and the probe.
    assert summary["sync_check"]["sync/probe_max_abs"] < 1e-5
    # Where the start-up went, part by part: the roles start together, so the slowest role's readiness and the
    # checked sync after it fall within the roles' start.
    startup = summary["startup"]
    parts = {"ray", "roles", "learner_ready", "rollout_ready", "reward_ready", "process_group", "sync_check",
             "eval_before"}
    assert set(startup) == {f"startup/{part}_s" for part in parts} and min(startup.values()) >= 0
    assert startup["startup/roles_s"] >= max(startup["startup/rollout_ready_s"], startup["startup/learner_ready_s"]) \
        + startup["startup/sync_check_s"]
    assert "driver INFO rlpipe.run.controller: start-up: ray " in (run_dir / "logs" / "run.log").read_text()
    assert summary["sync_check"]["sync/bytes"] == records[0]["sync/bytes"] > 0
    assert set(summary["hosts"]) == {"learner", "rollout", "reward"} and len(set(sum(summary["hosts"].values(), []))) == 1
    assert set(summary["sync_routes"].values()) == {route}
    if route in ("shm", "ray"):
        assert records[0][f"sync/pairs_{route}"] == len(summary["sync_routes"])
    # Step 1 samples from the starting weights, which learner and engine share: their logprobs agree.
    assert records[0]["logprob_gap/max_abs"] < 1e-3
    assert (run_dir / "curves.png").stat().st_size > 0
    assert list((run_dir / "tensorboard").iterdir())
    assert summary["eval_before"] is not None and summary["eval_after"] is not None
    assert len((run_dir / "samples.jsonl").read_text().splitlines()) == 4  # two groups a step
    if export:
        _check_export(summary["export"])


def _check_export(folder):
    """The exported folder loads in transformers and in vLLM, and both agree with rlpipe's model on it."""
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from rlpipe.training.train_engine import token_logprobs
    from rlpipe.models import load_model

    tokens = list(range(5, 30))
    ours = token_logprobs(load_model(folder), torch.tensor([tokens]))[0]
    logits = AutoModelForCausalLM.from_pretrained(folder)(torch.tensor([tokens])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    theirs = torch.cat([torch.zeros(1), picked])
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    # vLLM pins the thread count of the process it runs in, so it gets a process of its own.
    script = (
        "import json, sys\n"
        "from rlpipe.config import RolloutConfig\n"
        "from rlpipe.rollout.engine import RolloutEngine\n"
        "if __name__ == '__main__':\n"
        "    engine = RolloutEngine(sys.argv[1], RolloutConfig(max_model_len=128), seed=0)\n"
        "    print('LOGPROBS', json.dumps(engine.sequence_logprobs(json.loads(sys.argv[2]))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, folder, json.dumps(tokens)], capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("LOGPROBS ")]
    assert lines, done.stderr[-2000:]
    engine = torch.tensor(json.loads(lines[-1][len("LOGPROBS "):]))
    torch.testing.assert_close(engine[1:], ours[1:], atol=1e-4, rtol=0)


def test_qwen3_moe_from_jsonl(tmp_path, tiny_qwen3_moe, ray_cluster):
    """The tiny Qwen3-MoE through the whole loop on two sharded learner ranks (whole experts each): every step's
    engine probe (decoded, as engines that cannot replay a sequence check theirs) equals the learner after the
    sync, the router metrics reach metrics.jsonl, and a local jsonl file feeds five reward functions (group-level,
    failing and shaping ones among them)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"Calculate {a} + {a + 3}.", "answer": str(2 * a + 3)})
                              for a in range(24)))
    cfg = load_config(None, _overrides(tmp_path / "runs", tiny_qwen3_moe) + [
        "run.name=qwen3",
        "learner.ranks=2",  # a SimpleFSDP-sharded learner group; each rank sends its own shards to the engine
        "algo.router_aux_loss_coef=0.01",
        "sync.transport=ray",  # the object store (the default, auto, takes shared memory on one host)
        "sync.probe=decode",  # as on vLLM for TorchTPU: engine and both ranks continue each probe greedily
        "data.source=file",
        f"data.path={data}",
        # none_first cannot score the first sample of each call: that sample is counted and left out.
        # rank_in_group raises when it sees samples of two prompts; overlong reads the pool's per-sample columns.
        "reward.functions=[{name: 'rlpipe.rewards.math:numeric_answer'}, {name: 'tests.unit.reward_fixtures:length', "
        "weight: 0.01}, {name: 'tests.unit.reward_fixtures:none_first', weight: 0.0}, "
        "{name: 'tests.unit.reward_fixtures:rank_in_group', weight: 0.0, group: true}, "
        "{name: overlong, weight: 0.1, kwargs: {buffer_tokens: 4}}]",
    ])
    summary = train(cfg)
    run_dir = tmp_path / "runs" / "qwen3"
    _check_run(run_dir, summary, "ray", samples_per_step=7)
    record = _read_metrics(run_dir)[0]
    assert "reward/numeric_answer" in record and "reward/length" in record
    assert record["reward/failures/none_first"] == 1 and record["reward/unscored"] == 1
    assert record["reward/failures/rank_in_group"] == 0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for sample in samples:
        assert sum(sample["reward_parts"]["rank_in_group"]) >= 1  # a shortest completion in every group
        expected = [max(-1.0, min(0.0, (cfg.rollout.max_tokens - 4 - n) / 4)) for n in sample["completion_tokens"]]
        assert sample["reward_parts"]["overlong"] == pytest.approx(expected)
    assert any(v < 0.0 for s in samples for v in s["reward_parts"]["overlong"])  # the tiny model runs long
    for record in _read_metrics(run_dir):
        assert 0 <= record["moe/expert_load_min"] <= 1 <= record["moe/expert_load_max"]
        assert 0 < record["moe/expert_load_entropy"] <= 1
        assert record["moe/aux_loss"] > 0


def test_local_cluster_is_bound_to_loopback(ray_cluster):
    import ray

    from rlpipe.actors.cluster import start_ray

    from ray._raylet import AuthenticationMode, get_authentication_mode

    start_ray(load_config(None, ["ray.num_cpus=6"]))  # as `rlpipe train` does without ray.address
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    # Token authentication on, in this process and in the cluster's services (they run with the variable Ray set).
    assert get_authentication_mode() == AuthenticationMode.TOKEN
    gcs_pid = ray._private.worker._global_node.all_processes["gcs_server"][0].process.pid
    with open(f"/proc/{gcs_pid}/environ", "rb") as environ:
        assert b"RAY_AUTH_MODE=token" in environ.read().split(b"\0")


def test_llama_from_reasoning_gym(tmp_path, tiny_llama, ray_cluster, twin_python):
    cfg = load_config(None, _overrides(tmp_path / "runs", tiny_llama) + [
        "run.name=llama",
        "data.size=32",
        # Two engines and two reward workers: prompts and groups are split across them and rejoined in order.
        "rollout.num_engines=2",
        "reward.num_workers=2",
        "sync.transport=gloo",  # one point-to-point group of the learner and both engines
        "algo.kl_beta=0.05",
        "reward.functions=[{name: reasoning_gym}, {name: 'tests.unit.reward_fixtures:length', weight: 0.01}]",
        "train.max_staleness=1",  # asynchronous: step 2 generates (with version 0) while step 1 trains
        "metrics.export=false",  # the other runs check the export
        f"placement.reward.python={twin_python}",  # the reward workers in an environment of their own
    ])
    summary = train(cfg)
    assert summary["python"]["reward"] == [twin_python] * 2
    assert twin_python not in summary["python"]["learner"] + summary["python"]["rollout"]
    run_dir = tmp_path / "runs" / "llama"
    _check_run(run_dir, summary, "gloo", export=False)
    first, second = _read_metrics(run_dir)
    assert "kl" in second
    assert first["staleness/max"] == 0 and second["staleness/max"] == second["staleness/mean"] == 1
    assert second["logprob_gap/mean_abs"] > first["logprob_gap/mean_abs"]  # step 2 trains on a stale policy


def test_roles_that_do_not_fit_the_cluster_fail_fast(tiny_qwen3, ray_cluster):
    from rlpipe.actors.cluster import start_ray
    from rlpipe.actors.roles import Roles
    from rlpipe.config import ConfigError

    start_ray(load_config(None, ["ray.num_cpus=6"]))
    cfg = load_config(None, [f"model.path={tiny_qwen3}", "rollout.num_engines=4", "reward.num_workers=2"])
    with pytest.raises(ConfigError, match=r"^ray.num_cpus: the cluster has 6 CPUs but the roles need 7"):
        Roles(cfg, tiny_qwen3)


def test_a_dead_learner_rank_fails_the_step_at_once(tiny_qwen3, ray_cluster):
    import time

    import ray

    from rlpipe.actors.calls import WorkerLost
    from rlpipe.actors.cluster import start_ray
    from rlpipe.actors.roles import Roles
    from rlpipe.types import TrainBatch

    start_ray(load_config(None, ["ray.num_cpus=6"]))
    cfg = load_config(None, [f"model.path={tiny_qwen3}", "learner.ranks=2", "rollout.group_size=2",
                             "train.prompts_per_step=2", "train.micro_batch_size=2",
                             "learner.collective_timeout_s=600"])
    roles = Roles(cfg, tiny_qwen3)
    try:
        ray.kill(roles.learners[1])
        batch = TrainBatch.from_sequences([[1, 2]] * 4, [[3, 4]] * 4, [[-1.0, -1.0]] * 4, [1.0, -1.0, 1.0, -1.0])
        started = time.monotonic()
        # Rank 0 now waits in a collective for a peer that is gone; the step must not wait with it.
        with pytest.raises(WorkerLost, match="a learner rank died during a training step"):
            roles.train(batch)
        assert time.monotonic() - started < 60
    finally:
        roles.shutdown()


def test_a_run_resumed_from_its_checkpoint_repeats_the_uninterrupted_run(tmp_path, tiny_qwen3, ray_cluster):
    """3 steps in one go against 2 steps, then `--resume` for 1 more: steps 2 and 3 give the same metrics (seeded
    sampling per step, the learner's weights and AdamW state, the sampler position and RNG all restored), though
    only the uninterrupted run evaluates the held-out set after every step (an evaluation leaves training's sampling
    as it was); the held-out figures of the steps both evaluate agree, and `rlpipe eval` of the last checkpoint
    gives them again."""
    from rlpipe.training import checkpoint

    base = _overrides(tmp_path / "runs", tiny_qwen3) + [
        "data.size=32",
        "eval.samples_per_prompt=4",
        "reward.success_threshold=0.12",  # a sample of 12 characters or more counts as correct: held-out figures vary
        "reward.functions=[{name: reasoning_gym}, {name: 'tests.unit.reward_fixtures:length', weight: 0.01}]",
        "metrics.export=false",
        "metrics.tensorboard=false",
    ]
    whole_summary = train(load_config(None, base + ["run.name=whole", "train.steps=3", "metrics.export=true",
                                                    "eval.every=1"]))
    train(load_config(None, base + ["run.name=split", "train.steps=2"]))
    with pytest.raises(checkpoint.CheckpointError, match="no such file"):
        train(load_config(None, base + ["run.name=split", "train.steps=3"]), resume=str(tmp_path / "elsewhere"))
    train(load_config(None, base + ["run.name=split", "train.steps=3"]), resume="latest")

    whole, split = _read_metrics(tmp_path / "runs" / "whole"), _read_metrics(tmp_path / "runs" / "split")
    assert [r["step"] for r in split] == [1, 2, 3]
    assert set(whole_summary["sync_routes"].values()) == {"shm"}  # the default, auto, on one host
    assert all(r["sync/pairs_shm"] == 1 and r["sync/pairs_ray"] == 0 and r["sync/probe_max_abs"] < 1e-5 for r in split)
    timing = ("time/", "tokens_per_s/", "sync/transfer_s", "sync/write_s", "sync/probe_s", "sync/reference_s")
    for uninterrupted, resumed in zip(whole[1:], split[1:], strict=True):
        compared = [key for key in uninterrupted if not key.startswith(timing)]
        assert "loss" in compared and "reward/mean" in compared and set(compared) <= set(resumed)
        for key in compared:
            assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-6, abs=1e-7), (resumed["step"], key)
    # Held-out figures: greedy accuracy, mean@4, pass@2 and pass@4 at every evaluation, in the step's record and the
    # summary; the resumed run's evaluations continue those its checkpoint holds.
    figures = ("accuracy", "mean@4", "pass@2", "pass@4")
    assert all(set(evaluation.metrics(dict.fromkeys(figures, 0.0))) <= set(r) for r in whole)
    assert "eval/accuracy" not in split[0]
    split_summary = json.loads((tmp_path / "runs" / "split" / "summary.json").read_text())
    assert [p["step"] for p in whole_summary["eval"]] == [0, 1, 2, 3]
    assert [p["step"] for p in split_summary["eval"]] == [0, 2, 3]
    by_step = {p["step"]: p for p in whole_summary["eval"]}
    for point in split_summary["eval"]:
        assert set(point) == {"step", *figures} and point == pytest.approx(by_step[point["step"]], abs=1e-9)
    assert whole_summary["eval_before"] == by_step[0]["accuracy"] and whole_summary["eval_after"] == by_step[3]["accuracy"]
    best = whole_summary["eval_best"]
    assert best["accuracy"] == max(p["accuracy"] for p in whole_summary["eval"])
    last = tmp_path / "runs" / "whole" / "checkpoints" / "step_000003"
    assert best["checkpoint"] == (str(last) if best["step"] == 3 else None)  # the only checkpoint kept

    # `rlpipe eval` of the resumed run (its latest checkpoint, with its config): the engines alone, on the
    # checkpoint's weights, give the figures the run's own evaluation after step 3 gave.
    from rlpipe.cli import main

    assert main(["eval", str(tmp_path / "runs" / "split")]) == 0
    written = json.loads((tmp_path / "runs" / "split" / "checkpoints" / "step_000003" / "eval.json").read_text())
    assert written["step"] == 3 and written["prompts"] == 4
    assert {k: written[k] for k in figures} == pytest.approx({k: split_summary["eval"][-1][k] for k in figures})

    checkpoints = [p.name for p in checkpoint.list_checkpoints(tmp_path / "runs" / "split")]
    assert checkpoints == ["step_000002", "step_000003"]
    assert checkpoint.resolve(tmp_path / "runs" / "split").name == "step_000003"
    assert checkpoint.read_trainer_state(checkpoint.resolve(tmp_path / "runs" / "split"))["policy_version"] == 3

    # `rlpipe export` of the resumed run's last checkpoint: an HF folder that loads in transformers and vLLM,
    # holding the weights the uninterrupted run's learner exported itself.
    import torch

    from rlpipe.training.train_engine import token_logprobs
    from rlpipe.models import load_model

    exported = tmp_path / "exported"
    assert main(["export", str(tmp_path / "runs" / "split"), str(exported)]) == 0
    assert main(["export", str(tmp_path / "runs" / "split"), str(exported)]) == 2  # never overwritten
    _check_export(str(exported))
    tokens = torch.tensor([list(range(5, 30))])
    torch.testing.assert_close(token_logprobs(load_model(exported), tokens),
                               token_logprobs(load_model(whole_summary["export"]), tokens), rtol=0, atol=1e-6)


def test_a_reward_function_broken_for_good_stops_the_run_naming_it(tmp_path, tiny_qwen3, ray_cluster):
    from rlpipe.rewards import RewardFailure

    cfg = load_config(None, _overrides(tmp_path / "runs", tiny_qwen3) + [
        "run.name=broken-reward",
        "data.size=32",
        "data.eval_size=0",
        "train.steps=4",
        "reward.max_failed_steps=2",
        "reward.functions=[{name: reasoning_gym}, {name: 'tests.unit.reward_fixtures:raising', weight: 0.1}]",
    ])
    with pytest.raises(RewardFailure, match=r"reward function .*raising failed on more than 50% .* 2 steps"):
        train(cfg)
    assert [r["step"] for r in _read_metrics(tmp_path / "runs" / "broken-reward")] == [1]  # stopped in step 2


def test_a_reward_worker_killed_mid_call_is_restarted_and_its_share_scored_once(tmp_path, tiny_qwen3, ray_cluster):
    import os
    import signal
    import threading
    import time

    pid_file = tmp_path / "reward_worker.pid"
    killed: list[int] = []

    def kill_the_first_worker():
        deadline = time.monotonic() + 300
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        killed.append(int(pid_file.read_text()))
        os.kill(killed[0], signal.SIGKILL)  # mid-call: the function sleeps for 2 s after writing its pid

    killer = threading.Thread(target=kill_the_first_worker, daemon=True)
    killer.start()
    cfg = load_config(None, _overrides(tmp_path / "runs", tiny_qwen3) + [
        "run.name=reward-killed", "metrics.export=false", "data.eval_size=0",
        f"reward.functions=[{{name: 'tests.unit.reward_fixtures:slow_length', kwargs: {{pid_file: '{pid_file}', "
        f"seconds: 2}}}}]",
    ])
    train(cfg)
    killer.join(timeout=10)
    assert killed, "the reward worker was never killed"
    assert int(pid_file.read_text()) != killed[0]  # a new worker process scored the killed one's share
    for record in _read_metrics(tmp_path / "runs" / "reward-killed"):
        assert record["samples_trained"] == 8 and record["reward/unscored"] == 0  # every sample scored, once
    samples = [json.loads(line) for line in (tmp_path / "runs" / "reward-killed" / "samples.jsonl").read_text().splitlines()]
    for group in samples:  # the scores are the function's, computed for these very completions
        assert group["rewards"] == [float(len(text)) for text in group["completions"]]


def test_a_reward_function_that_never_returns_on_one_prompt_costs_that_prompts_samples_only(
        tmp_path, tiny_qwen3, ray_cluster):
    """A function blocked for good on one prompt's samples is killed with the reward worker's child process at its
    time limits: the step finishes, those samples scored 0 by it (counted as timeouts), the other prompt's scored
    by every function."""
    rows = [{"question": "Calculate 1 + 2.", "answer": "3"}, {"question": "Calculate 2 + 2, then stall.", "answer": "4"}]
    record, groups = _one_step(tmp_path, tiny_qwen3, "stalled", rows, [
        "{name: 'tests.unit.reward_fixtures:stalls_on'}", "{name: 'tests.unit.reward_fixtures:length', weight: 0.01}",
    ], ["reward.timeout_s=2", "reward.sample_timeout_s=1"])
    assert record["reward/timeouts/stalls_on"] == 4 and record["reward/timeouts/length"] == 0
    assert record["reward/failures/stalls_on"] == 0 and record["reward/failures/length"] == 0
    assert record["reward/unscored"] == 0
    by_question = {rows[g["sample_id"]]["question"]: g for g in groups}
    stalled, scored = by_question[rows[1]["question"]], by_question[rows[0]["question"]]
    assert stalled["reward_parts"]["stalls_on"] == [0.0] * 4
    assert stalled["rewards"] == pytest.approx([0.01 * len(text) for text in stalled["completions"]])
    assert scored["reward_parts"]["stalls_on"] == [1.0] * 4
    assert scored["rewards"] == pytest.approx([1.0 + 0.01 * len(text) for text in scored["completions"]])


def _one_step(tmp_path, model, name: str, rows: list[dict], functions: list[str], extra: list[str] = ()) -> tuple:
    """One GRPO step on `rows` (a jsonl file) with these reward functions; (its metrics, its logged groups)."""
    data = tmp_path / f"{name}.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows))
    cfg = load_config(None, _overrides(tmp_path / "runs", model) + [
        f"run.name={name}", "train.steps=1", "data.eval_size=0", "data.source=file", f"data.path={data}",
        "metrics.export=false", "metrics.tensorboard=false", "metrics.plot=false",
        f"reward.functions=[{', '.join(functions)}]", *extra,
    ])
    train(cfg)
    (record,) = _read_metrics(tmp_path / "runs" / name)
    groups = [json.loads(line) for line in (tmp_path / "runs" / name / "samples.jsonl").read_text().splitlines()]
    assert sum(len(g["completions"]) for g in groups) == 8  # every sample of the step is logged
    return record, groups


def _scores_match(record, groups, name, expected_for_group):
    """The function's scores in the step's samples and metrics are what it computes on the logged completions."""
    expected = []
    for group in groups:
        values = [v["score"] if isinstance(v, dict) else float(v) for v in expected_for_group(group)]
        assert group["reward_parts"][name] == pytest.approx(values), name
        expected += values
    assert record[f"reward/failures/{name}"] == 0
    assert record[f"reward/{name}"] == pytest.approx(sum(expected) / len(expected)), name


def test_trl_documentation_rewards_and_a_verl_compute_score_run_as_written(tmp_path, tiny_qwen3, ray_cluster):
    """TRL's documented reward functions and a verl-style compute_score, unchanged, through a real GRPO step on a
    plain-text dataset and on a conversational one (verl's parquet layout): called by keyword with the dataset's
    columns, each scores every sample, and its scores are what it gives on the logged completions."""
    from tests.unit import trl_doc_rewards as docs
    from tests.unit import verl_style_rewards as verl

    def row(a):
        return {"data_source": "toy/sum" if a % 2 else "toy/sum-detailed", "extra_info": {"index": a}}

    docs_path, verl_path = "tests.unit.trl_doc_rewards", "tests.unit.verl_style_rewards"
    verl_file = Path(verl.__file__).resolve()  # verl's batch form, named by file path as verl names it
    text_rows = [{"question": f"Calculate {a} + 3.", "ground_truth": str(a + 3), **row(a)} for a in range(12)]
    record, groups = _one_step(tmp_path, tiny_qwen3, "trl-text", text_rows, [
        f"{{name: '{docs_path}:reward_len', weight: 0.01}}",
        f"{{name: '{docs_path}:token_count_reward', weight: 0.01}}",
        f"{{name: '{docs_path}:boxed_ground_truth_reward'}}",
        f"{{name: '{docs_path}:async_reward_func'}}",
        f"{{name: '{docs_path}:logging_reward'}}",
        f"{{name: verl, kwargs: {{function: '{verl_path}:compute_score', ground_truth_column: ground_truth}}}}",
        f"{{name: verl, kwargs: {{function: '{verl_file}:batch_compute_score', ground_truth_column: ground_truth}}}}",
        "{name: 'tests.unit.reward_fixtures:reads_trainer_state', weight: 0.0}",
    ], ["learner.lora.rank=1", "learner.lora.alpha=16"])
    # Trained as a TRL run with a peft_config would be: rank-1 LoRA adapters on every linear layer. The engine loads
    # the base once and receives the adapters alone (float32: (in + out) x rank x 4 bytes each), which vLLM applies;
    # after the step (whose length rewards differ within groups, so B leaves zero) its probe matches the learner's
    # adapted model.
    assert record["grad_norm"] > 0 and record["sync/policy_shift"] > 0 and record["sync/probe_max_abs"] < 1e-5
    model = load_model(tiny_qwen3)
    adapter_bytes = sum((m.in_features + m.out_features) * 4 for _, m in targeted_modules(model, ["all-linear"]))
    model_bytes = sum(t.numel() * 4 for t in model.state_dict().values())
    assert record["sync/bytes"] == adapter_bytes < model_bytes / 20, (record["sync/bytes"], model_bytes)
    assert "weight sync: LoRA adapters only" in (tmp_path / "runs" / "trl-text" / "logs" / "run.log").read_text()
    for group in groups:
        group["row"] = text_rows[group["sample_id"]]
    texts, truths = (lambda g: g["completions"]), (lambda g: [g["row"]["ground_truth"]] * len(g["completions"]))
    _scores_match(record, groups, "reward_len", lambda g: docs.reward_len(completions=texts(g)))
    _scores_match(record, groups, "token_count_reward", lambda g: g["completion_tokens"])
    _scores_match(record, groups, "boxed_ground_truth_reward",
                  lambda g: docs.boxed_ground_truth_reward(completions=texts(g), ground_truth=truths(g)))
    _scores_match(record, groups, "async_reward_func", lambda g: [float(bool(t)) for t in texts(g)])
    _scores_match(record, groups, "logging_reward",
                  lambda g: docs.logging_reward(completions=texts(g), ground_truth=truths(g)))
    # What it gives TRL's log_metric and log_extra reaches the step's metrics and its samples.
    scored = [value for group in groups for value in group["reward_parts"]["logging_reward"]]
    assert record["reward/logged/accuracy"] == pytest.approx(sum(scored) / len(scored))
    for group in groups:
        extras = group["reward_extras"]
        assert extras["logging_reward/golden_answer"] == truths(group)
        assert len(extras["logging_reward/extracted_answer"]) == len(group["completions"])
    _scores_match(record, groups, "verl", lambda g: [
        verl.compute_score(g["row"]["data_source"], t, g["row"]["ground_truth"], g["row"]["extra_info"])
        for t in texts(g)])
    _scores_match(record, groups, "verl_2", lambda g: [
        verl.compute_score("toy/sum", t, g["row"]["ground_truth"]) for t in texts(g)])
    _scores_match(record, groups, "reads_trainer_state", lambda g: [0.0] * len(texts(g)))  # the first step: 0 updates

    # The conversational layout of verl's and TRL's datasets: chat-message prompts, reward_model.ground_truth.
    chat_rows = [{"prompt": [{"role": "user", "content": r["question"]}], "solution": r["ground_truth"],
                  "reward_model": {"style": "rule", "ground_truth": r["ground_truth"]},
                  **{k: r[k] for k in ("data_source", "extra_info")}} for r in text_rows]
    functions = [f"{{name: '{docs_path}:format_reward_func'}}", f"{{name: '{docs_path}:async_reward_func'}}",
                 f"{{name: verl, kwargs: {{function: '{verl_path}:async_compute_score'}}}}"]
    trl = _maybe_trl()  # TRL's own accuracy_reward too, where TRL is installed
    if trl is not None:
        functions.append("{name: 'trl.rewards:accuracy_reward'}")
    record, groups = _one_step(tmp_path, tiny_qwen3, "trl-chat", chat_rows, functions, ["data.prompt_field=prompt"])
    assert record["sync/bytes"] > 20 * adapter_bytes  # trained fully, this run syncs the whole model
    for group in groups:
        group["row"] = chat_rows[group["sample_id"]]

    def messages(group):
        return [[{"role": "assistant", "content": text}] for text in group["completions"]]

    _scores_match(record, groups, "format_reward_func", lambda g: docs.format_reward_func(completions=messages(g)))
    _scores_match(record, groups, "async_reward_func", lambda g: [1.0] * len(g["completions"]))  # a message list
    _scores_match(record, groups, "verl", lambda g: [
        verl.compute_score(g["row"]["data_source"], t, g["row"]["reward_model"]["ground_truth"],
                           g["row"]["extra_info"])
        for t in g["completions"]])
    if trl is not None:
        _scores_match(record, groups, "accuracy_reward", lambda g: trl.accuracy_reward(
            completions=messages(g), solution=[g["row"]["solution"]] * len(g["completions"])))


def _maybe_trl():
    try:
        import trl.rewards
    except ImportError:
        return None
    return trl.rewards


def test_dynamic_sampling_draws_prompts_until_the_batch_has_signal_and_resumes_exactly(tmp_path, tiny_qwen3,
                                                                                        ray_cluster):
    """A reward that leaves about half of the prompts' groups without signal: each step generates again until its
    two groups with signal, trains on those, and a run resumed after step 1 repeats the uninterrupted one (the extra
    rounds draw and sample the same)."""
    base = _overrides(tmp_path / "runs", tiny_qwen3) + [
        "algo.dynamic_sampling=true", "algo.max_generation_rounds=6", "data.size=64", "data.eval_size=0",
        "reward.functions=[{name: 'tests.unit.reward_fixtures:length_on_some_prompts'}]",
        "metrics.export=false", "metrics.plot=false", "metrics.tensorboard=false",
    ]
    train(load_config(None, base + ["run.name=whole"]))
    train(load_config(None, base + ["run.name=split", "train.steps=1"]))
    train(load_config(None, base + ["run.name=split"]), resume="latest")
    whole, split = _read_metrics(tmp_path / "runs" / "whole"), _read_metrics(tmp_path / "runs" / "split")
    assert any(r["sampling/rounds"] > 1 for r in whole), whole  # some step had to draw more
    for record in whole:
        assert record["sampling/groups_generated"] == 2 * record["sampling/rounds"]  # prompts_per_step a round
        assert record["samples_trained"] == 4 * min(2, record["sampling/groups_with_signal"])
        assert record["sync/probe_max_abs"] < 1e-5
    timing = ("time/", "tokens_per_s/", "sync/transfer_s", "sync/write_s", "sync/probe_s", "sync/reference_s")
    for uninterrupted, resumed in zip(whole, split, strict=True):  # step 1 too: the split run's has train.steps 1
        for key in [key for key in uninterrupted if not key.startswith(timing)]:
            assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-6, abs=1e-7), (resumed["step"], key)
