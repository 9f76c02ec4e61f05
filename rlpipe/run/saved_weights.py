"""`rlpipe eval`: the held-out evaluation of saved weights (an exported HF folder, a run, a checkpoint) on engines and
reward workers of their own, without a learner."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import yaml

from rlpipe.actors.cluster import start_ray
from rlpipe.actors.eval_roles import EvalRoles
from rlpipe.config import Config, ConfigError, default_recipe, load_config
from rlpipe.data.prompts import PromptSet, load_rows, reward_columns
from rlpipe.reporting.logs import LogSetup, driver_logging
from rlpipe.rewards.contract import EPISODE_COLUMNS
from rlpipe.run import evaluation
from rlpipe.run.controller import reward_state
from rlpipe.startup import preflight
from rlpipe.training import checkpoint
from rlpipe.training.checkpoint import CheckpointError


def evaluate_saved_weights(path: str, recipe: str | None, overrides: list[str], out: str | None) -> int:
    """`rlpipe eval PATH [RECIPE] [key=value ...]`: the held-out evaluation of a run (rlpipe/run/evaluation.py) on the
    weights at `path` (an HF folder, a run or a checkpoint), by engines and reward workers alone, written to `out`
    (default: eval.json beside the weights). Without `recipe` a checkpoint is evaluated with its run's own config, an
    HF folder with the default recipe. Every input is checked before Ray starts; a checkpoint is exported to a
    temporary HF folder first, which the engines load."""
    weights = Path(path)
    if not weights.exists():
        raise CheckpointError(f"{weights}: no such file or directory")
    hf_folder = (weights / "config.json").is_file()
    if hf_folder:
        source, step = weights, 0  # an export's step is not recorded: seeded as the evaluation before training
        cfg = load_config(recipe or default_recipe(), overrides)
    else:
        try:
            source = checkpoint.resolve(weights)
        except CheckpointError as err:
            raise CheckpointError(f"{weights}: not a Hugging Face folder (no config.json), nor a run or checkpoint "
                                  f"directory ({err})") from None
        trainer = checkpoint.read_trainer_state(source, needs=checkpoint.EXPORT_FIELDS)
        step = int(trainer.get("step", 0))
        if recipe:
            cfg = load_config(recipe, overrides)
        else:  # the run's own config, as the checkpoint records it
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="rlpipe-eval-") as recorded:
                yaml.safe_dump(trainer["config"], recorded, sort_keys=False)
                recorded.flush()
                cfg = load_config(recorded.name, overrides)
    out = Path(out) if out else source / "eval.json"
    if not out.parent.is_dir():
        raise ConfigError(f"--out: folder {out.parent} does not exist")
    with tempfile.TemporaryDirectory(prefix="rlpipe-eval-") as scratch:
        if hf_folder:
            model_path = str(weights.resolve())
        else:  # the engines load HF folders: the checkpoint's weights as one (its tokenizer included)
            model_path = str(checkpoint.export(source, Path(scratch) / "model", merge=True))  # LoRA: merged
            cfg.model.tokenizer = None
        cfg.model.path = model_path
        preflight.check_model(model_path)
        tokenizer_path, tokenizer = preflight.check_tokenizer(cfg.model, model_path)
        train_rows, eval_rows = load_rows(cfg.data, cfg.run.seed)
        if not eval_rows:
            raise ConfigError("data.eval_size: no held-out prompts to evaluate (set data.eval_size above 0)")
        columns = reward_columns(train_rows, cfg.data.prompt_field)
        if cfg.rollout.environment_factory:  # as in training: reward functions also get the episodes' environments
            columns = [*columns, *EPISODE_COLUMNS]
        preflight.check_reward_functions(cfg.reward, columns)
        preflight.check_rollout_tools(cfg.rollout, tokenizer, cfg.data.chat_template_kwargs)
        eval_set = PromptSet(eval_rows, tokenizer, cfg.data, id_offset=len(train_rows),
                             max_prompt_tokens=cfg.max_prompt_tokens)
        if cfg.data.overlong == "drop":  # the prompts the run itself evaluated
            eval_set.drop_overlong()
        preflight.check_prompts(eval_set)
        point = evaluate_on_engines(cfg, model_path, tokenizer_path, columns, eval_set, step,
                                     reward_state(cfg, SimpleNamespace(train_set=train_rows), step, "eval"),
                                     LogSetup(str(out.with_suffix(".log")), verbose=cfg.run.verbose))
    record = {"path": str(weights), "weights": str(source), "step": step, "prompts": len(eval_set), **point}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"held-out accuracy of {weights} (step {step}, {len(eval_set)} prompts): {evaluation.describe(point)}; "
          f"written to {out}")
    return 0


def evaluate_on_engines(cfg: Config, model_path: str, tokenizer_path: str | None, columns: list[str], eval_set,
                         step: int, state, logs) -> dict:
    """Start Ray (or join `ray.address`), the engines on `model_path` and the reward workers; evaluate; stop them."""
    with driver_logging(logs):
        start_ray(cfg)
        roles = EvalRoles(cfg, model_path, tokenizer_path, columns, log=logs)
        try:
            return evaluation.evaluate(roles, eval_set, cfg, step, state)
        finally:
            roles.shutdown()
