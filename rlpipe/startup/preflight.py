"""Start-up checks: what can be checked about a run's surroundings before a run directory or a cluster exists.

The recipe's own keys are checked when the config loads (each section beside its definition in rlpipe/config/).
These check what the keys point at: the roles' Python environments, the learner's device, the model folder and its
tokenizer, the reward functions against the dataset's columns, the prompts, the checkpoint to resume, the cluster's
address, resources and ports, and the roles' TPU chips. Each is a `check_<what>` that raises a one-line
ConfigError naming the key to change (check_reward_functions: the reward registry's RewardConfigError naming the
function; check_resume: a CheckpointError naming the checkpoint). controller.prepare calls them in one sequence; submit.py checks the
resources of the cluster it submits to, and actors/ those of the cluster the roles start on.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from rlpipe.training import checkpoint
from rlpipe.training.checkpoint import CheckpointError
from rlpipe.config import Config, ConfigError, ModelConfig, RewardConfig, one_line
from rlpipe.data.prompts import PromptSet, Sampler
from rlpipe.hardware.device import learner_processes
from rlpipe.startup.interpreters import NoAnswer, interpreter, ask_device, ask_imports, role_modules
from rlpipe.models.builtin import resolve_model_path
from rlpipe.rewards import RewardRunner
from rlpipe.rewards.specs import scored_by_a_model
from rlpipe.scoring.served import served_models
from rlpipe.hardware.gpu_layout import gpu_layout, gpu_problems, gpus_of_cluster_needed
from rlpipe.hardware.tpu_layout import slice_problems

# ---------------------------------------------------------------- the TPU slices


def check_tpu_slices(cfg: Config) -> None:
    """The roles' actors fill the chips their slices give them (what `rlpipe plan` reports as problems)."""
    problems = slice_problems(cfg)
    if problems:
        raise ConfigError(problems[0])


def check_gpu_layout(cfg: Config) -> None:
    """The learner ranks' and engines' GPUs make a layout Ray can place (rlpipe/hardware/gpu_layout.py)."""
    problems = gpu_problems(cfg)
    if problems:
        raise ConfigError(problems[0])


def check_gpu_memory(cfg: Config, model_path: str) -> None:
    """Where placement.gpu_memory_gib states the GPUs' memory: an engine's weights and KV cache fit in what its vLLM
    claims, and the fullest GPU's learner rank and engine in the GPU (`rlpipe plan`'s GPU figures)."""
    if cfg.placement.gpu_memory_gib is None or not gpu_layout(cfg).on_gpus:
        return
    from rlpipe.plan import plan
    from rlpipe.plan.gpu import gpu_problems_of_plan
    from rlpipe.plan.model_size import load_architecture

    result = plan(cfg, load_architecture(model_path)[0])
    problems = gpu_problems_of_plan(cfg, result.rollout)
    if problems:
        raise ConfigError(problems[0])
    gpu = result.peak("gpu")
    if gpu.fits is False:
        held = " + ".join(f"{part.label} {part.gib:.2f}" for part in gpu.parts)
        raise ConfigError(f"placement.gpu_memory_gib: the fullest GPU would hold {gpu.total_gib:.2f} GiB ({held}) of "
                          f"{cfg.placement.gpu_memory_gib:g} GiB")


# ---------------------------------------------------------------- the roles' environments and the learner's device


def check_role_environments(cfg: Config) -> dict[str, str]:
    """Check every role that names its own environment; returns role -> interpreter for those roles."""
    chosen = {}
    modules = role_modules(cfg)
    for role in ("learner", "rollout", "reward", "scorer"):
        path = getattr(cfg.placement, role).python
        if path is None:
            continue
        key = f"placement.{role}.python"
        chosen[role] = interpreter(key, path)
        check_environment(key, chosen[role], modules[role])
    return chosen


