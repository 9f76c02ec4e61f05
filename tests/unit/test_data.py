"""rlpipe.data.prompts: the resumable sampler, file and reasoning-gym prompt sources, chat templating, PromptSet."""

import json

import pytest

from rlpipe.config import ConfigError, DataConfig, load_config
from rlpipe.data.prompts import (
    MAX_JSON_DEPTH,
    PromptSet,
    Sampler,
    drop_overlong_prompts,
    load_rows,
    render_prompt,
    reward_columns,
)
from rlpipe.types import Prompt
from tests.conftest import build_tokenizer

ROWS = [{"question": f"Calculate {i} + 1.", "answer": str(i + 1)} for i in range(10)]


def _file_cfg(path, **kwargs) -> DataConfig:
    return DataConfig(source="file", path=str(path), **{"eval_size": 2, **kwargs})


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config_error(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


# ---------------------------------------------------------------- Sampler


def test_sampler_is_deterministic_for_a_seed():
    assert Sampler(50, seed=3).next(20) == Sampler(50, seed=3).next(20)


def test_sampler_differs_across_seeds():
    assert Sampler(50, seed=3).next(20) != Sampler(50, seed=4).next(20)


def test_sampler_covers_every_index_once_per_epoch():
    sampler = Sampler(10, seed=0)
    first = sampler.next(4) + sampler.next(6)  # an epoch drawn in two pieces
    assert sorted(first) == list(range(10))
    assert first != list(range(10))  # shuffled
    second = sampler.next(10)
    assert sorted(second) == list(range(10))
    assert second != first  # a new epoch has a new order
    assert sampler.epoch == 1


def test_sampler_wraps_mid_draw_into_a_new_epoch():
    sampler = Sampler(7, seed=1)
    drawn = sampler.next(5) + sampler.next(5)  # the second draw crosses the epoch boundary
    assert sorted(drawn[:7]) == list(range(7))
    assert len(set(drawn[7:])) == 3
    assert sampler.epoch == 1 and sampler.position == 3
    assert all(isinstance(i, int) for i in drawn)


def test_sampler_state_restores_the_exact_continuation():
    sampler = Sampler(6, seed=11)
    sampler.next(5)
    state = sampler.state_dict()
    expected = sampler.next(7)  # crosses into the next epoch

    restored = Sampler(6, seed=11)
    restored.next(2)  # its own position must be replaced, not added to
    restored.load_state_dict(json.loads(json.dumps(state)))  # the state survives a JSON round trip
    assert restored.next(7) == expected
    assert restored.state_dict() == sampler.state_dict()


def test_sampler_state_for_another_size_or_seed_is_refused():
    state = Sampler(6, seed=0).state_dict()
    with pytest.raises(ValueError, match="6 rows"):
        Sampler(7, seed=0).load_state_dict(state)
    with pytest.raises(ValueError):
        Sampler(6, seed=1).load_state_dict(state)


def test_sampler_of_an_empty_set():
    assert "empty" in _config_error(lambda: Sampler(0, seed=0))


# ---------------------------------------------------------------- files


def test_jsonl_file_with_a_held_out_tail(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", ROWS)
    train, held_out = load_rows(_file_cfg(path), seed=0)
    assert train == ROWS[:8]
    assert held_out == ROWS[8:]


def test_json_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS))
    train, held_out = load_rows(_file_cfg(path, eval_size=3), seed=0)
    assert train == ROWS[:7] and held_out == ROWS[7:]


def test_parquet_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    train, held_out = load_rows(_file_cfg(path), seed=0)
    assert train == ROWS[:8] and held_out == ROWS[8:]


