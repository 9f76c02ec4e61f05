"""The GRPO loop: sample prompts → generate → score → advantages → train → sync weights; synchronous, or with the
generation of later steps started while a step trains (train.max_staleness, `Lookahead`)."""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from rlpipe.training import checkpoint
from rlpipe.run import evaluation
from rlpipe.startup import preflight
from rlpipe.algo import estimate_advantages, loss_defaults, uniform_groups
from rlpipe.config import Config, ConfigError
from rlpipe.data import chat_render
from rlpipe.data.prompts import PromptSet, Sampler, drop_overlong_prompts, load_rows, reward_columns
from rlpipe.reporting.logs import LOG_FILE, LogSetup, driver_logging
from rlpipe.reporting.metrics import MetricsLogger, roles_summary, rollout_metrics, staleness_metrics
from rlpipe.reporting.plots import plot_history
from rlpipe.models.builtin import resolve_model_path
from rlpipe.run.progress import RunProgress, holds_steps
from rlpipe.reporting.trackers import check_trackers_installed, open_trackers
from rlpipe.types import Group, LoopRoles, StepScores, TrainBatch
from rlpipe.weightsync.form import Kind, weight_form
from rlpipe.rewards import FailureWatch, TrainerState, trainer_state
from rlpipe.rewards.contract import EPISODE_COLUMNS

logger = logging.getLogger(__name__)


def train(cfg: Config, resume: str | None = None, progress: RunProgress | None = None) -> dict:
    """Run GRPO as configured (from a checkpoint with `resume`: a path, or "latest" of this run); returns the
    summary also written to <run_dir>/summary.json. The terminal shows rlpipe's own lines and every process's
    warnings; their INFO goes to <run_dir>/logs/run.log (rlpipe/reporting/logs.py). `progress`, where given, is kept
    up to date with the step reached and the newest checkpoint, for the caller to report a run that stops."""
    progress = RunProgress() if progress is None else progress
    run = prepare(cfg, resume)
    progress.begin(run.dir, cfg.train.steps, run.resumed_from, run.first_step - 1)
    logs = LogSetup(str(run.dir / LOG_FILE), verbose=cfg.run.verbose)
    with driver_logging(logs):
        try:
            return _train(cfg, run, logs, progress)
        except BaseException:  # the terminal gets one line from the caller; the traceback is kept in run.log
            logger.info("%s", progress.where(), exc_info=True)
            raise


