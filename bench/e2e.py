"""`rlpipe bench e2e`: one GRPO workload (the default recipe's) run by rlpipe synchronous, rlpipe one-step
asynchronous and TRL's GRPOTrainer, each in a fresh process: samples/s, time to a reward, ratios against TRL."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlpipe.algo import build_objective, loss_defaults
from rlpipe.bench.common import in_fresh_process
from rlpipe.config import recipes_dir


E2E_MODELS = {"tiny": "a random 2-layer Qwen3 (hidden 64) with a 384-token BPE", "smollm2-135m": "builtin:smollm2-135m-instruct"}
# And one "trl-<generation>" row per TRL generation mode. rlpipe-xla is rlpipe-sync with its learner on torch_xla
# (PJRT's CPU client) in the xla environment (RLPIPE_XLA_VENV, default .venv-xla: scripts/setup-xla.sh).
E2E_SYSTEMS = ("rlpipe-sync", "rlpipe-async", "rlpipe-xla")
# TRL's generation paths on CPU: model.generate (hf), transformers' continuous batching (hf-cb), colocated vLLM with
# vLLM's model code or with vLLM's Transformers backend (vllm-colocate, vllm-colocate-tf).
TRL_GENERATION = ("hf", "hf-cb", "vllm-colocate", "vllm-colocate-tf")
# Where rlpipe and TRL differ by design; neither can be set to the other's choice.
E2E_DIFFERENCES = (
    "importance correction: rlpipe weights tokens by min(exp(learner - engine logprob), 2) (algo.tis_cap, computed "
    "from the training forward); TRL vllm-colocate: vllm_importance_sampling_mode=token_truncate with clip_max 2, "
    "computed in an extra no-grad forward over the step's samples; TRL hf generation has no engine/learner gap",
    "clipping: both 0.2 below / 0.28 above; rlpipe counts a tie as unclipped, TRL takes torch.min",
    "advantages: both (r - group mean) / group std, TRL adds 1e-4 to the std",
    "rlpipe runs as Ray actors (engine, learner, reward worker) with a weight sync and a logprob probe after each "
    "step; TRL runs in one process (colocated vLLM gets the weights by load_weights, HF generation uses the model)",
)


@dataclass
class E2ESpec:
    """The one GRPO workload every system is configured from: the default recipe's task, prompts, reward and
    algorithm, with only these changed."""

    model_path: str
    steps: int = 4
    output_dir: str = "runs/bench-e2e"
    recipe: str | None = None  # default: configs/default.yaml
    overrides: tuple[str, ...] = ()  # changes to the recipe's workload (`rlpipe bench e2e --set`)

    def recipe_path(self) -> str:
        return self.recipe or str(recipes_dir() / "default.yaml")


def e2e_settings(spec: E2ESpec, trl_generation: tuple[str, ...] = ("hf",)) -> dict[str, dict]:
    """Each system's settings, all derived from `spec`: rlpipe's as config overrides (sync: max_staleness 0,
    async: 1), TRL's as GRPOConfig keyword arguments plus the dataset rows in rlpipe's sampling order."""
    common = [
        *spec.overrides,
        f"model.path={spec.model_path}",
        f"train.steps={spec.steps}",
        "train.warmup_steps=0",  # rlpipe's factor is (step + 1) / warmup: warm-up 1 is no warm-up; HF's would be 0 at step 0
        "data.eval_size=0",  # no greedy before/after evaluation: not part of the workload
        "metrics.tensorboard=false",
        "metrics.plot=false",
        "metrics.export=false",
        f"run.output_dir={spec.output_dir}",
        "run.overwrite=true",
    ]
    settings: dict[str, dict] = {
        name: {"overrides": [*common, f"run.name={name}", f"train.max_staleness={staleness}"]}
        for name, staleness in (("rlpipe-sync", 0), ("rlpipe-async", 1))
    }
    xla_environment = os.environ.get("RLPIPE_XLA_VENV", str(Path(__file__).resolve().parent.parent / ".venv-xla"))
    settings["rlpipe-xla"] = {"overrides": [
        *common, "run.name=rlpipe-xla", "train.max_staleness=0", "learner.device=xla",
        f"placement.learner.python={xla_environment}",
    ]}
    cfg = _e2e_config(spec, settings["rlpipe-sync"]["overrides"])
    rows = e2e_prompt_rows(cfg)
    for generation in trl_generation:
        settings[f"trl-{generation}"] = {
            "generation": generation,
            "grpo_config": _trl_config_kwargs(cfg, generation, f"{spec.output_dir}/trl-{generation}"),
            "rows": rows,
            "reward_functions": [dataclasses.asdict(f) for f in cfg.reward.functions],
            "system_prompt": cfg.data.system_prompt,
            "max_prompt_tokens": cfg.data.max_prompt_tokens,
        }
    return settings


def _e2e_config(spec: E2ESpec, overrides: list[str]):
    from rlpipe.config import load_config

    return load_config(spec.recipe_path(), overrides)


def e2e_prompt_rows(cfg) -> list[dict]:
    """The rows rlpipe's controller draws, step by step, in its order (its Sampler with run.seed): TRL reads
    them in this order with its own shuffling off. `entry` travels as JSON text (the verifier reads both)."""
    from rlpipe.data.prompts import Sampler, load_rows, with_suffix

    train_rows, _ = load_rows(cfg.data, cfg.run.seed)
    sampler = Sampler(len(train_rows), cfg.run.seed)
    order = [i for _ in range(cfg.train.steps) for i in sampler.next(cfg.train.prompts_per_step)]
    return [
        {
            "question": with_suffix(train_rows[i]["question"], cfg.data.prompt_suffix),
            "answer": train_rows[i]["answer"],
            "entry": json.dumps(train_rows[i]["entry"]),
        }
        for i in order
    ]


def _trl_config_kwargs(cfg, generation: str, output_dir: str) -> dict:
    """GRPOConfig (trl 1.16) fields for the same workload: one generation of prompts_per_step x group_size
    completions per optimizer step, micro-batches of train.micro_batch_size, fp32, constant LR, no KL."""
    if generation not in TRL_GENERATION:
        raise ValueError(f"TRL generation {generation!r} (known: {', '.join(TRL_GENERATION)})")
    samples = cfg.train.prompts_per_step * cfg.rollout.group_size
    micro = cfg.train.micro_batch_size
    policy = build_objective(cfg.algo, max_tokens=cfg.rollout.max_tokens).policy
    advantage_scale = loss_defaults(cfg.algo)[0]
    if (cfg.train.mini_batch_size or samples) != samples:
        raise ValueError("the e2e bench compares one optimizer step per GRPO step (train.mini_batch_size null)")
    kwargs = {
        "output_dir": output_dir,
        "max_steps": cfg.train.steps,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": samples // micro,  # one optimizer step per generation batch ...
        "generation_batch_size": samples,  # ... of prompts_per_step x num_generations completions
        "num_generations": cfg.rollout.group_size,
        "max_completion_length": cfg.rollout.max_tokens,
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "top_k": 0,
        "learning_rate": cfg.train.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "adam_beta1": cfg.train.betas[0],
        "adam_beta2": cfg.train.betas[1],
        "adam_epsilon": cfg.train.adam_eps,
        "weight_decay": cfg.train.weight_decay,
        "max_grad_norm": cfg.train.grad_clip,
        "beta": cfg.algo.kl_beta,
        "epsilon": policy.clip_low,
        "epsilon_high": policy.clip_high,
        "loss_type": "dapo",  # token sum over the accumulated batch / its token count = rlpipe's token-mean
        "scale_rewards": advantage_scale,
        "num_iterations": 1,
        "shuffle_dataset": False,  # the rows come in rlpipe's sampling order
        "seed": cfg.run.seed,
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "gradient_checkpointing": cfg.learner.activation_checkpointing,
        "model_init_kwargs": {"dtype": cfg.model.dtype},
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    if generation == "hf-cb":
        kwargs["use_transformers_continuous_batching"] = True
    if generation.startswith("vllm-colocate"):
        kwargs.update(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            vllm_max_model_length=cfg.rollout.max_model_len,
            vllm_importance_sampling_correction=cfg.algo.tis_cap is not None,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=cfg.algo.tis_cap,
            vllm_model_impl="transformers" if generation == "vllm-colocate-tf" else "vllm",
        )
    return kwargs


def e2e_workload(name: str, settings: dict, spec: E2ESpec) -> dict:
    """The workload a system's settings describe, read back through that system's own config classes (rlpipe's
    load_config; TRL's GRPOConfig, whose __post_init__ resolves the batch sizes): equal for every system."""
    if name.startswith("rlpipe"):
        cfg = _e2e_config(spec, settings["overrides"])
        samples = cfg.samples_per_step
        policy = build_objective(cfg.algo, max_tokens=cfg.rollout.max_tokens).policy
        return {
            "model": cfg.model.path,
            "steps": cfg.train.steps,
            "prompts_per_step": cfg.train.prompts_per_step,
            "group_size": cfg.rollout.group_size,
            "max_completion_tokens": cfg.rollout.max_tokens,
            "temperature": cfg.rollout.temperature,
            "top_p": cfg.rollout.top_p,
            "lr": cfg.train.lr,
            "lr_per_step": [cfg.train.lr * _lr_factor(cfg, s) for s in range(cfg.train.steps)],
            "optimizer_steps_per_step": samples // (cfg.train.mini_batch_size or samples),
            "micro_batch_size": cfg.train.micro_batch_size,
            "adam": (*cfg.train.betas, cfg.train.adam_eps, cfg.train.weight_decay),
            "grad_clip": cfg.train.grad_clip,
            "kl_beta": cfg.algo.kl_beta,
            "clip": (policy.clip_low, policy.clip_high),
            "advantage_scale": loss_defaults(cfg.algo)[0],
            "loss_agg": getattr(policy, "aggregation", "per-sequence"),  # gspo reduces per sequence
            "dtype": (cfg.model.dtype, cfg.rollout.dtype),
            "seed": cfg.run.seed,
            "system_prompt": cfg.data.system_prompt,
            "rows": [r["question"] for r in e2e_prompt_rows(cfg)],
            "reward_functions": [dataclasses.asdict(f) for f in cfg.reward.functions],
        }
    from trl import GRPOConfig

    args = GRPOConfig(**settings["grpo_config"])
    optimizer_steps = args.steps_per_generation // args.gradient_accumulation_steps
    return {
        "model": spec.model_path,
        "steps": args.max_steps,
        "prompts_per_step": args.generation_batch_size // args.num_generations,
        "group_size": args.num_generations,
        "max_completion_tokens": args.max_completion_length,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "lr": args.learning_rate,
        "lr_per_step": [args.learning_rate] * args.max_steps if args.lr_scheduler_type == "constant" and not args.warmup_steps else None,
        "optimizer_steps_per_step": optimizer_steps,
        "micro_batch_size": args.per_device_train_batch_size,
        "adam": (args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay),
        "grad_clip": args.max_grad_norm,
        "kl_beta": args.beta,
        "clip": (args.epsilon, args.epsilon_high),
        "advantage_scale": args.scale_rewards,
        "loss_agg": {"dapo": "token-mean"}.get(args.loss_type, args.loss_type),
        "dtype": (args.model_init_kwargs["dtype"], "float32" if not (args.bf16 or args.fp16) else "mixed"),
        "seed": args.seed,
        "system_prompt": settings["system_prompt"],
        "rows": [r["question"] for r in settings["rows"]] if not args.shuffle_dataset else None,
        "reward_functions": settings["reward_functions"],
    }


def _lr_factor(cfg, step: int) -> float:
    from rlpipe.training.train_engine import lr_factor

    return lr_factor(step, cfg.train.warmup_steps, cfg.train.steps, cfg.train.lr_schedule, cfg.train.min_lr_ratio)


class TrlReward:
    """An rlpipe reward spec (function, weight, kwargs) as one of TRL's reward functions. Both call by keyword; the
    benchmark's TRL run gets chat messages for the prompts rlpipe's run sends as text, so this hands the function
    what rlpipe's reward pool would: the question and the completion as text, the dataset's columns but the prompt
    field, the columns rlpipe adds per sample (completion_tokens, finish_reason, max_tokens) and an rlpipe
    trainer_state made from TRL's. TRL's own extras (log_extra, log_metric) are not passed on."""

    def __init__(self, name: str, weight: float = 1.0, kwargs: dict | None = None, max_tokens: int | None = None,
                 eos_token_id: int | None = None, **_):
        from rlpipe.rewards import load_reward
        from rlpipe.usercode.callables import display_name

        self.fn, self.weight, self.kwargs = load_reward(name), weight, dict(kwargs or {})
        self.max_tokens, self.eos_token_id = max_tokens, eos_token_id
        self.__name__ = display_name(name)  # TRL names the reward's metrics after it

    def __call__(self, prompts, completions, completion_ids=None, trainer_state=None, **columns):
        from rlpipe.rewards.contract import call_arguments
        from rlpipe.rewards.contract import trainer_state as rlpipe_state

        questions = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        data = {k: v for k, v in columns.items() if isinstance(v, list) and len(v) == len(texts)}
        data.pop("question", None)  # rlpipe hands the prompt field over as `prompts`, not as a column
        if completion_ids is not None:
            data["completion_tokens"] = [len(ids) for ids in completion_ids]
            data["finish_reason"] = ["stop" if ids and ids[-1] == self.eos_token_id else "length" for ids in completion_ids]
            data["max_tokens"] = [self.max_tokens] * len(texts)
        state = rlpipe_state(global_step=getattr(trainer_state, "global_step", 0),
                             max_steps=getattr(trainer_state, "max_steps", 0),
                             epoch=float(getattr(trainer_state, "epoch", 0.0) or 0.0))
        scores = self.fn(**call_arguments(questions, texts, completion_ids, data, state, self.kwargs))
        out = []
        for score in scores:
            if isinstance(score, dict):
                score = score.get("score")
            out.append(None if score is None else self.weight * float(score))
        return out


def _trl_dataset_rows(rows: list[dict], system_prompt: str | None) -> list[dict]:
    """Conversational prompts: TRL templates them with add_generation_prompt, as rlpipe's render_prompt does."""
    def messages(question: str) -> list[dict]:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return [*system, {"role": "user", "content": question}]

    return [{"prompt": messages(r["question"]), **r} for r in rows]


def _e2e_trl_run(model_path: str, settings: dict, results) -> None:
    """TRL's GRPOTrainer on the workload, in a fresh process. Timed: from the trainer's on_train_begin to the end of
    each optimizer step (model loading, vLLM start and trainer set-up come before)."""
    try:
        results.put(_e2e_trl(model_path, settings))
    except BaseException as err:  # reported as the row's error, with the exception's last line
        import traceback

        results.put({"error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}",
                     "traceback": traceback.format_exc()[-4000:]})


def _e2e_trl(model_path: str, settings: dict) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if settings["generation"].startswith("vllm-colocate"):
        # vLLM on CPU, in this process (ENVIRONMENT.md): as rlpipe's engine is set up.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    started = time.perf_counter()
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlpipe.data.prompts import render_prompt

    if settings["generation"].startswith("vllm-colocate"):
        import functools

        import trl.generation.vllm_generation as vllm_generation

        # TRL builds LLM(...) with dtype "auto", which vLLM-on-CPU turns into bf16 for an fp32 checkpoint; rlpipe's
        # engine runs fp32 (rollout.dtype), so the engine gets the same dtype here. Nothing else is changed.
        vllm_generation.LLM = functools.partial(vllm_generation.LLM, dtype="float32")

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = _trl_dataset_rows(settings["rows"], settings["system_prompt"])
    # The same prompt tokens as rlpipe's (render_prompt), as TRL will template them.
    for row in rows[:8]:
        ours = render_prompt(tokenizer, row["question"], settings["system_prompt"])
        theirs = tokenizer.apply_chat_template(conversation=[row["prompt"]], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"][0]
        if list(theirs) != ours:
            raise RuntimeError(f"TRL's prompt tokens differ from rlpipe's for {row['question']!r}")
    config = settings["grpo_config"]
    rewards = [TrlReward(**spec, max_tokens=config["max_completion_length"], eos_token_id=tokenizer.eos_token_id)
               for spec in settings["reward_functions"]]

    class Timer(TrainerCallback):
        def __init__(self):
            self.start, self.ends, self.logs = None, [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    timer = Timer()
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=rewards,
        args=GRPOConfig(**config),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    setup_s = time.perf_counter() - started
    trainer.train()
    steps = _trl_steps(timer.start, timer.ends, timer.logs, config["generation_batch_size"])
    return {"steps": steps, "setup_s": setup_s, "last_log": timer.logs[-1] if timer.logs else {}}


def _trl_steps(start: float, ends: list[float], logs: list[dict], samples: int) -> list[dict]:
    """TRL's steps in the summary's shape, from the trainer's clock (train begin, each optimizer step's end) and
    its logged metrics. TRL times no phases of a step, so these steps have no `phases`."""
    per_step = [b - a for a, b in zip([start, *ends], ends)]
    steps = []
    for index, seconds in enumerate(per_step):
        logged = logs[index] if index < len(logs) else {}
        steps.append({"step": index + 1, "seconds": seconds, "reward": logged.get("reward"), "samples": samples,
                      "completion_tokens": logged.get("completions/mean_length", 0.0) * samples})
    return steps


def _e2e_rlpipe_run(spec: E2ESpec, overrides: list[str], results) -> None:
    """rlpipe's `train(cfg)` in a fresh process. Timed: each step's clock (time/step: generate, reward, train and
    sync, from the step's start to its metrics), summed; Ray start, engine and learner start-up, the sync
    rehearsal and the final checkpoint come before or after."""
    try:
        from rlpipe.run.controller import train

        cfg = _e2e_config(spec, overrides)
        started = time.perf_counter()
        train(cfg)
        total = time.perf_counter() - started
        history = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if line]
        steps = _rlpipe_steps(history)
        results.put({"steps": steps, "setup_s": total - sum(s["seconds"] for s in steps)})
    except BaseException as err:
        import traceback

        results.put({"error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}",
                     "traceback": traceback.format_exc()[-4000:]})


def _rlpipe_steps(history: list[dict]) -> list[dict]:
    """rlpipe's steps in the summary's shape, from its metrics.jsonl records; `phases` holds the step's time/*."""
    return [{"step": h["step"], "seconds": h["time/step"], "reward": h.get("reward/mean"),
             "samples": h.get("samples_trained", 0.0), "samples_run": h.get("learner/samples_run"),
             "completion_tokens": h.get("completion_tokens", 0.0),
             "phases": {k: v for k, v in h.items() if k.startswith("time/")},
             "staleness_max": h.get("staleness/max"), "graph_compiles": h.get("learner/graph_compiles")}
            for h in history]


def _e2e_summary(name: str, result: dict, threshold: float) -> dict:
    steps = result.get("steps") or []
    seconds = sum(s["seconds"] for s in steps)
    samples = sum(s["samples"] for s in steps)
    elapsed, reached = 0.0, None
    for s in steps:
        elapsed += s["seconds"]
        if reached is None and s["reward"] is not None and s["reward"] >= threshold:
            reached = {"step": s["step"], "seconds": elapsed}
    later_seconds = sum(s["seconds"] for s in steps[1:])
    return {
        "system": name,
        "error": result.get("error"),
        "timed_s": seconds,
        "samples": samples,
        "samples_per_s": samples / seconds if seconds else None,
        # Without step 1's warm-ups (first generation and backward); in async mode step 2's generation partly
        # overlapped step 1, which this leaves out, so it flatters async a little.
        "samples_per_s_after_first": sum(s["samples"] for s in steps[1:]) / later_seconds if later_seconds else None,
        "completion_tokens_per_s": sum(s["completion_tokens"] for s in steps) / seconds if seconds else None,
        # The learner's share of a step (time/train), without step 1's compiles and first backward. Only rlpipe's
        # steps carry phase times; TRL's (_e2e_trl) have none, so its row has no figure rather than a zero.
        "train_s_after_first": (sum(p.get("time/train", 0.0) for p in phases) / len(phases)
                                if (phases := [s["phases"] for s in steps[1:] if "phases" in s]) else None),
        "threshold_reached": reached,
        "setup_s": result.get("setup_s"),
        "process_wall_s": result.get("process_wall_s"),
        "rewards": [s["reward"] for s in steps],
        "steps": steps,
    }


def _plot_e2e(rows: list[dict], threshold: float, title: str, out_png: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        if not row["steps"]:
            continue
        rewards = [s["reward"] for s in row["steps"]]
        by_step.plot([s["step"] for s in row["steps"]], rewards, marker="o", label=row["system"])
        clock = [sum(s["seconds"] for s in row["steps"][: i + 1]) for i in range(len(row["steps"]))]
        by_time.plot(clock, rewards, marker="o", label=row["system"])
    by_step.xaxis.get_major_locator().set_params(integer=True)
    for ax, label in ((by_step, "step"), (by_time, "timed seconds (end of step)")):
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("mean reward of the step's samples")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def bench_e2e(model: str, steps: int, threshold: float, trl_generation: list[str], systems: list[str] | None = None,
              out: str | None = None, png: str | None = None, repeats: int = 1, overrides: list[str] = ()) -> list[dict]:
    """The same GRPO workload three ways, each in its own fresh process, one after the other: rlpipe synchronous
    (train.max_staleness 0), rlpipe one-step asynchronous (1), and TRL's GRPOTrainer (per TRL generation mode).
    Samples/s = completions trained / timed seconds (each runner says what it times); ratios against the fastest
    TRL row. With `repeats` > 1 the systems run round after round (every other round in reverse order) and each
    system's fastest round is reported; every round is in the JSON. `overrides` change the workload for every
    system (config overrides of the recipe)."""
    if model not in E2E_MODELS:
        raise ValueError(f"--model {model!r} (known: {', '.join(E2E_MODELS)})")
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-e2e-") as folder:
        if model == "tiny":
            from rlpipe.bench.tiny_model import build_tiny_model

            model_path = build_tiny_model(f"{folder}/tiny-qwen3", "qwen3")
        else:
            from rlpipe.models.builtin import resolve_model_path

            model_path = resolve_model_path(E2E_MODELS[model])
        spec = E2ESpec(model_path, steps, output_dir=f"{folder}/runs", overrides=tuple(overrides))
        settings = e2e_settings(spec, tuple(trl_generation))
        names = [n for n in settings if systems is None or n in systems or (n.startswith("trl") and "trl" in systems)]
        changed = f"; workload changed by {' '.join(overrides)}" if overrides else ""
        print(f"bench e2e: {model} ({model_path}), {steps} steps, {repeats} round(s); systems {', '.join(names)}"
              f"{changed}", flush=True)
        rounds: dict[str, list[dict]] = {name: [] for name in names}
        for round_index in range(repeats):
            for name in names if round_index % 2 == 0 else names[::-1]:
                load = os.getloadavg()[0]
                print(f"--- {name} (round {round_index + 1}; load average {load:.2f})", flush=True)
                started = time.perf_counter()
                try:
                    if name.startswith("rlpipe"):
                        result = in_fresh_process(_e2e_rlpipe_run, spec, settings[name]["overrides"])
                    else:
                        result = in_fresh_process(_e2e_trl_run, model_path, settings[name])
                except RuntimeError as err:  # the process died without a word (a native crash)
                    result = {"error": str(err)}
                result["process_wall_s"] = time.perf_counter() - started
                if result.get("error"):
                    print(f"{name} failed: {result['error']}\n{result.get('traceback', '')}", flush=True)
                summary = _e2e_summary(name, result, threshold)
                summary.update(round=round_index + 1, load_before=load, load_after=os.getloadavg()[0])
                rounds[name].append(summary)
                time.sleep(2)  # let the run's processes (Ray's among them) finish exiting before the next starts
        workload = e2e_workload("rlpipe-sync", settings["rlpipe-sync"], spec)
    rows = [max(runs, key=lambda r: r["samples_per_s"] or 0.0) for runs in rounds.values()]
    trl_rates = [r["samples_per_s"] for r in rows if r["system"].startswith("trl") and r["samples_per_s"]]
    base = max(trl_rates) if trl_rates else None
    for row in rows:
        row["ratio_to_trl"] = row["samples_per_s"] / base if base and row["samples_per_s"] else None
    _print_e2e(rows, threshold)
    title = f"GRPO on {model}: {workload['prompts_per_step']} prompts x {workload['group_size']} samples, {steps} steps"
    png = png or (f"{os.path.splitext(out)[0]}.png" if out else f"bench-e2e-{model}.png")
    _plot_e2e(rows, threshold, title, png)
    print(f"reward per step: {png}")
    if out:
        workload.pop("rows")
        with open(out, "w") as f:
            json.dump({"model": model, "model_path": model_path if model != "tiny" else E2E_MODELS["tiny"],
                       "overrides": list(overrides), "steps": steps, "threshold": threshold, "repeats": repeats, "workload": workload,
                       "settings": {n: {k: v for k, v in s.items() if k != "rows"} for n, s in settings.items()},
                       "differences": E2E_DIFFERENCES, "rows": rows, "rounds": rounds, "plot": png}, f, indent=2)
    return rows


def _print_e2e(rows: list[dict], threshold: float) -> None:
    print(f"\n{'system':<22}{'samples/s':>10}{'steps 2+':>10}{'tokens/s':>10}{'timed s':>9}"
          f"{'to reward>=' + format(threshold, 'g'):>18}{'vs TRL':>8}{'process s':>11}")
    for row in rows:
        if row["error"]:
            print(f"{row['system']:<22}failed: {row['error']}")
            continue
        reached = row["threshold_reached"]
        when = f"{reached['seconds']:.1f}s (step {reached['step']})" if reached else "not reached"
        ratio = f"{row['ratio_to_trl']:.2f}x" if row["ratio_to_trl"] else "-"
        later = f"{row['samples_per_s_after_first']:.2f}" if row["samples_per_s_after_first"] else "-"
        print(f"{row['system']:<22}{row['samples_per_s']:>10.2f}{later:>10}{row['completion_tokens_per_s']:>10.1f}"
              f"{row['timed_s']:>9.1f}{when:>18}{ratio:>8}{row['process_wall_s']:>11.1f}")
    print("mean reward per step: " + "; ".join(f"{r['system']} " + " ".join(
        "-" if v is None else f"{v:.2f}" for v in r["rewards"]) for r in rows))
    print("learner seconds per step, steps 2+ (time/train): " + "; ".join(
        f"{r['system']} {r['train_s_after_first']:.2f}" for r in rows if r.get("train_s_after_first") is not None))
    compiled = [r for r in rows if r["steps"] and r["steps"][-1].get("graph_compiles") is not None]
    if compiled:  # a captured learner step (learner.graph, or xla): graphs compiled over the run
        print("learner graphs compiled: " + "; ".join(f"{r['system']} {r['steps'][-1]['graph_compiles']:.0f}"
                                                      for r in compiled))
    run = [r for r in rows if any(s.get("samples_run") is not None for s in r["steps"])]
    if run:  # rlpipe's learner leaves out samples with advantage 0 (learner.skip_zero_advantage)
        print("samples the learner ran per step: " + "; ".join(f"{r['system']} " + " ".join(
            "-" if s.get("samples_run") is None else f"{s['samples_run']:.0f}" for s in r["steps"]) for r in run))