def check_environment(key: str, python: str, modules: list[str], timeout_s: float = 180.0) -> None:
    """Raise a one-line ConfigError unless `python` runs this Python minor version and Ray version and imports
    every one of `modules` (imported for real, in a child process, with this process's environment)."""
    try:
        report = ask_imports(python, modules, timeout_s)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{key}: {python} did not import {', '.join(modules)} within {timeout_s:.0f} s") from None
    except OSError as err:
        raise ConfigError(f"{key}: cannot run {python} ({err.strerror})") from None
    except NoAnswer as err:
        raise ConfigError(f"{key}: {python} failed to start ({err})") from None
    ours = "%d.%d" % sys.version_info[:2]
    if report["python"] != ours:
        raise ConfigError(
            f"{key}: {python} runs Python {report['python']}; the driver runs {ours}, and Ray needs the same"
        )
    ray_version = metadata.version("ray")
    if report["ray"] != ray_version:
        found = f"Ray {report['ray']}" if report["ray"] else "no Ray"
        raise ConfigError(f"{key}: {python} has {found}; the driver has Ray {ray_version}, and the roles need the same")
    if report["missing"]:
        name, reason = next(iter(report["missing"].items()))
        raise ConfigError(f"{key}: {python} cannot import {name} ({reason})")


def check_learner_device(cfg: Config, python: str | None, timeout_s: float = 180.0) -> None:
    """Raise a one-line ConfigError unless the learner's environment (`python`, None: the driver's) has a
    `learner.device` to train on, asked there with the environment a learner actor gets. This machine's
    environment is the one that counts for a run on its own local cluster; a run that joins a cluster
    (`ray.address`) checks that cluster's resources instead (`check_cluster_resources`)."""
    kind = cfg.learner.device
    if kind == "cpu":
        return
    where = f"placement.learner.python {python}" if python else f"the driver's environment {sys.executable}"
    try:
        reason = ask_device(python or sys.executable, kind, cfg.learner.ranks, timeout_s)
    except subprocess.TimeoutExpired:
        reason = f"no answer within {timeout_s:.0f} s"
    except NoAnswer as err:
        reason = str(err)
    if reason:
        hint = "" if python else "; placement.learner.python names an environment that has it"
        raise ConfigError(f"learner.device: {kind!r} is not available to {where}: {reason}{hint}")


# ---------------------------------------------------------------- the cluster


def actors_needed(cfg: Config) -> int:
    """The CPU bundles the roles reserve off TPU slices: one per learner process, rollout engine, reward worker and,
    where reward.functions names a reward model or algo.distill_teacher a teacher, scorer."""
    scored = any(scored_by_a_model(f.name) for f in cfg.reward.functions) or cfg.algo.distill_teacher is not None
    scorers = cfg.scorer.num_workers if scored else 0
    return (learner_processes(cfg.learner.device, cfg.learner.ranks) + cfg.rollout.num_engines
            + cfg.reward.num_workers + scorers)


def check_cluster_resources(cfg: Config, resources: dict[str, float], address: str | None = None) -> None:
    """Raise a one-line ConfigError unless `resources` (a cluster's totals, as `ray.cluster_resources()` gives
    them) can hold the roles: their CPUs, the learner ranks' and engines' GPUs, TPU chips where a device or slice needs
    them. `address` names a cluster the run is submitted to; None: the one the run is on. Custom resources and
    slice shapes are the placement's to check (it waits for them, then says which)."""
    where = f"the cluster at {address}" if address else "the cluster"
    tpu_keys = [key for key, wanted in (("learner.device", cfg.learner.device == "tpu"),
                                        ("placement.learner.tpu", cfg.placement.learner.tpu),
                                        ("placement.rollout.tpu", cfg.placement.rollout.tpu)) if wanted]
    on_tpu = bool(tpu_keys)
    needed = actors_needed(cfg)
    if not on_tpu and resources.get("CPU", 0) < needed:
        own = not (address or cfg.ray.address)  # a cluster the run starts itself has ray.num_cpus CPUs
        key = "ray.num_cpus" if own else "learner.ranks / rollout.num_engines / reward.num_workers"
        raise ConfigError(
            f"{key}: {where} has {resources.get('CPU', 0):g} CPUs but the roles need {needed} "
            f"(one each per learner process, rollout engine, reward worker and scorer)"
        )
    layout = gpu_layout(cfg)
    if layout.on_gpus and resources.get("GPU", 0) < layout.gpus - 1e-9:
        key = "learner.device" if cfg.learner.device == "cuda" else "placement.rollout.gpus"
        raise ConfigError(
            f"{key}: the roles need {gpus_of_cluster_needed(cfg)} GPU(s) ({layout.describe()}), {where} has "
            f"{resources.get('GPU', 0):g}"
        )
    if on_tpu and not resources.get("TPU", 0):
        raise ConfigError(
            f"{tpu_keys[0]}: the run needs TPU chips, {where} has no TPU resource "
            f"(resources: {', '.join(sorted(k for k in resources if not k.startswith('node:')))})"
        )


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
            raise ConfigError(
                f"{key}: {host}:{port} is in use or not available ({err.strerror}); choose another port"
            ) from None


