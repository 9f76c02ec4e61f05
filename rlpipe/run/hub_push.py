"""An exported model on the Hugging Face Hub: its model card (the recipe and the held-out figures, under the Hub's
metadata header) and the push of the folder through huggingface_hub (`rlpipe export --push-to-hub ORG/NAME`,
`metrics.push_to_hub` at the end of a run)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from rlpipe.usercode.callables import readable
from rlpipe.config import first_line
from rlpipe.config.metrics import HUB_REPO_ID

CARD = "README.md"
CARD_TAGS = ["rlpipe", "grpo", "reinforcement-learning", "text-generation"]


class HubPushError(RuntimeError):
    """A push that cannot start or did not complete; the message is one line naming the repository."""


def hub_token() -> str | None:
    """The token huggingface_hub would send: HF_TOKEN, else the one `hf auth login` saved."""
    from huggingface_hub import get_token

    return get_token()


def check_can_push(repo_id: str, where: str) -> None:
    """Refuse, before anything starts, a push that cannot happen: a malformed id, no token, offline mode."""
    if re.fullmatch(HUB_REPO_ID, repo_id) is None:
        raise HubPushError(f"{where}: {repo_id!r} is not a Hub repository id ORG/NAME")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise HubPushError(f"{where} {repo_id}: HF_HUB_OFFLINE is set; unset it to push")
    if not hub_token():
        raise HubPushError(f"{where} {repo_id}: no Hugging Face token (set HF_TOKEN, or run `hf auth login`)")


def model_card(config: dict, summary: dict | None = None) -> str:
    """README.md of an export: the Hub's metadata header (base_model where the run started from a Hub id,
    library_name, tags), the held-out figures before and after training (greedy accuracy; mean@k and pass@k where
    the run sampled them) and at the best evaluation, and the resolved recipe as YAML."""
    base_model = _hub_id(config.get("model", {}).get("path"))
    header: dict[str, Any] = {"library_name": "transformers", "tags": CARD_TAGS}
    if base_model:
        header["base_model"] = base_model
    name = config.get("run", {}).get("name", "rlpipe-run")
    lines = [
        "---", yaml.safe_dump(header, sort_keys=True).rstrip(), "---", "",
        f"# {name}", "",
        f"Post-trained with GRPO by rlpipe from `{config.get('model', {}).get('path')}` "
        f"({config.get('train', {}).get('steps')} steps).", "",
        "## Held-out evaluation", "",
        *_held_out_table(config, summary or {}), "",
        "## Recipe", "",
        "The resolved configuration the run used (`rlpipe train` takes it as a recipe).", "",
        "```yaml", yaml.safe_dump(readable(config), sort_keys=False).rstrip(), "```", "",
    ]
    return "\n".join(lines)


def write_model_card(folder: str | os.PathLike, config: dict, summary: dict | None = None) -> Path:
    path = Path(folder) / CARD
    path.write_text(model_card(config, summary))
    return path


def push_folder(folder: str | os.PathLike, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Create `repo_id` (kept if it exists) and upload `folder` to it in one commit; returns the commit's URL.
    HF_ENDPOINT names another Hub endpoint (read here, not only when huggingface_hub was imported)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    try:
        # not private: the namespace's default visibility (an organization may make new repositories private)
        api.create_repo(repo_id, private=private or None, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), repo_type="model", commit_message="Upload model trained by rlpipe"
        )
    except (HfHubHTTPError, ValueError, OSError) as err:
        raise HubPushError(f"push to {repo_id}: {first_line(err)}") from None
    return commit.commit_url


def checkpoint_card_inputs(checkpoint: str | os.PathLike) -> tuple[dict, dict]:
    """The config and held-out figures a checkpoint's run recorded: its trainer state's config and eval_before, and
    eval_after from the run's summary.json when the checkpoint is the run's last step (the one evaluated after)."""
    from rlpipe.training import checkpoint as checkpoints

    source = checkpoints.resolve(checkpoint)
    trainer = checkpoints.read_trainer_state(source, needs=checkpoints.EXPORT_FIELDS)
    summary = dict(trainer.get("summary") or {})
    finished = source.parent.parent / "summary.json"  # <run_dir>/checkpoints/step_N
    if finished.is_file() and trainer.get("step") == trainer["config"].get("train", {}).get("steps"):
        summary["eval_after"] = json.loads(finished.read_text()).get("eval_after")
    return trainer["config"], summary


def after_run(cfg, summary: dict) -> dict:
    """The end of a run, on the driver: the model card in the export, then the push `metrics.push_to_hub` asks for
    (its commit URL recorded as summary["hub"] and in summary.json)."""
    export = (summary or {}).get("export")
    if not export or not Path(export).is_dir():
        return summary
    config = cfg.to_dict()
    write_model_card(export, config, summary)
    if cfg.metrics.push_to_hub:
        summary["hub"] = push_folder(export, cfg.metrics.push_to_hub, cfg.metrics.push_private)
        summary_file = cfg.run_dir / "summary.json"
        if summary_file.is_file():
            summary_file.write_text(json.dumps(summary, indent=2))
    return summary


def _hub_id(path: str | None) -> str | None:
    """`path` when it names a Hub model (ORG/NAME that is no local folder), else None."""
    if not path or Path(path).exists() or re.fullmatch(HUB_REPO_ID, path) is None:
        return None
    return path


def _held_out_table(config: dict, summary: dict) -> list[str]:
    """The card's table: greedy accuracy, then the sampled figures (mean@k, pass@j) of the evaluations before the
    first step and after the last, from the summary's evaluations (else its eval_before / eval_after alone), and the
    best evaluation's row where it is neither."""
    points = {p["step"]: p for p in summary.get("eval") or [] if isinstance(p, dict) and "step" in p}
    last = config.get("train", {}).get("steps")
    rows = [("before training", points.get(0, {"accuracy": summary.get("eval_before")})),
            ("after training", points.get(last, {"accuracy": summary.get("eval_after")}))]
    best = summary.get("eval_best")
    if isinstance(best, dict) and best.get("step") not in (0, last):
        rows.append((f"best (step {best['step']})", best))
    sampled = [name for _, point in rows for name in point if name.startswith(("mean@", "pass@"))]
    columns = ["accuracy", *dict.fromkeys(sampled)]
    return [
        f"| | {' | '.join(columns)} |", f"|{'---|' * (len(columns) + 1)}",
        *(f"| {label} | {' | '.join(_figure(point.get(column)) for column in columns)} |" for label, point in rows),
    ]


def _figure(value: Any) -> str:
    return "not measured" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)