def _train(cfg: Config, run: Run, logs: LogSetup, progress: RunProgress) -> dict:
    from rlpipe.actors.cluster import start_ray
    from rlpipe.actors.roles import Roles

    started = time.monotonic()
    try:
        # What a version of the weights is (full, merged adapters, adapters alone), decided once for every role.
        form = weight_form(cfg, run.model_path)
        with run.log.activity("starting Ray and the roles"):
            began = time.monotonic()
            start_ray(cfg)
            startup = {"startup/ray_s": time.monotonic() - began}
            roles = Roles(cfg, run.model_path, run.tokenizer_path, run.resume, note=run.log.note,
                          reward_columns=run.reward_columns, log=logs, form=form)
            startup["startup/roles_s"] = time.monotonic() - began - startup["startup/ray_s"]
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
            f"{check['sync/transfer_s']:.2f} s, written in {check['sync/write_s']:.2f} s, probe replayed in "
            f"{check['sync/probe_s']:.2f} s, max |engine - learner| {check['sync/probe_max_abs']:.1e}"
        )
        if form.kind is not Kind.FULL:
            log.note(f"weight sync: {form.describe(adapter_bytes=check['sync/bytes'])}")
        summary = run.summary or {}
        summary.setdefault("eval", [])  # every held-out evaluation's figures, before training (step 0) on
        startup.update(roles.startup)
        if "eval_before" not in summary:
            began = time.monotonic()
            with log.activity("held-out evaluation before training"):
                evaluate(roles, run, cfg, 0, summary)
            summary["eval_before"] = summary["eval"][0]["accuracy"] if summary["eval"] else None
            startup["startup/eval_before_s"] = time.monotonic() - began
        summary["startup"] = startup
        logger.info("start-up: %s", ", ".join(f"{key.removeprefix('startup/').removesuffix('_s')} {value:.1f} s"
                                               for key, value in startup.items()))
        summary["sync_check"] = check
        summary["model_path"] = run.model_path  # the folder model.path named (a Hub id: its cached snapshot)
        summary["placement"] = placement
        summary["hosts"] = roles.hosts(placement)  # the node address of every actor, per role
        summary["sync_routes"] = roles.routes.describe()
        summary["python"] = roles.interpreters()  # the interpreter of every actor, per role
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
                scores = roles.score(groups, reward_state(cfg, run, step - 1))
            trained = groups
            if cfg.algo.dynamic_sampling:  # DAPO's: generate (and score) again until enough groups have signal
                with clock("generate"), log.activity(f"{doing} generating more groups with signal"):
                    groups, scores, trained, sampling = with_enough_signal(groups, scores, step, run, roles, cfg)
                metrics.update(sampling)
            log.reward_errors(scores.errors)
            # A function broken for good stops the run.
            watch.update(scores.failures, len(groups) * cfg.rollout.group_size, scores.errors, scores.timeouts)
            batch, batch_metrics = make_train_batch(trained, cfg, run.pad_id)
            metrics.update(batch_metrics)
            if batch is not None:  # every sample unscored or filtered: nothing to learn from this step
                with clock("train"), log.activity(f"{doing} training"):
                    metrics.update(roles.train(batch))
                with clock("sync"), log.activity(f"{doing} syncing weights"):
                    metrics.update(roles.sync_weights(probe=groups[0]))
            metrics.update(rollout_metrics(groups, cfg.reward.success_threshold, scores.failures, scores.timeouts))
            metrics.update({f"reward/logged/{name}": value for name, value in scores.logged.items()})
            metrics.update(clock.metrics(generated_tokens=metrics["completion_tokens"]))
            metrics["rollout/restarts"] = float(sum(roles.engine_restarts))  # engines started again so far
            metrics.update(roles.retries)  # work done again so far
            if evaluation.due(step, cfg):
                with log.activity(f"{doing} evaluating the held-out set"):
                    metrics.update(evaluate(roles, run, cfg, step, summary, note=False))
            log.log(step, {**metrics, "policy_version": float(roles.policy_version)})
            progress.step = step
            log.log_samples(step, groups)
            if step == cfg.train.steps or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                with log.activity(f"{doing} saving a checkpoint"):
                    saved = save_checkpoint(run, roles, step, cfg, summary, ahead.sampler_state())
                progress.saved(saved, step)
                log.note(f"checkpoint saved: {saved}")
        if not any(point["step"] == cfg.train.steps for point in summary["eval"]):  # no step ran in this call
            with log.activity("held-out evaluation after training"):
                evaluate(roles, run, cfg, cfg.train.steps, summary)
        summarize_evaluations(run, summary, cfg.train.steps)
        if cfg.metrics.export:
            with log.activity("exporting the trained model"):
                summary["export"] = roles.export(str(run.dir / "export"))
            log.note(f"trained model exported to {summary['export']}")
        if cfg.metrics.plot:
            curves = plot_history(log.history, run.dir / "curves.png", cfg.run.name, summary["eval_before"],
                                  summary["eval_after"], eval_points=summary["eval"])
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
    resumed_from: Path | None = None  # the checkpoint the run continues from
    summary: dict | None = None  # a resumed run's summary so far (its held-out evaluations)
    created_dir: bool = False  # the run directory did not exist before this run