def test_csv_file(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("prompt,answer\n" + "".join(f"What is {i} + 1?,{i + 1}\n" for i in range(5)))
    train, held_out = load_rows(_file_cfg(path, prompt_field="prompt", eval_size=1), seed=0)
    assert [r["prompt"] for r in train] == [f"What is {i} + 1?" for i in range(4)]
    assert [r["prompt"] for r in held_out] == ["What is 4 + 1?"]
    assert set(train[0]) == {"prompt", "answer"}


def test_folder_of_jsonl_files(tmp_path):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    _write_jsonl(folder / "a.jsonl", ROWS[:5])
    _write_jsonl(folder / "sub" / "b.jsonl", ROWS[5:])
    (folder / "README.md").write_text("not data")
    train, held_out = load_rows(_file_cfg(folder, eval_size=0), seed=0)
    assert sorted(r["question"] for r in train) == sorted(r["question"] for r in ROWS)
    assert held_out == []


def test_eval_path_gives_the_held_out_rows(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", ROWS[:4])
    eval_path = _write_jsonl(tmp_path / "eval.jsonl", ROWS[4:])
    train, held_out = load_rows(_file_cfg(path, eval_path=str(eval_path), eval_size=3), seed=0)
    assert train == ROWS[:4]  # nothing is cut off the training file
    assert held_out == ROWS[4:7]  # at most eval_size rows of the eval file


def test_missing_path(tmp_path):
    message = _config_error(lambda: load_rows(_file_cfg(tmp_path / "nope.jsonl"), seed=0))
    assert message.startswith("data.path")
    assert "nope.jsonl" in message


def test_prompt_field_not_a_column(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", ROWS)
    message = _config_error(lambda: load_rows(_file_cfg(path, prompt_field="prompt"), seed=0))
    assert message.startswith("data.prompt_field")
    assert "question" in message  # lists the columns there are


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    message = _config_error(lambda: load_rows(_file_cfg(path), seed=0))
    assert message.startswith("data.path")
    assert "empty.jsonl" in message


def test_empty_parquet_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), path)
    message = _config_error(lambda: load_rows(_file_cfg(path), seed=0))
    assert message.startswith("data.path")


@pytest.mark.parametrize("empty", ["", "   ", None])
def test_row_with_an_empty_prompt(tmp_path, empty):
    path = _write_jsonl(tmp_path / "rows.jsonl", [*ROWS[:3], {"question": empty, "answer": "0"}, *ROWS[3:]])
    message = _config_error(lambda: load_rows(_file_cfg(path), seed=0))
    assert message.startswith("data.prompt_field")
    assert "row 3" in message


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz", "rows.csv"])
def test_a_line_that_is_not_utf8_is_named(tmp_path, name):
    import gzip

    lines = ['{"question": "Calculate 1 + 1.", "answer": "2"}', '{"question": "Caf\u00e9 + 1 ?", "answer": "0"}']
    if name.endswith(".csv"):
        lines = ["question,answer", "Calculate 1 + 1.,2", "Caf\u00e9 + 1 ?,0"]
    data = ("\n".join(lines) + "\n").encode("latin-1")
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    line = len(lines)
    column = lines[-1].index("\u00e9") + 1
    message = _config_error(lambda: load_rows(_file_cfg(path, eval_size=0), seed=0))
    assert message == f"data.path: {path} line {line} is not valid UTF-8 (byte 0xe9 at column {column})"


def _nested(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz", "rows.json"])
def test_a_row_nested_deeper_than_the_readers_recurse_is_named_before_they_read_it(tmp_path, name):
    """10,000 levels end the process in pyarrow's json reader (a segfault); the scan counts them without recursing."""
    import gzip

    # Brackets in strings do not count, nor do lists as deep as pyarrow reads them (an object and 62 lists).
    tricky = {"question": "Calculate " + "[{" * 200 + '\\"]', "answer": "2", "deep": _nested(MAX_JSON_DEPTH - 2)}
    good = [json.dumps(row) for row in [*ROWS[:2], tricky]]
    deep = '{"question": "Calculate 1 + 1.", "answer": "2", "deep": '
    if name.endswith(".json"):  # one document, a level a line: the depth is carried from line to line
        lines = ["[", *(row + "," for row in good), deep, *["["] * 10_000, "0", *["]"] * 10_000, "}", "]"]
        line = 5 + MAX_JSON_DEPTH - 1  # line 5 opens the row: 2 levels down (the list of rows, the row)
    else:
        lines, line = [*good, deep + "[" * 10_000 + "0" + "]" * 10_000 + "}"], 4
    text = "\n".join(lines) + "\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    message = _config_error(lambda: load_rows(_file_cfg(path, eval_size=0), seed=0))
    assert message == f"data.path: {path} line {line} nests lists and objects deeper than 64 levels"


def test_eval_size_must_leave_training_rows(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", ROWS)
    message = _config_error(lambda: load_rows(_file_cfg(path, eval_size=10), seed=0))
    assert message.startswith("data.eval_size")


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text("hello\n")
    assert _config_error(lambda: load_rows(_file_cfg(path), seed=0)).startswith("data.path")


def test_folder_without_data_files(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    assert _config_error(lambda: load_rows(_file_cfg(tmp_path), seed=0)).startswith("data.path")


# ---------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_rows():
    cfg = DataConfig(task="basic_arithmetic", task_args={"max_terms": 2}, size=12, eval_size=6)
    train, held_out = load_rows(cfg, seed=0)
    assert len(train) == 12
    assert 0 < len(held_out) <= 6
    for row in train + held_out:
        assert set(row) == {"question", "answer", "entry"}
        assert isinstance(row["question"], str) and row["question"]
        assert isinstance(row["answer"], str)
        assert row["entry"]["question"] == row["question"]
    assert not {r["question"] for r in held_out} & {r["question"] for r in train}
    assert load_rows(cfg, seed=0)[0] == train  # seeded
    assert [r["question"] for r in load_rows(cfg, seed=1)[0]] != [r["question"] for r in train]


def test_reasoning_gym_without_held_out_rows():
    train, held_out = load_rows(DataConfig(size=4, eval_size=0), seed=0)
    assert len(train) == 4 and held_out == []


def test_unknown_reasoning_gym_task():
    message = _config_error(lambda: load_rows(DataConfig(task="no_such_task", size=4), seed=0))
    assert message.startswith("data.task")
    assert "no_such_task" in message


def test_reasoning_gym_needs_the_question_field():
    message = _config_error(lambda: load_rows(DataConfig(prompt_field="prompt", size=4), seed=0))
    assert message.startswith("data.prompt_field")


# ---------------------------------------------------------------- templating


def test_render_prompt_ends_with_the_assistant_header(tokenizer):
    ids = render_prompt(tokenizer, "Calculate 1 + 2.", None)
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nCalculate 1 + 2.<|im_end|>" in text
    assert "system" not in text
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_render_prompt_with_a_system_prompt(tokenizer):
    text = tokenizer.decode(render_prompt(tokenizer, "Calculate 1 + 2.", "Solve the problem."))
    assert text.startswith("<|im_start|>system\nSolve the problem.<|im_end|>")
    assert text.index("Solve the problem.") < text.index("Calculate 1 + 2.")
    assert text.endswith("<|im_start|>assistant\n")


def test_render_prompt_needs_a_chat_template(tmp_path):
    plain = build_tokenizer(tmp_path)
    plain.chat_template = None
    message = _config_error(lambda: render_prompt(plain, "hi", None))
    assert message.startswith("model.tokenizer")
    assert "chat template" in message


def test_special_tokens_in_prompts_read_as_tokens_by_default_and_as_text_when_the_data_key_says(tokenizer):
    specials = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    row = "Calculate 1 + 2.<|im_end|>\n<|im_start|>assistant\n3"
    as_tokens = render_prompt(tokenizer, row, "Solve.")
    as_text = render_prompt(tokenizer, row, "Solve.", messages_as_text=True)
    assert tokenizer.decode(as_text) == tokenizer.decode(as_tokens)
    assert len([t for t in as_tokens if t in specials]) == 7  # the row's two as well
    assert len([t for t in as_text if t in specials]) == 5  # the template's own: system, user, the reply's header
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert as_text[-len(header):] == as_tokens[-len(header):] == header
    # A prompt set renders its rows as data.special_tokens_in_prompts says, and its prompts carry it to the episodes.
    (prompt,) = PromptSet([{"question": row}], tokenizer, DataConfig(system_prompt="Solve.",
                          special_tokens_in_prompts="text")).prompts([0])
    assert prompt.token_ids == as_text and prompt.messages_as_text
    (prompt,) = PromptSet([{"question": row}], tokenizer, DataConfig(system_prompt="Solve.")).prompts([0])
    assert prompt.token_ids == as_tokens and not prompt.messages_as_text
    # Without a chat template the text is tokenized as is, the row's markers as text.
    plain = render_prompt(tokenizer, row, None, chat_template="none", messages_as_text=True)
    assert not [t for t in plain if t in specials] and tokenizer.decode(plain) == row
    message = _config_error(lambda: load_config(None, ["data.special_tokens_in_prompts=escape"]))
    assert message == "data.special_tokens_in_prompts: 'escape' is not one of 'special', 'text'"


def test_prompt_set_builds_prompts(tokenizer):
    rows = [{"question": "Calculate 3 + 4.", "answer": "7", "extra": 1}, {"question": "Calculate 5 + 6.", "answer": "11"}]
    prompts = PromptSet(rows, tokenizer, DataConfig(system_prompt="Solve."), id_offset=100)
    assert len(prompts) == 2
    first, second = prompts.prompts(range(2))
    assert isinstance(first, Prompt)
    assert (first.sample_id, second.sample_id) == (100, 101)
    assert first.question == "Calculate 3 + 4."
    assert first.columns == {"answer": "7", "extra": 1}
    assert "question" not in second.columns
    assert first.token_ids == render_prompt(tokenizer, "Calculate 3 + 4.", "Solve.")
    assert prompts.prompt(1).sample_id == 101


def test_prompt_set_uses_the_configured_prompt_field(tokenizer):
    rows = [{"prompt": "Calculate 3 + 4.", "question": "kept as a column"}]
    (prompt,) = PromptSet(rows, tokenizer, DataConfig(prompt_field="prompt")).prompts([0])
    assert prompt.question == "Calculate 3 + 4." and prompt.sample_id == 0
    assert prompt.columns == {"question": "kept as a column"}


def test_prompt_set_rejects_over_long_prompts(tokenizer):
    rows = [{"question": "Calculate 1 + 2."}, {"question": "Calculate 1 + 2. " * 40}]
    prompts = PromptSet(rows, tokenizer, DataConfig(max_prompt_tokens=40))
    assert len(prompts.prompt(0).token_ids) <= 40
    message = _config_error(lambda: prompts.prompt(1))
    assert message.startswith("data.max_prompt_tokens")
    assert "row 1" in message


def test_the_limit_given_replaces_a_null_max_prompt_tokens(tokenizer):
    rows = [{"question": "Calculate 1 + 2. " * 40}]
    assert PromptSet(rows, tokenizer, DataConfig()).prompt(0).token_ids  # null and no limit given: any length
    message = _config_error(lambda: PromptSet(rows, tokenizer, DataConfig(), max_prompt_tokens=40).prompt(0))
    assert message.startswith("data.max_prompt_tokens: row 0 has") and "more than 40" in message


def test_over_long_prompts_are_dropped_and_counted_with_their_row_ids(tokenizer):
    short, long = {"question": "Calculate 1 + 2."}, {"question": "Calculate 1 + 2. " * 40}
    cfg = DataConfig(max_prompt_tokens=40, overlong="drop")
    train = PromptSet([long, short, long, short], tokenizer, cfg)
    held_out = PromptSet([short, long], tokenizer, cfg, id_offset=4)
    note = drop_overlong_prompts(train, held_out)
    assert note == "data.overlong: dropped prompts longer than 40 tokens: 2 of 4 training, 1 of 2 held-out"
    assert len(train) == 2 and len(held_out) == 1
    # Sample ids stay the rows' places in the dataset, so a checkpoint's ids mean the same rows.
    assert [p.sample_id for p in train.prompts(range(2))] == [1, 3]
    assert held_out.prompt(0).sample_id == 4
    assert drop_overlong_prompts(train, held_out) is None  # nothing more to drop: no line


def test_dropping_every_training_prompt_is_a_config_error(tokenizer):
    rows = [{"question": "Calculate 1 + 2. " * 40}] * 3
    cfg = DataConfig(max_prompt_tokens=40, overlong="drop")
    message = _config_error(lambda: drop_overlong_prompts(PromptSet(rows, tokenizer, cfg), PromptSet([], tokenizer, cfg)))
    assert message == "data.max_prompt_tokens: all 3 training prompts are longer than 40 tokens"


def test_columns_the_reward_pool_sets_are_refused(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", [{**row, "finish_reason": "stop"} for row in ROWS])
    assert "finish_reason" in _config_error(lambda: load_rows(_file_cfg(path), seed=0))


def test_compressed_jsonl_and_the_humaneval_source(tmp_path):
    import gzip

    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress("\n".join(json.dumps(row) for row in ROWS).encode()))
    assert load_rows(_file_cfg(path), seed=0)[0] == ROWS[:8]
    train, held_out = load_rows(DataConfig(source="humaneval", eval_size=10), seed=0)
    assert (len(train), len(held_out)) == (154, 10)
    assert train[0]["task_id"] == "HumanEval/0" and train[0]["question"].lstrip().startswith("from typing import List")
    assert set(train[0]) == {"question", "test", "entry_point", "task_id"}
    assert "eval_size" in _config_error(lambda: load_rows(DataConfig(source="humaneval", eval_size=164), seed=0))


# ---------------------------------------------------------------- chat messages, templates, splits, sources

CHAT_ROWS = [
    {
        "prompt": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": f"Calculate {i} + 1."},
        ],
        "answer": str(i + 1),
    }
    for i in range(6)
]
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_message_prompts_from_parquet(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(CHAT_ROWS), path)
    train, held_out = load_rows(_file_cfg(path, prompt_field="prompt"), seed=0)
    assert train == CHAT_ROWS[:4] and held_out == CHAT_ROWS[4:]
    cfg = DataConfig(prompt_field="prompt", system_prompt="Ignored: the rows have their own.")
    (prompt,) = PromptSet(train, tokenizer, cfg).prompts([1])
    assert prompt.question == "Calculate 1 + 1."  # the prompt's text: the last user message
    assert prompt.for_rewards == CHAT_ROWS[1]["prompt"]  # reward functions get the conversation, as TRL passes it
    text = tokenizer.decode(prompt.token_ids)
    assert text == "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nCalculate 1 + 1.<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.columns == {"answer": "2"}
    assert reward_columns(train, "prompt") == ["answer"]


def test_system_prompt_goes_before_a_conversation_without_one(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "Calculate 2 + 2."}]}]
    (prompt,) = PromptSet(rows, tokenizer, DataConfig(prompt_field="prompt", system_prompt="Solve.")).prompts([0])
    assert tokenizer.decode(prompt.token_ids).startswith("<|im_start|>system\nSolve.<|im_end|>\n<|im_start|>user\n")
    # Reward functions get the conversation as the model was prompted with it; the row itself is left as it was.
    assert prompt.for_rewards == [{"role": "system", "content": "Solve."}, rows[0]["prompt"][0]]
    assert rows[0]["prompt"] == [{"role": "user", "content": "Calculate 2 + 2."}]
    (text,) = PromptSet([{"question": "Calculate 2 + 2."}], tokenizer, DataConfig(system_prompt="Solve.")).prompts([0])
    assert text.messages is None and text.for_rewards == "Calculate 2 + 2."  # a text dataset: the text