# ---------------------------------------------------------------- the model, the data, the rewards, the checkpoint


def check_model(path: str) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of the model, once its config.json is known to describe a supported model and its
    safetensors (the only weights the learner and the engines load) to be complete and to match it (see
    rlpipe/models/checks.py: headers only, counts compared before a model is built)."""
    from rlpipe.models.hf import check_weights

    try:
        return check_weights(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path: {err}") from None


def check_model_impl(cfg: Config, model_path: str, weight_shapes: dict[str, tuple[int, ...]]) -> None:
    """model.impl against the model and the run: rlpipe's code asked for a family it does not have, and, for a model
    transformers runs, what only rlpipe's decoder offers (the captured step, the Pallas kernels, the XLA and TPU
    learners, rlpipe's model inside vLLM, mixtures of experts) and weights the sync cannot name are refused in one
    line naming the key. `weight_shapes`: the model's weights, as `check_model` read them."""
    from rlpipe.models import read_hf_config
    from rlpipe.models.registry import implementation, model_architecture, model_type_of

    hf_config = read_hf_config(model_path)
    try:
        impl = implementation(hf_config, cfg.model.impl)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if impl == "rlpipe":
        return
    family = f"model_type {model_type_of(hf_config)!r} runs on transformers' code (model.impl {cfg.model.impl})"
    kernels = cfg.model.kernels
    refusals = [
        (model_architecture(hf_config).num_experts > 0, "model.impl",
         "a mixture of experts runs on rlpipe's code only"),
        (cfg.learner.graph, "learner.graph", "the captured step is rlpipe's decoder's; set learner.graph=false"),
        (cfg.learner.device in ("xla", "tpu"), "learner.device",
         f"the {cfg.learner.device} learner runs rlpipe's decoder only; use cpu or cuda"),
        (kernels.rmsnorm != "torch", "model.kernels.rmsnorm", "the Pallas kernels run in rlpipe's decoder only"),
        (kernels.attention != "torch", "model.kernels.attention", "the Pallas kernels run in rlpipe's decoder only"),
        (cfg.rollout.model_impl == "rlpipe", "rollout.model_impl",
         "rlpipe's model inside vLLM is its decoder; use vllm"),
    ]
    for refused, key, why in refusals:
        if refused:
            raise ConfigError(f"{key}: {family}: {why}")
    # The weight sync sends the learner's names, which vLLM's model of the family loads as they are when they follow
    # the Llama layout (`model.` and `lm_head.`); under another prefix vLLM's names differ from the checkpoint's.
    other = sorted({name.split(".")[0] for name in weight_shapes} - {"model", "lm_head"})
    if other:
        raise ConfigError(f"model.path: {family}: its weights lie under {other[0]}., which vLLM's engine holds under "
                          "other names; the weight sync maps only model. and lm_head.")