class Lookahead:
    """Generations started ahead of training. Synchronous mode (train.max_staleness 0) starts each step's
    generation when the step begins; with max_staleness S, steps up to k + S are started while step k trains, so
    a step's samples come from a policy at most S versions older than the learner that trains on them (the loss
    corrects for the lag with the importance weight against their behaviour log-probs, algo.tis_cap / mis)."""

    def __init__(self, run: Run, roles: LoopRoles, cfg: Config):
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
    """The whole training state after `step`, written atomically (see rlpipe/training/checkpoint.py)."""

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
            "summary": {"eval_before": summary.get("eval_before"), "eval": summary.get("eval", [])},
        }

    from rlpipe.actors.calls import WorkerLost

    return checkpoint.save(run.dir, step, roles.save_checkpoint, trainer_state, cfg.train.keep_checkpoints,
                           passthrough=(WorkerLost,))


def prepare(cfg: Config, resume: str | None = None) -> Run:
    """Check every input (model, tokenizer, rewards, data, the checkpoint to resume) before a run directory or a
    cluster exists: the start-up checks of rlpipe/startup/preflight.py in order, with the trackers' and the data's own."""
    if cfg.data.chat_template != "none":  # the prompts' renderer starts beside the checks before its first prompt
        chat_render.start_renderer()
    check_trackers_installed(cfg.metrics)
    preflight.check_tpu_slices(cfg)
    preflight.check_gpu_layout(cfg)
    interpreters = preflight.check_role_environments(cfg)
    if not cfg.ray.address:  # the run's own cluster is this machine; a cluster's resources are checked on joining
        preflight.check_learner_device(cfg, interpreters.get("learner"))
    model_path = resolve_model_path(cfg.model.path)
    weight_shapes = preflight.check_model(model_path)
    preflight.check_model_impl(cfg, model_path, weight_shapes)
    preflight.check_gpu_memory(cfg, model_path)
    tokenizer_path, tokenizer = preflight.check_tokenizer(cfg.model, model_path)
    train_rows, eval_rows = load_rows(cfg.data, cfg.run.seed)
    columns = reward_columns(train_rows, cfg.data.prompt_field)
    if cfg.rollout.environment_factory:  # reward functions also get each episode's environment (TRL's)
        columns = [*columns, *EPISODE_COLUMNS]
    preflight.check_reward_functions(cfg.reward, columns)
    preflight.check_teacher(cfg, tokenizer)
    preflight.check_rollout_tools(cfg.rollout, tokenizer, cfg.data.chat_template_kwargs)
    limit = cfg.max_prompt_tokens
    train_set = PromptSet(train_rows, tokenizer, cfg.data, max_prompt_tokens=limit)
    eval_set = PromptSet(eval_rows, tokenizer, cfg.data, id_offset=len(train_rows), max_prompt_tokens=limit)
    dropped = drop_overlong_prompts(train_set, eval_set) if cfg.data.overlong == "drop" else None
    preflight.check_prompts_per_step(cfg, len(train_set))
    preflight.check_prompts(train_set, eval_set)
    sampler = Sampler(len(train_set), cfg.run.seed)
    source, state = preflight.check_resume(cfg, resume, weight_shapes, sampler) if resume is not None else (None, None)
    preflight.check_ray_address(cfg.ray.address)
    if cfg.ray.dashboard and not cfg.ray.address:
        preflight.check_port_free("ray.dashboard_port", "127.0.0.1", cfg.ray.dashboard_port)
    created_dir = not cfg.run_dir.exists()
    run_dir = prepare_run_dir(cfg, resuming=state is not None)
    log = MetricsLogger(run_dir, cfg.train.steps, open_trackers(cfg, run_dir))
    if dropped:
        log.note(dropped)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    run = Run(run_dir, model_path, tokenizer_path, train_set, eval_set, sampler, pad_id, log, columns, created_dir=created_dir)
    if state is not None:
        log.restore(state["metrics"])
        log.note(f"resuming from {source} (step {state['step']}, policy version {state['policy_version']})")
        checkpoint.set_rng_state(state["rng"])
        run.first_step, run.summary = state["step"] + 1, dict(state["summary"])
        run.resume = {"learner": str(source / checkpoint.LEARNER_STATE), "rng": state["learner_rng"]}
        run.resumed_from = source
    return run


# Extra generation rounds are seeded as step + round x this: no run has this many steps.
_EXTRA_ROUND_SEEDS = 1_000_000