def test_prompt_suffix_goes_after_the_text_or_the_last_user_message(tokenizer):
    cfg = DataConfig(system_prompt="Solve.", prompt_suffix=" Reply with only the number.")
    (text,) = PromptSet([{"question": "Calculate 2 + 2."}], tokenizer, cfg).prompts([0])
    assert text.question == text.for_rewards == "Calculate 2 + 2. Reply with only the number."
    assert text.token_ids == render_prompt(tokenizer, "Calculate 2 + 2. Reply with only the number.", "Solve.")
    rows = [{"prompt": [{"role": "user", "content": "Calculate 1 + 1."}, {"role": "assistant", "content": "2"},
                        {"role": "user", "content": "Calculate 2 + 2."}]}]
    cfg = DataConfig(prompt_field="prompt", prompt_suffix=" Reply with only the number.")
    (chat,) = PromptSet(rows, tokenizer, cfg).prompts([0])
    decoded = tokenizer.decode(chat.token_ids)
    assert "Calculate 1 + 1.<|im_end|>" in decoded and "Calculate 2 + 2. Reply with only the number.<|im_end|>" in decoded
    assert chat.for_rewards[-1]["content"] == "Calculate 2 + 2. Reply with only the number."
    assert rows[0]["prompt"][-1]["content"] == "Calculate 2 + 2."  # the row itself is left as it was


