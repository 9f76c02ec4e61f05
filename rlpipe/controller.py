"""The GRPO loop: sample prompts → generate → score → advantages → train → sync weights; synchronous, or with the
generation of later steps started while a step trains (train.max_staleness, `Lookahead`)."""

from __future__ import annotations

import json
import math
import shutil
import socket
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from rlpipe import checkpoint
from rlpipe.checkpoint import CheckpointError
from rlpipe.algo import group_advantages, loss_defaults, uniform_groups
from rlpipe.config import Config, ConfigError, one_line
from rlpipe.data import PromptSet, Sampler, load_rows, reward_columns
from rlpipe.environments import check_learner_device, check_role_environments
from rlpipe.logs import LOG_FILE, LogSetup, driver_logging
from rlpipe.metrics import MetricsLogger, roles_summary, rollout_metrics, staleness_metrics
from rlpipe.plots import plot_history
from rlpipe.models.builtin import resolve_model_path
from rlpipe.trackers import check_trackers_installed, open_trackers
from rlpipe.types import Group, TrainBatch
from rlpipe.rewards import FailureWatch, RewardRunner, TrainerState, trainer_state


def train(cfg: Config, resume: str | None = None) -> dict:
    """Run GRPO as configured (from a checkpoint with `resume`: a path, or "latest" of this run); returns the
    summary also written to <run_dir>/summary.json. The terminal shows rlpipe's own lines and every process's
    warnings; their INFO goes to <run_dir>/logs/run.log (rlpipe/logs.py)."""
    run = prepare(cfg, resume)
    logs = LogSetup(str(run.dir / LOG_FILE), verbose=cfg.run.verbose)
    with driver_logging(logs):
        return _train(cfg, run, logs)


