"""The reward-function contract: TRL's GRPOTrainer convention, called by keyword.

    fn(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=..., **kwargs) -> list of scores

- `prompts`: the dataset's prompts, plain text, or, where the dataset holds chat messages, the conversation the model
  was prompted with (a list of {role, content} dicts, data.system_prompt included where it was added);
- `completions`: the generated text, or, for a conversation, `[{"role": "assistant", "content": text}]`; for a
  multi-turn episode with tools, the whole conversation after the prompt (assistant messages, their `tool_calls`,
  the tool messages), as TRL passes it;
- `completion_ids`: the completions' token ids;
- every other column of the dataset (`answer`, `solution`, ...), plus the columns the reward pool adds per sample
  (SAMPLE_COLUMNS);
- `environments`: with rollout.environment_factory, each sample's environment instance after its episode (TRL's
  `environments`);
- `trainer_state`: a TrainerState;
- `log_extra` and `log_metric`: TRL's logging callables (LOG_CALLBACKS), to functions that take them;
- the function's `kwargs` from config, which win over a dataset column of the same name.

All lists hold one entry per sample. A function may be `async def`. It returns one score per sample: a number,
None (could not score), or a dict with a `score` key (other keys are kept as extras).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

CALL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")
"""Keywords every call passes besides the columns; neither a dataset column nor a config kwarg may use them."""
SAMPLE_COLUMNS = ("completion_tokens", "finish_reason", "max_tokens")
"""Columns the reward pool adds to the dataset's for every sample: the completion's length in tokens, why it
ended ("stop" or "length") and the length limit it was sampled under. Datasets may not use these names."""
EPISODE_COLUMNS = ("environments",)
"""Columns the reward pool adds only for multi-turn episodes with an environment factory."""
LOG_CALLBACKS = ("log_extra", "log_metric")
"""TRL's callables, given to each function that takes them (by name, or in **kwargs): `log_extra(column, values)`,
one value per sample of the call, kept with the samples as `"{function}/{column}"`; `log_metric(name, value)`, a
number, averaged over the step's calls into the step's metric `reward/logged/{name}`."""
RESERVED_COLUMNS = CALL_ARGUMENTS + SAMPLE_COLUMNS + EPISODE_COLUMNS + LOG_CALLBACKS


class TrainerState(dict):
    """Where the run stands when a batch is scored; a dict whose keys also read as attributes, so a function
    written for TRL (`trainer_state.global_step`) runs unchanged.

    - `global_step`: training steps completed before the scored samples' step (0 in the first step);
    - `max_steps`: train.steps;
    - `epoch`: passes over the training set drawn before that step (fractional);
    - `run_name`: run.name;
    - `mode`: "train", or "eval" for the held-out evaluation before and after training.
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"trainer_state has no {name!r} (it has {', '.join(self)})") from None


def trainer_state(
    global_step: int = 0, max_steps: int = 0, epoch: float = 0.0, run_name: str = "", mode: str = "train"
) -> TrainerState:
    return TrainerState(global_step=global_step, max_steps=max_steps, epoch=epoch, run_name=run_name, mode=mode)


def is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list)


def as_completions(prompts: list, texts: list[str | list[dict]]) -> list:
    """Completions as a function sees them: the text, or an assistant message where the prompt is a conversation;
    an episode's conversation (a list of messages) as it is."""
    return [
        copy.deepcopy(text) if isinstance(text, list)
        else [{"role": "assistant", "content": text}] if is_conversation(prompt) else text
        for prompt, text in zip(prompts, texts, strict=True)
    ]


def completion_text(completion: str | list[Mapping]) -> str:
    """The text of a completion given either way (for rewards that read the text whatever the dataset's format)."""
    if isinstance(completion, str):
        return completion
    # An episode's assistant turns one per line, so that the last line or number is the last turn's.
    return "\n".join(
        str(message.get("content") or "") for message in completion if message.get("role") == "assistant"
    )


def prompt_text(prompt: str | list[Mapping]) -> str:
    """The text of a prompt given either way: the text itself, or the conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((str(m.get("content") or "") for m in reversed(prompt) if m.get("role") == "user"), "")


def call_arguments(
    prompts: list,
    texts: list[str],
    completion_ids: list | None,
    columns: Mapping[str, list],
    state: Mapping[str, Any],
    kwargs: Mapping[str, Any],
) -> dict[str, Any]:
    """The keyword arguments of one call, each function getting its own copies (functions run concurrently and may
    change their inputs). Config `kwargs` win over a dataset column of the same name."""
    return {
        "prompts": copy.deepcopy(prompts),
        "completions": as_completions(prompts, texts),
        "completion_ids": None if completion_ids is None else [list(ids) for ids in completion_ids],
        **{key: list(values) for key, values in columns.items() if key not in kwargs},
        "trainer_state": TrainerState(state),
        **kwargs,
    }
