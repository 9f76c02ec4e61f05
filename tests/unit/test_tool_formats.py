"""Tool calls in each family's own format (rlpipe/tools/formats.py): the format told from the families' chat templates
(TRL's copies of Qwen's, Llama 3.1's, 3.2's and GLM-4's), each format's calls read through vLLM's tool parsers into
the message TRL gives, hostile turns read as plain text, and one episode per format through the loop: the call runs
and its result is appended as the template renders it, after the engine's ids as sampled."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from rlpipe.bench.tiny_model import CHATML, build_tokenizer
from rlpipe.config import ConfigError, RolloutConfig
from rlpipe.startup.preflight import check_rollout_tools
from rlpipe.tools import Episode, EpisodeLimits, Turn, run_episodes, tool_schemas, tool_suffix_ids
from rlpipe.tools.formats import TOOL_PARSERS, tool_parser_for, turn_reader

TRL_TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"
FAMILY_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                   "<|python_tag|>", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]", "[INST]", "[/INST]"]
# Templates in the manner of Mistral's (tools in [AVAILABLE_TOOLS], calls after [TOOL_CALLS]) and of Llama 3.2's
# pythonic alternative (calls as a Python list), each rendering tools and tool calls the way its family does.
MISTRAL_LIKE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{% elif message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | map(attribute='function') | list | tojson }}"
    "<|im_end|>{% else %}{{ message.content }}<|im_end|>{% endif %}{% endfor %}"
)
PYTHONIC_LIKE = (
    "{% if tools %}<|im_start|>system\nCall tools as [func_name1(params_name1=params_value1, "
    "params_name2=params_value2...), func_name2(params)]: {{ tools | map(attribute='function.name') | join(', ') }}"
    "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}[{% for call in message.tool_calls %}{{ call.function.name }}("
    "{% for name, value in call.function.arguments | items %}{{ name }}={{ value | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}){% endfor %}]{% else %}{{ message.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_SPECIALS})
    return tokenizer


def _with_template(tokenizer, template: str, eos: str = "<|im_end|>"):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    tokenizer.eos_token = eos
    return tokenizer


def _trl(name: str) -> str:
    return (TRL_TEMPLATES / f"{name}.jinja").read_text()


@pytest.mark.parametrize("template, expected", [
    ("qwen2_5", "hermes"), ("qwen3", "hermes"), ("llama3_1", "llama3_json"), ("llama3_2", "llama3_json"),
    ("chatml", "hermes"), ("mistral-like", "mistral"), ("pythonic-like", "pythonic"),
])
def test_auto_tells_the_format_the_families_chat_templates_teach(base_tokenizer, template, expected):
    # ChatML renders no tools: rlpipe writes the Hermes block into its system message, so Hermes is what it teaches.
    source = {"chatml": CHATML, "mistral-like": MISTRAL_LIKE, "pythonic-like": PYTHONIC_LIKE}.get(template)
    tokenizer = _with_template(base_tokenizer, source or _trl(template))
    assert tool_parser_for(tokenizer, "auto") == expected
    for named in TOOL_PARSERS:  # a named format is taken as named
        assert tool_parser_for(tokenizer, named) == named


def test_a_template_in_a_format_rlpipe_does_not_read_is_refused_in_one_line(base_tokenizer):
    # GLM-4 writes <tool_call>name<arg_key>..., which is not Hermes's JSON.
    tokenizer = _with_template(base_tokenizer, _trl("glm4moe"))
    rollout = RolloutConfig(tools=["rlpipe.tools:calculator"])
    with pytest.raises(ConfigError) as refused:
        check_rollout_tools(rollout, tokenizer, {})
    message = str(refused.value)
    assert "\n" not in message and message.startswith("rollout.tool_parser: auto cannot tell")
    assert "rollout.tool_parser=hermes|llama3_json|mistral|pythonic" in message
    check_rollout_tools(RolloutConfig(tools=["rlpipe.tools:calculator"], tool_parser="hermes"), tokenizer, {})
    check_rollout_tools(RolloutConfig(), tokenizer, {})  # no tools: no format needed
    with pytest.raises(ValueError, match="'xml' is not one of auto, hermes"):
        tool_parser_for(tokenizer, "xml")


def _ids(tokenizer, text: str, end: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(end)]


CALLS = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]',
    "pythonic": "[add(a=2, b=3)]",
}


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_each_format_reads_as_trl_gives_a_call_and_hostile_turns_read_as_text(base_tokenizer, parser):
    read = turn_reader(base_tokenizer, parser)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    text = CALLS[parser]
    message = read(base_tokenizer.decode(_ids(base_tokenizer, text, "<|im_end|>"), skip_special_tokens=True),
                   _ids(base_tokenizer, text, "<|im_end|>"))
    assert message == {"role": "assistant", "content": "", "tool_calls": [call]}, parser
    if parser == "hermes":  # text before the call stays the message's content (vLLM's Llama parser drops it)
        prefixed = "Let me add. " + text
        assert read(prefixed, _ids(base_tokenizer, prefixed, "<|im_end|>"))["content"] == "Let me add."
    hostile = {
        "not a call": "The answer is 5.",
        "deep nesting": text.replace("2", "[" * 5000 + "2" + "]" * 5000),
        "an integer past Python's digit limit": text.replace("2", "1" * 5000),
        "nesting past MAX_CALL_DEPTH": text.replace("2", "[" * 70 + "2" + "]" * 70),
        "no name": text.replace('"name": "add", ', "").replace("add(", "("),
        "cut short": text[: len(text) // 2],
    }
    for what, turn in hostile.items():
        assert read(turn, _ids(base_tokenizer, turn, "<|im_end|>")) == {"role": "assistant", "content": turn}, \
            (parser, what)


@pytest.mark.parametrize("parser, template, eos", [
    ("hermes", "qwen2_5", "<|im_end|>"), ("llama3_json", "llama3_1", "<|eot_id|>"),
    ("mistral", MISTRAL_LIKE, "<|im_end|>"), ("pythonic", PYTHONIC_LIKE, "<|im_end|>"),
])
def test_an_episode_in_each_format_runs_the_call_and_appends_the_templates_tool_message(
    base_tokenizer, parser, template, eos
):
    tokenizer = _with_template(base_tokenizer, template if "{" in template else _trl(template), eos)
    assert tool_parser_for(tokenizer, "auto") == parser
    schemas = tool_schemas([add])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Add 2 and 3."}], tools=schemas,
                                           add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) else list(prompt)
    turns = [_ids(tokenizer, CALLS[parser], eos), _ids(tokenizer, "5", eos)]
    contexts = []

    def sample_turn(requests):
        contexts.extend(context for context, _ in requests)
        ids = turns.pop(0)
        return [Turn(ids, [-0.5] * len(ids), tokenizer.decode(ids, skip_special_tokens=True), "stop")]

    episode = Episode(prompt, {"add": add})
    limits = EpisodeLimits(max_turns=4, max_tokens=200, max_model_len=4000, tool_timeout_s=5.0)
    run_episodes([episode], sample_turn, tokenizer, limits, read_turn=turn_reader(tokenizer, parser))
    first, second = _ids(tokenizer, CALLS[parser], eos), _ids(tokenizer, "5", eos)
    suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "add", "content": "5"}])
    assert (episode.turns, episode.tool_calls, episode.tool_errors) == (2, 1, 0)
    assert episode.messages[:2] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "add", "content": "5"},
    ]
    # The engine's ids as sampled, then the tool message as the template renders it (not trained on), then the
    # second turn; the second turn's context was exactly that.
    assert episode.token_ids == first + suffix + second
    assert episode.mask == [1] * len(first) + [0] * len(suffix) + [1] * len(second)
    assert contexts[1] == prompt + first + suffix
    assert "5" in tokenizer.decode(suffix)
    assert json.dumps({"a": 2, "b": 3}) in tokenizer.decode(first) or "add(a=2, b=3)" in tokenizer.decode(first)