def _train(cfg: Config, run: Run, logs: LogSetup) -> dict:
    from rlpipe.actors.cluster import start_ray
    from rlpipe.actors.roles import Roles

    started = time.monotonic()
    try:
        with run.log.activity("starting Ray and the roles"):
            start_ray(cfg)
            roles = Roles(cfg, run.model_path, run.tokenizer_path, run.resume, note=run.log.note,
                          reward_columns=run.reward_columns, log=logs)
    except BaseException as err:  # the roles never started: leave no run directory behind that this call created
        run.log.close()
        if run.created_dir:
            shutil.rmtree(run.dir, ignore_errors=True)
        if not cfg.run.verbose and not isinstance(err, (ConfigError, KeyboardInterrupt)):
            print("rlpipe: the roles did not start; `rlpipe train --verbose` shows every process's log on the terminal",
                  file=sys.stderr)
        raise
    log = run.log
    try:
        placement = roles.where()  # node id of every actor, per role
        log.note(roles_summary(cfg, placement, logs.file))
        check = roles.rehearsal
        log.note(
            f"weight sync ({roles.routes.in_words()}) checked before training: "
            f"{check['sync/bytes'] / 1e9:.2f} GB from the learner in "
            f"{check['sync/transfer_s']:.2f} s, written in {check['sync/write_s']:.2f} s, "
            f"probe max |engine - learner| {check['sync/probe_max_abs']:.1e}"
        )
        summary = run.summary
        if not summary:
            with log.activity("held-out evaluation before training"):
                summary = {"eval_before": evaluate(roles, run.eval_set, cfg, reward_state(cfg, run, 0, "eval"))}
        summary["sync_check"] = check
        summary["model_path"] = run.model_path  # the folder model.path named (a Hub id: its cached snapshot)
        summary["placement"] = placement
        summary["hosts"] = roles.hosts(placement)  # the node address of every actor, per role
        summary["sync_routes"] = roles.routes.describe()
        summary["python"] = roles.interpreters()  # the interpreter of every actor, per role
        log.note(f"held-out accuracy before training: {summary['eval_before']}")
        watch = FailureWatch(cfg.reward.max_failed_share, cfg.reward.max_failed_steps)
        ahead = Lookahead(run, roles, cfg)
        for step in range(run.first_step, cfg.train.steps + 1):
            clock = Clock()
            doing = f"step {step}/{cfg.train.steps}:"
            with clock("generate"), log.activity(f"{doing} generating"):  # asynchronous mode: what is left of it
                groups = ahead.take(step)
            ahead.start(until=step + cfg.train.max_staleness)  # later steps generate while this one trains
            metrics = staleness_metrics(groups, roles.policy_version)
            with clock("reward"), log.activity(f"{doing} scoring"):
                failures, errors = roles.score(groups, reward_state(cfg, run, step - 1))
            log.reward_errors(errors)
            watch.update(failures, len(groups) * cfg.rollout.group_size, errors)  # a function broken for good stops
            batch, batch_metrics = make_train_batch(groups, cfg, run.pad_id)
            metrics.update(batch_metrics)
            if batch is not None:  # every sample unscored or filtered: nothing to learn from this step
                with clock("train"), log.activity(f"{doing} training"):
                    metrics.update(roles.train(batch))
                with clock("sync"), log.activity(f"{doing} syncing weights"):
                    metrics.update(roles.sync_weights(probe=groups[0]))
            metrics.update(rollout_metrics(groups, cfg.reward.success_threshold, failures))
            metrics.update(clock.metrics(generated_tokens=metrics["completion_tokens"]))
            metrics["rollout/restarts"] = float(sum(roles.engine_restarts))  # engines started again so far
            log.log(step, {**metrics, "policy_version": float(roles.policy_version)})
            log.log_samples(step, groups)
            if step == cfg.train.steps or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                with log.activity(f"{doing} saving a checkpoint"):
                    saved = save_checkpoint(run, roles, step, cfg, summary, ahead.sampler_state())
                log.note(f"checkpoint saved: {saved}")
        with log.activity("held-out evaluation after training"):
            summary["eval_after"] = evaluate(roles, run.eval_set, cfg, reward_state(cfg, run, cfg.train.steps, "eval"))
        log.note(f"held-out accuracy after training: {summary['eval_after']} (before: {summary['eval_before']})")
        if cfg.metrics.export:
            with log.activity("exporting the trained model"):
                summary["export"] = roles.export(str(run.dir / "export"))
            log.note(f"trained model exported to {summary['export']}")
        if cfg.metrics.plot:
            curves = plot_history(log.history, run.dir / "curves.png", cfg.run.name, summary["eval_before"],
                                  summary["eval_after"])
            summary["plot"] = str(curves) if curves else None
        (run.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.note(log.final_line(time.monotonic() - started, logs.file))
        return summary
    finally:
        log.close()
        roles.shutdown()


@dataclass
class Run:
    dir: Path
    model_path: str  # the local folder model.path resolves to (a Hub id or builtin: through its cache)
    tokenizer_path: str | None  # likewise for model.tokenizer
    train_set: PromptSet
    eval_set: PromptSet
    sampler: Sampler
    pad_id: int
    log: MetricsLogger
    reward_columns: list[str]  # the dataset's columns reward functions are called with
    first_step: int = 1
    resume: dict | None = None  # for Roles: the checkpoint's learner state and the ranks' RNG states
    summary: dict | None = None  # a resumed run's summary so far (the held-out accuracy before training)
    created_dir: bool = False  # the run directory did not exist before this run


class Lookahead:
    """Generations started ahead of training. Synchronous mode (train.max_staleness 0) starts each step's
    generation when the step begins; with max_staleness S, steps up to k + S are started while step k trains, so
    a step's samples come from a policy at most S versions older than the learner that trains on them (the loss
    corrects for the lag with the importance weight against their behaviour log-probs, algo.tis_cap / mis)."""

    def __init__(self, run: Run, roles, cfg: Config):
        self.run, self.roles, self.cfg = run, roles, cfg
        self.pending: deque[tuple[dict, object]] = deque()  # (sampler state before the step's draw, generation)
        self.next_step = run.first_step

    def start(self, until: int) -> None:
        while self.next_step <= min(until, self.cfg.train.steps):
            sampler_state = self.run.sampler.state_dict()
            self.roles.seed(self.next_step)  # per-step sampling seeds: a resumed run samples the same way
            prompts = self.run.train_set.prompts(self.run.sampler.next(self.cfg.train.prompts_per_step))
            self.pending.append((sampler_state, self.roles.start_generation(prompts, self.cfg.rollout.group_size)))
            self.next_step += 1

    def take(self, step: int) -> list[Group]:
        self.start(until=step)
        return self.roles.finish_generation(self.pending.popleft()[1])

    def sampler_state(self) -> dict:
        """Where the sampler stood before the first step not yet trained: a checkpoint resumes from there, so
        prompts drawn for a generation still in flight are drawn again."""
        return self.pending[0][0] if self.pending else self.run.sampler.state_dict()


def save_checkpoint(run: Run, roles, step: int, cfg: Config, summary: dict, sampler_state: dict) -> Path:
    """The whole training state after `step`, written atomically (see rlpipe/checkpoint.py)."""

    def trainer_state(learner_rngs: list[str]) -> dict:
        return {
            "step": step,
            "policy_version": roles.policy_version,
            "sampler": sampler_state,
            "rng": checkpoint.rng_state(),
            "learner_rng": learner_rngs,
            "config": cfg.to_dict(),
            "model_path": run.model_path,  # what model.path resolved to: export reads the same files
            "tokenizer_path": run.tokenizer_path,
            "metrics": run.log.history,
            "summary": {"eval_before": summary.get("eval_before")},
        }

    from rlpipe.actors.calls import WorkerLost

    return checkpoint.save(run.dir, step, roles.save_checkpoint, trainer_state, cfg.train.keep_checkpoints,
                           passthrough=(WorkerLost,))


def prepare(cfg: Config, resume: str | None = None) -> Run:
    """Check every input (model, tokenizer, rewards, data, the checkpoint to resume) before a run directory or a
    cluster exists."""
    check_trackers_installed(cfg.metrics)
    interpreters = check_role_environments(cfg)
    if not cfg.ray.address:  # the run's own cluster is this machine; a cluster's resources are checked on joining
        check_learner_device(cfg, interpreters.get("learner"))
    model_path = resolve_model_path(cfg.model.path)
    weight_shapes = check_model(model_path)
    tokenizer_key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    tokenizer_path = resolve_model_path(cfg.model.tokenizer, tokenizer_key) if cfg.model.tokenizer else None
    tokenizer = load_tokenizer(tokenizer_path or model_path, tokenizer_key)
    train_rows, eval_rows = load_rows(cfg.data, cfg.run.seed)
    columns = reward_columns(train_rows, cfg.data.prompt_field)
    RewardRunner([asdict(f) for f in cfg.reward.functions], timeout_s=cfg.reward.timeout_s, columns=columns)
    check_prompts_per_step(cfg, len(train_rows))
    train_set = PromptSet(train_rows, tokenizer, cfg.data)
    eval_set = PromptSet(eval_rows, tokenizer, cfg.data, id_offset=len(train_rows))
    train_set.prompts(range(len(train_set)))  # rejects over-long prompts up front
    eval_set.prompts(range(len(eval_set)))
    sampler = Sampler(len(train_set), cfg.run.seed)
    state = None
    if resume is not None:
        source = checkpoint.resolve(cfg.run_dir if resume == "latest" else resume)
        state = checkpoint.read_trainer_state(source)
        checkpoint.check_fits(source, weight_shapes, f"model.path {cfg.model.path}")
        newer = [p.name for p in checkpoint.list_checkpoints(cfg.run_dir) if p.name > checkpoint.step_name(state["step"])]
        if newer:  # continuing would have to overwrite them
            raise CheckpointError(
                f"checkpoint {source}: {cfg.run_dir} already has later checkpoints ({', '.join(newer)}); resume from "
                f"the latest, or set another run.name to branch off from this one"
            )
        try:
            sampler.load_state_dict(state["sampler"])
        except ValueError as err:  # another dataset, or another run.seed
            raise CheckpointError(f"checkpoint {source}: {err}") from None
    check_ray_address(cfg.ray.address)
    if cfg.ray.dashboard and not cfg.ray.address:
        check_port_free("ray.dashboard_port", "127.0.0.1", cfg.ray.dashboard_port)
    created_dir = not cfg.run_dir.exists()
    run_dir = prepare_run_dir(cfg, resuming=state is not None)
    log = MetricsLogger(run_dir, cfg.train.steps, open_trackers(cfg, run_dir))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    run = Run(run_dir, model_path, tokenizer_path, train_set, eval_set, sampler, pad_id, log, columns, created_dir=created_dir)
    if state is not None:
        log.restore(state["metrics"])
        log.note(f"resuming from {source} (step {state['step']}, policy version {state['policy_version']})")
        checkpoint.set_rng_state(state["rng"])
        run.first_step, run.summary = state["step"] + 1, dict(state["summary"])
        run.resume = {"learner": str(source / checkpoint.LEARNER_STATE), "rng": state["learner_rng"]}
    return run


def make_train_batch(groups: list[Group], cfg: Config, pad_id: int) -> tuple[TrainBatch | None, dict]:
    """Group-relative advantages; unscored samples and (optionally) signal-free groups are left out."""
    rewards = torch.tensor([math.nan if r is None else r for g in groups for r in g.rewards], dtype=torch.float32)
    advantage_scale, drop_uniform_groups = loss_defaults(cfg.algo)
    advantages = group_advantages(rewards, cfg.rollout.group_size, advantage_scale)
    keep = ~rewards.isnan()
    if drop_uniform_groups:
        keep &= ~uniform_groups(rewards, cfg.rollout.group_size).repeat_interleave(cfg.rollout.group_size)
    samples = [(g.prompt, c) for g in groups for c in g.completions]
    chosen = [i for i in range(len(samples)) if keep[i]]
    stats = {
        "samples_trained": float(len(chosen)),
        "advantage/abs_mean": float(advantages[keep].abs().mean()) if chosen else 0.0,
    }
    if not chosen:
        return None, stats
    batch = TrainBatch.from_sequences(
        [samples[i][0].token_ids for i in chosen],
        [samples[i][1].token_ids for i in chosen],
        [samples[i][1].logprobs for i in chosen],
        advantages[chosen].tolist(),
        pad_id=pad_id,
    )
    return batch, stats


def reward_state(cfg: Config, run: Run, steps_done: int, mode: str = "train") -> TrainerState:
    """What reward functions get as `trainer_state` (rewards.TrainerState) for samples scored after `steps_done`
    training steps: a step's samples come after step - 1 of them. A pure function of the step, so a resumed run
    gives its functions what the uninterrupted run would."""
    drawn = steps_done * cfg.train.prompts_per_step
    return trainer_state(global_step=steps_done, max_steps=cfg.train.steps, epoch=drawn / max(1, len(run.train_set)),
                         run_name=cfg.run.name, mode=mode)


def evaluate(roles, eval_set: PromptSet, cfg: Config, state: TrainerState | None = None) -> float | None:
    """Greedy held-out accuracy: the share of prompts whose one completion reaches the success threshold."""
    if len(eval_set) == 0:
        return None
    groups = roles.generate(eval_set.prompts(range(len(eval_set))), 1, temperature=0.0)
    roles.score(groups, state)
    return rollout_metrics(groups, cfg.reward.success_threshold)["accuracy"]


def prepare_run_dir(cfg: Config, resuming: bool = False) -> Path:
    run_dir = cfg.run_dir
    if (run_dir / "metrics.jsonl").exists() and not resuming:
        if not cfg.run.overwrite:
            raise ConfigError(f"run.name: {run_dir} already holds a run (choose another run.name or set run.overwrite=true)")
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run.output_dir: cannot create {run_dir}: {err.strerror}") from None
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return run_dir


def check_model(path: str) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of the model, once its config.json is known to describe a supported model and its
    safetensors (the only weights the learner and the engines load) to be complete and to match it."""
    from rlpipe.models import ModelConfig, read_hf_config
    from rlpipe.models.hf import check_weights

    try:
        ModelConfig.from_hf(read_hf_config(path))
        return check_weights(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path: {err}") from None


def check_prompts_per_step(cfg: Config, train_prompts: int) -> None:
    """A step draws distinct prompts: more than the training set holds would repeat some within the step."""
    if cfg.train.prompts_per_step > train_prompts:
        where = f"data.path {cfg.data.path}" if cfg.data.source == "file" else f"data.source {cfg.data.source}"
        raise ConfigError(
            f"train.prompts_per_step: {cfg.train.prompts_per_step} is more than the training set's {train_prompts} "
            f"prompts ({where})"
        )


def load_tokenizer(path: str, key: str = "model.path"):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ConfigError(f"{key}: {path} is not a folder")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # transformers raises several types, with multi-line messages, for a folder it cannot use
        raise ConfigError(f"{key}: cannot load a tokenizer from {path}: {one_line(err)}") from None


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """A cluster named by ray.address must answer before a run directory exists: ray.init keeps retrying an
    address where nothing listens (still waiting, with warnings, after two minutes for 127.0.0.1:1)."""
    if not address or address in ("auto", "local"):
        return
    host, sep, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        return  # not host:port; ray.init reports it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, OverflowError) as err:
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise ConfigError(f"ray.address: cannot reach {address}: {reason}") from None


def check_port_free(key: str, host: str, port: int) -> None:
    """A port the local cluster is told to listen on must be free: Ray would otherwise start without the service,
    or stop with a long report, after the run directory exists."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to use
        try:
            probe.bind((host, port))
        except OSError as err:
            raise ConfigError(f"{key}: {host}:{port} is in use or not available ({err.strerror}); choose another port") from None


class Clock:
    """Wall time of each phase of a step, the time the driver spends outside them (its own overhead), and the CPU
    time the driver process used (serialisation, batching, metrics) over the whole step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.started = time.monotonic()
        self.started_cpu = time.process_time()

    def __call__(self, phase: str):
        clock = self

        class _Phase:
            def __enter__(self):
                self.t0 = time.monotonic()

            def __exit__(self, *exc):
                clock.seconds[phase] = clock.seconds.get(phase, 0.0) + time.monotonic() - self.t0

        return _Phase()

    def metrics(self, generated_tokens: float) -> dict[str, float]:
        step = time.monotonic() - self.started
        return {
            **{f"time/{k}": v for k, v in self.seconds.items()},
            "time/step": step,
            "time/outside_phases": step - sum(self.seconds.values()),
            "time/driver_cpu": time.process_time() - self.started_cpu,
            "tokens_per_s/generate": generated_tokens / max(self.seconds.get("generate", 0.0), 1e-9),
        }