def with_enough_signal(
    groups: list[Group], scores: StepScores, step: int, run: Run, roles: LoopRoles, cfg: Config
) -> tuple[list[Group], StepScores, list[Group], dict[str, float]]:
    """DAPO's dynamic sampling (algo.dynamic_sampling): while fewer than train.prompts_per_step of the step's scored
    groups have signal (rewards not all equal, `uniform_groups`), draw that many more prompts, generate and score
    them, up to algo.max_generation_rounds rounds in all. Returns every group generated and their scores (for the
    step's metrics and logs), the groups to train on (the first prompts_per_step with signal), and how many rounds
    and groups it took. Each extra round's engines are seeded from the step and the round, so a resumed run draws
    and samples the same."""
    wanted, size = cfg.train.prompts_per_step, cfg.rollout.group_size

    def with_signal(some: list[Group]) -> list[Group]:
        flags = ~uniform_groups(group_rewards(some), size) if some else torch.zeros(0, dtype=torch.bool)
        return [group for group, signal in zip(some, flags.tolist()) if signal]

    rounds, kept = 1, with_signal(groups)
    while len(kept) < wanted and rounds < cfg.algo.max_generation_rounds:
        roles.seed(step + rounds * _EXTRA_ROUND_SEEDS)  # apart from every step's own, whatever train.steps
        prompts = run.train_set.prompts(run.sampler.next(wanted))
        extra = roles.finish_generation(roles.start_generation(prompts, size))
        more = roles.score(extra, reward_state(cfg, run, step - 1))
        groups, scores, rounds = groups + extra, merged_scores(scores, more, len(groups), len(extra)), rounds + 1
        kept += with_signal(extra)
    return groups, scores, kept[:wanted], {
        "sampling/rounds": float(rounds), "sampling/groups_generated": float(len(groups)),
        "sampling/groups_with_signal": float(len(kept)),
    }