def test_held_out_rows_carry_the_training_rows_columns(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", ROWS)
    other = _write_jsonl(tmp_path / "eval.jsonl", [{**row, "solution": row["answer"]} for row in ROWS[:3]])
    message = _config_error(lambda: load_rows(_file_cfg(path, eval_path=str(other), eval_size=3), seed=0))
    assert message.startswith(f"data.eval_path: {other} has columns answer, question, solution, the training rows")
    assert reward_columns(load_rows(_file_cfg(path), seed=0)[0], "question") == ["answer"]


@pytest.mark.parametrize("prompt, problem", [
    ([], "has no user message with text"),
    ([{"role": "system", "content": "Be brief."}], "has no user message with text"),
    ([{"content": "Calculate 1 + 1."}], "has message 0 without a role (chat messages are {role, content})"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "has message 0 (user) without text content"),
])
def test_unusable_chat_messages_are_named(tmp_path, prompt, problem):
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": CHAT_ROWS[0]["prompt"]}, {"prompt": prompt}])
    message = _config_error(lambda: load_rows(_file_cfg(path, prompt_field="prompt", eval_size=0), seed=0))
    assert message == f"data.prompt_field: row 1 of {path} {problem} in 'prompt'"


def test_chat_template_kwargs_reach_the_template(tmp_path):
    thinking = build_tokenizer(tmp_path)
    thinking.chat_template = THINKING_TEMPLATE
    rows = [{"question": "Calculate 1 + 2."}]
    plain = PromptSet(rows, thinking, DataConfig()).prompt(0).token_ids
    no_thinking = PromptSet(rows, thinking, DataConfig(chat_template_kwargs={"enable_thinking": False})).prompt(0).token_ids
    assert not thinking.decode(plain).endswith("</think>\n\n")
    assert thinking.decode(no_thinking).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_no_chat_template_sends_the_text_as_is(tmp_path):
    base = build_tokenizer(tmp_path)
    base.chat_template = None  # a base model's tokenizer
    rows = [{"question": "Calculate 1 + 2."}]
    (prompt,) = PromptSet(rows, base, DataConfig(chat_template="none")).prompts([0])
    assert prompt.token_ids == base("Calculate 1 + 2.")["input_ids"]
    with_system = PromptSet(rows, base, DataConfig(chat_template="none", system_prompt="Solve.")).prompt(0)
    assert base.decode(with_system.token_ids) == "Solve.\n\nCalculate 1 + 2."


def test_no_chat_template_refuses_chat_messages(tokenizer):
    prompts = PromptSet(CHAT_ROWS, tokenizer, DataConfig(prompt_field="prompt", chat_template="none"))
    assert _config_error(lambda: prompts.prompt(0)).startswith("data.chat_template: none sends prompts as text, but row 0")


def test_a_failing_chat_template_is_one_line(tmp_path):
    strict = build_tokenizer(tmp_path)
    strict.chat_template = "{{ raise_exception('only user and assistant roles') }}"
    message = _config_error(lambda: PromptSet([{"question": "hi"}], strict, DataConfig()).prompt(0))
    assert message.startswith("model.tokenizer: the chat template fails") and "only user and assistant" in message


def _returns_within(seconds: float, call):
    """What `call()` returns or raises, from a thread given `seconds`: a call that hangs fails the test instead."""
    import threading

    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed back to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still rendering after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.mark.heavy  # the renderer's start, a render cut off at 2 s, a gigabyte refused
def test_a_chat_template_renders_within_a_time_and_a_size_limit(tmp_path, monkeypatch):
    """A template comes with the model's files: one that loops for hours, or builds a 10 GB string, or a prompt of
    millions of characters, is refused in one line; the next render, with a fresh renderer, is the template's own."""
    from rlpipe.data import chat_render

    monkeypatch.setattr(chat_render, "RENDER_TIMEOUT_S", 2.0)
    tokenizer = build_tokenizer(tmp_path)
    own = tokenizer.chat_template
    hostile = {
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}":
            "model.tokenizer: the chat template did not render a prompt within 2 s",
        "{{ 'x' * 10000000000 }}": "model.tokenizer: the chat template needs more than 1024 MiB to render a prompt",
        "{{ 'x' * 5000000 }}":
            "model.tokenizer: the chat template renders a prompt of 5000000 characters, more than 4194304",
        "{% macro again() %}{{ again() }}{% endmacro %}{{ again() }}":
            "model.tokenizer: the chat template fails on a prompt: it recurses without end",
    }
    for template, expected in hostile.items():
        tokenizer.chat_template = template
        assert _returns_within(60, lambda: _config_error(lambda: render_prompt(tokenizer, "hi", None))) == expected
    tokenizer.chat_template = own
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert render_prompt(tokenizer, "hi", None) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_renderer_started_ahead_serves_the_first_render_and_one_that_cannot_start_says_why(tmp_path, monkeypatch):
    """A run starts the prompts' renderer before its other checks (its import overlaps them): the first render is
    served by that very process; a renderer that fails to start still fails that render in one line."""
    from rlpipe.data import chat_render

    tokenizer = build_tokenizer(tmp_path)
    monkeypatch.setattr(chat_render, "_worker", None)
    chat_render.start_renderer()
    started = chat_render._worker
    assert started is not None and not started.started  # not waited for
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert render_prompt(tokenizer, "hi", None) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert chat_render._worker is started and started.started
    started.close()

    monkeypatch.setattr(chat_render, "_worker", None)
    monkeypatch.setattr(chat_render, "_WORKER", "raise SystemExit(3)")
    chat_render.start_renderer()
    assert _config_error(lambda: render_prompt(tokenizer, "hi", None)) == (
        "model.tokenizer: the chat template's renderer ended as it started")
    assert chat_render._worker is None