def check_tokenizer(model: ModelConfig, model_path: str) -> tuple[str | None, Any]:
    """The folder model.tokenizer names (None: the tokenizer is the model's own, in `model_path`) and the tokenizer
    loaded from it; a folder that is missing, holds no tokenizer or links a file from outside itself (see
    rlpipe/models/checks.py) raises a ConfigError naming the key."""
    from transformers import AutoTokenizer

    from rlpipe.models.checks import ModelFileError, check_links

    key = "model.tokenizer" if model.tokenizer else "model.path"
    own_folder = resolve_model_path(model.tokenizer, key) if model.tokenizer else None
    path = own_folder or model_path
    if not Path(path).is_dir():
        raise ConfigError(f"{key}: {path} is not a folder")
    try:
        check_links(path)
    except ModelFileError as err:
        raise ConfigError(f"{key}: {err}") from None
    try:
        return own_folder, AutoTokenizer.from_pretrained(path)
    except Exception as err:  # transformers raises several types, with multi-line messages, for a folder it cannot use
        raise ConfigError(f"{key}: cannot load a tokenizer from {path}: {one_line(err)}") from None


def check_reward_functions(reward: RewardConfig, columns: list[str]) -> None:
    """Every reward function imports and can take the call it will get, the dataset's `columns` included, every
    reward model is a one-label sequence-classifier the scorer can load, and every judge's settings and model are
    usable; raises the reward registry's RewardConfigError (reported as a config error) naming the entry."""
    RewardRunner([asdict(f) for f in reward.functions], timeout_s=reward.timeout_s, columns=columns)
    served_models(reward.functions, columns, check=True)


def check_teacher(cfg: Config, tokenizer) -> None:
    """A distillation teacher (algo.distill_teacher) has the policy's tokenizer (`tokenizer`) and a folder vLLM can
    start from; raises a one-line RewardConfigError naming the key."""
    from rlpipe.scoring.served import served_teacher
    from rlpipe.scoring.teacher import check_teacher as check_teacher_model

    for model in served_teacher(cfg.algo.distill_teacher).values():
        check_teacher_model(model.folder, tokenizer)


def check_rollout_tools(rollout, tokenizer, template_kwargs: dict) -> None:
    """The recipe's tools (`rollout`: a RolloutConfig), before any cluster starts: a tool that cannot load, or that
    runs model-written code where the sandbox cannot isolate it, a verifiers task set whose tool servers do not
    start, and a model whose tool-call format rollout.tool_parser cannot tell, are refused in one line here rather
    than as an engine's error."""
    if rollout.multi_turn:
        from rlpipe.tools.formats import tool_parser_for

        try:
            tool_parser_for(tokenizer, rollout.tool_parser, template_kwargs)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if rollout.tools:
        from rlpipe.tools import check_tools

        check_tools(rollout)
    if rollout.verifiers_tools:
        from rlpipe.data.verifiers import taskset_tools

        taskset_tools(rollout.verifiers_tools)


def check_prompts_per_step(cfg: Config, train_prompts: int) -> None:
    """A step draws distinct prompts: more than the training set holds would repeat some within the step."""
    if cfg.train.prompts_per_step > train_prompts:
        where = f"data.path {cfg.data.path}" if cfg.data.source == "file" else f"data.source {cfg.data.source}"
        raise ConfigError(
            f"train.prompts_per_step: {cfg.train.prompts_per_step} is more than the training set's {train_prompts} "
            f"prompts ({where})"
        )


def check_prompts(*prompt_sets: PromptSet) -> None:
    """Every prompt renders, within data.max_prompt_tokens: rendered once here, not first met mid-run."""
    for prompts in prompt_sets:
        prompts.prompts(range(len(prompts)))


def check_resume(
    cfg: Config, resume: str, weight_shapes: dict[str, tuple[int, ...]], sampler: Sampler
) -> tuple[Path, dict]:
    """The checkpoint `resume` names (a path, or "latest" of this run) and its trainer state, with `sampler` moved to
    where it stopped. Raises a CheckpointError naming the checkpoint unless its weights have `weight_shapes`, no
    later checkpoint of this run would be overwritten, and its sampler state is for this dataset and run.seed."""
    source = checkpoint.resolve(cfg.run_dir if resume == "latest" else resume)
    state = checkpoint.read_trainer_state(source, needs=checkpoint.RESUME_FIELDS)
    checkpoint.check_fits(source, weight_shapes, f"model.path {cfg.model.path}")
    checkpoint.check_trains_alike(source, lora=cfg.learner.lora is not None)
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
    return source, state