def merged_scores(first: StepScores, second: StepScores, first_groups: int, second_groups: int) -> StepScores:
    """Two rounds' scores as one step's: counts added, each function's first error, logged means weighed by groups."""
    def added(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {name: a.get(name, 0) + b.get(name, 0) for name in {**a, **b}}

    total = first_groups + second_groups
    logged = {name: (first.logged.get(name, 0.0) * first_groups + second.logged.get(name, 0.0) * second_groups) / total
              for name in {**first.logged, **second.logged}}
    return StepScores(added(first.failures, second.failures), {**second.errors, **first.errors}, logged,
                      added(first.timeouts, second.timeouts))


def group_rewards(groups: list[Group]) -> torch.Tensor:
    """The groups' rewards end to end, NaN where a sample is unscored (`group_advantages`' layout)."""
    return torch.tensor([math.nan if r is None else r for g in groups for r in g.rewards], dtype=torch.float32)


def make_train_batch(groups: list[Group], cfg: Config, pad_id: int) -> tuple[TrainBatch | None, dict]:
    """Advantages by algo.advantage_estimator; unscored samples and (optionally) signal-free groups are left out."""
    rewards = group_rewards(groups)
    advantage_scale, drop_uniform_groups = loss_defaults(cfg.algo)
    samples = [(g.prompt, c) for g in groups for c in g.completions]
    # The tokens each sample trains (a multi-turn episode's own), over which REINFORCE++ whitens.
    tokens = torch.tensor([c.model_tokens for _, c in samples], dtype=torch.float32)
    advantages = estimate_advantages(rewards, cfg.rollout.group_size, cfg.algo.advantage_estimator, advantage_scale,
                                     std=cfg.algo.advantage_std, tokens=tokens)
    keep = ~rewards.isnan()
    if drop_uniform_groups:
        keep &= ~uniform_groups(rewards, cfg.rollout.group_size).repeat_interleave(cfg.rollout.group_size)
    chosen = [i for i in range(len(samples)) if keep[i]]
    stats = {
        "samples_trained": float(len(chosen)),
        "advantage/abs_mean": float(advantages[keep].abs().mean()) if chosen else 0.0,
    }
    if not chosen:
        return None, stats
    distilling = cfg.algo.distill_teacher is not None
    if distilling and not cfg.algo.distill_rewards:  # the teacher's signal alone
        advantages = torch.zeros_like(advantages)
    batch = TrainBatch.from_sequences(
        [samples[i][1].prompt_ids or samples[i][0].token_ids for i in chosen],  # an episode's prompt has its tools
        [samples[i][1].token_ids for i in chosen],
        [samples[i][1].logprobs for i in chosen],
        advantages[chosen].tolist(),
        pad_id=pad_id,
        masks=[samples[i][1].mask for i in chosen],
        teacher_logprobs=[samples[i][1].teacher_logprobs for i in chosen] if distilling else None,
    )
    if distilling:
        stats["distill/untaught_samples"] = float(sum(samples[i][1].teacher_logprobs is None for i in chosen))
    if cfg.algo.mask_truncated_completions:
        # Their rewards stay in their groups' statistics; their tokens leave the loss and its token count, and
        # advantage 0 lets the learner skip the rows (they still count as sequences, as TRL counts them).
        truncated = torch.tensor([samples[i][1].finish_reason == "length" for i in chosen])
        batch.completion_mask[truncated] = False
        batch.advantages[truncated] = 0.0
    return batch, stats


def reward_state(cfg: Config, run: Run, steps_done: int, mode: str = "train") -> TrainerState:
    """What reward functions get as `trainer_state` (rewards.TrainerState) for samples scored after `steps_done`
    training steps: a step's samples come after step - 1 of them. A pure function of the step, so a resumed run
    gives its functions what the uninterrupted run would."""
    drawn = steps_done * cfg.train.prompts_per_step
    return trainer_state(global_step=steps_done, max_steps=cfg.train.steps, epoch=drawn / max(1, len(run.train_set)),
                         run_name=cfg.run.name, mode=mode)


def evaluate(roles: LoopRoles, run: Run, cfg: Config, step: int, summary: dict, note: bool = True) -> dict[str, float]:
    """The held-out evaluation after `step` steps (rlpipe/run/evaluation.py), added to the summary's points and noted
    (`note`; a step's evaluation shows in the step's line); returns its metrics for the step's record (none without
    held-out prompts)."""
    point = evaluation.evaluate(roles, run.eval_set, cfg, step, reward_state(cfg, run, step, "eval"))
    if point is None:
        return {}
    summary["eval"].append(point)
    if note:
        when = "before training" if step == 0 else f"after step {step}"
        run.log.note(f"held-out accuracy {when}: {evaluation.describe(point)}")
    return evaluation.metrics(point)


def summarize_evaluations(run: Run, summary: dict, last_step: int) -> None:
    """eval_after (the greedy accuracy after the last step) and eval_best (the best point, with the checkpoint saved
    at its step while one is kept), noted on the terminal."""
    after = next((point for point in summary["eval"] if point["step"] == last_step), None)
    summary["eval_after"] = after["accuracy"] if after else None
    best = evaluation.best(summary["eval"])
    if best is not None:
        saved = run.dir / checkpoint.CHECKPOINTS / checkpoint.step_name(best["step"])
        best = {**best, "checkpoint": str(saved) if saved.is_dir() else None}
    summary["eval_best"] = best
    if best is not None:
        kept = f", checkpoint {best['checkpoint']}" if best["checkpoint"] else ""
        run.log.note(f"held-out accuracy after training: {summary['eval_after']} (before: {summary['eval_before']}); "
                     f"best at step {best['step']}: {evaluation.describe(best)}{kept}")


def prepare_run_dir(cfg: Config, resuming: bool = False) -> Path:
    run_dir = cfg.run_dir
    if holds_steps(run_dir) and not resuming:
        if not cfg.run.overwrite:
            raise ConfigError(f"run.name: {run_dir} already holds a run (choose another run.name or set run.overwrite=true)")
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run.output_dir: cannot create {run_dir}: {err.strerror}") from None
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return run_dir


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