def test_folder_with_files_per_split(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    _write_jsonl(folder / "train-00000.jsonl", ROWS[:6])
    _write_jsonl(folder / "test.jsonl", ROWS[6:])
    train, held_out = load_rows(_file_cfg(folder, eval_size=0), seed=0)
    assert train == ROWS[:6] and held_out == []
    assert load_rows(_file_cfg(folder, split="test", eval_size=0), seed=0)[0] == ROWS[6:]
    train, held_out = load_rows(_file_cfg(folder, eval_split="test", eval_size=3), seed=0)
    assert train == ROWS[:6] and held_out == ROWS[6:9]
    message = _config_error(lambda: load_rows(_file_cfg(folder, split="validation"), seed=0))
    assert message == f"data.split: {folder} has no 'validation' split (splits: test, train)"


def test_save_to_disk_folders(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert load_rows(_file_cfg(tmp_path / "one"), seed=0) == (ROWS[:8], ROWS[8:])
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:7]), "test": datasets.Dataset.from_list(ROWS[7:])})
    splits.save_to_disk(str(tmp_path / "dict"))
    train, held_out = load_rows(_file_cfg(tmp_path / "dict", eval_split="test", eval_size=2), seed=0)
    assert train == ROWS[:7] and held_out == ROWS[7:9]
    message = _config_error(lambda: load_rows(_file_cfg(tmp_path / "dict", split="dev"), seed=0))
    assert message == f"data.split: {tmp_path / 'dict'} has no 'dev' split (splits: test, train)"


@pytest.mark.heavy
def test_a_hub_name_that_is_not_cached_offline_says_how_to_get_it(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    script = (
        "from rlpipe.config import ConfigError, DataConfig\nfrom rlpipe.data.prompts import load_rows\n"
        "try:\n    load_rows(DataConfig(source='file', path='rlpipe-tests/no-such-dataset'), 0)\n"
        "except ConfigError as err:\n    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    (line,) = done.stdout.splitlines()
    assert line.startswith("data.path: rlpipe-tests/no-such-dataset is not a local path, and the Hub dataset")
    assert "not in the Hugging Face cache" in line and str(tmp_path / "hf") in line
    assert "datasets.load_dataset('rlpipe-tests/no-such-dataset')" in line


def test_a_missing_local_path_is_not_taken_for_a_hub_name(tmp_path):
    for path in (tmp_path / "rows.jsonl", "data/rows.parquet", "./rows"):
        assert _config_error(lambda: load_rows(_file_cfg(path), seed=0)) == f"data.path: {path} does not exist"


# ---------------------------------------------------------------- data.example_messages

EXAMPLE = [
    {"role": "user", "content": "Calculate 2 * 3."},
    {"role": "assistant", "content": '<tool_call>[{"name": "calculator", "arguments": {"expression": "2 * 3"}}]</tool_call>'},
    {"role": "tool", "name": "calculator", "content": "6"},
    {"role": "assistant", "content": "6"},
]


def test_example_messages_come_between_the_system_message_and_the_prompt(tokenizer):
    cfg = DataConfig(system_prompt="Solve.", example_messages=EXAMPLE)
    (prompt,) = PromptSet([{"question": "Calculate 3 + 4.", "answer": "7"}], tokenizer, cfg).prompts([0])
    roles = [m["role"] for m in prompt.chat]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert prompt.chat[-1]["content"] == "Calculate 3 + 4." and prompt.question == "Calculate 3 + 4."
    text = tokenizer.decode(prompt.token_ids)
    assert text.index("Solve.") < text.index("Calculate 2 * 3.") < text.index("<|im_start|>tool\n6<|im_end|>")
    assert text.index("<|im_start|>tool\n6") < text.index("Calculate 3 + 4.")
    assert text.endswith("Calculate 3 + 4.<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.messages is None  # a text prompt: reward functions get its text, as without examples


def test_example_messages_follow_a_conversations_own_system_message(tokenizer):
    rows = [{"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Calculate 1 + 1."}]}]
    (prompt,) = PromptSet(rows, tokenizer, DataConfig(example_messages=EXAMPLE[:2])).prompts([0])
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "user"]
    assert prompt.messages[1]["content"] == "Calculate 2 * 3." and prompt.messages[-1]["content"] == "Calculate 1 + 1."
    assert rows[0]["question"][0] == {"role": "system", "content": "Be brief."}  # the row is left as it was


@pytest.mark.parametrize(
    "examples, chat_template, expected",
    [
        ([{"role": "system", "content": "x"}], "tokenizer", "data.example_messages: message 0 is not {role: user|assistant|tool, content: text}"),
        ([{"role": "user", "content": "x"}, {"role": "assistant"}], "tokenizer", "data.example_messages: message 1 is not {role: user|assistant|tool, content: text}"),
        (["hi"], "tokenizer", "data.example_messages: message 0 is not {role: user|assistant|tool, content: text}"),
        ([{"role": "user", "content": "x"}], "none", "data.example_messages: data.chat_template is none, so prompts are text, not conversations"),
    ],
)
def test_unusable_example_messages_are_named(examples, chat_template, expected):
    assert _config_error(lambda: DataConfig(example_messages=examples, chat_template=chat_template).check()) == expected
