"""The format a model writes its tool calls in, and a turn read in it.

Qwen/Hermes-style `<tool_call>{json}</tool_call>` blocks (`hermes`) rlpipe reads itself, exactly as TRL's
`parse_response` does (render.py). The other formats are read by vLLM's own tool parsers, the ones its server uses
for those families: Llama 3.x JSON calls (`llama3_json`: `{"name": ..., "parameters": {...}}`, after `<|python_tag|>`
or alone), Mistral's `[TOOL_CALLS]` (`mistral`) and a Python list of calls (`pythonic`: `[name(arg=value)]`, Llama
3.2 and 4's alternative, among others). `rollout.tool_parser: auto` tells the format from the chat template, which
teaches the model one: a template that ignores `tools=` gets the Hermes block in its system message (render.py), so
the model is taught Hermes. A template that renders tools in no format rlpipe knows is refused before anything starts.

Whatever format, a turn becomes the message TRL's `parse_response` gives, and a turn that holds no well-formed call
is plain text: a call that is not JSON (or not a Python call), names no tool, or nests deeper than `MAX_CALL_DEPTH`
makes the whole turn text, as a malformed Hermes call does. vLLM's parsers see the turn's text with its special tokens
(the markers of several formats are special tokens), its closing tokens cut.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from rlpipe.data.templating import valid_text
from rlpipe.tools.render import MAX_CALL_DEPTH, TOOL_CALL_OPEN, call_depth, parse_tool_calls

TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")

# What a chat template that renders tools writes for each format, looked for in this order: the tool-call marker or
# the instruction that teaches the format. GLM-4's template also writes `<tool_call>` but puts its arguments in
# `<arg_key>` tags, which is not Hermes: checked first, and refused.
_NOT_HERMES = ("<arg_key>",)
_TEMPLATE_SIGNS = (
    ("[TOOL_CALLS]", "mistral"),
    ("[func_name1(", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": dictionary of argument name and its value', "llama3_json"),
    (TOOL_CALL_OPEN, "hermes"),
)
_DUMMY_TOOL = {"type": "function", "function": {
    "name": "rlpipe_probe", "description": "d", "parameters": {"type": "object", "properties": {}}}}

# A turn's text and its token ids -> the assistant message TRL gives for it.
TurnReader = Callable[[str, list[int]], dict]


def tool_parser_for(tokenizer, configured: str, template_kwargs: dict | None = None) -> str:
    """The tool-call format of rollout.tool_parser `configured`: itself when named, else (`auto`) the one the
    tokenizer's chat template teaches. Raises ValueError in one line where `auto` cannot tell."""
    if configured != "auto":
        if configured not in TOOL_PARSERS:
            raise ValueError(f"rollout.tool_parser: {configured!r} is not one of auto, {', '.join(TOOL_PARSERS)}")
        return configured
    template_kwargs = template_kwargs or {}
    conversation = [{"role": "user", "content": "x"}]

    def render(**tools) -> str:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                             **template_kwargs, **tools)

    if render(tools=[_DUMMY_TOOL]) == render():  # the template ignores tools: render.py teaches Hermes
        return "hermes"
    template = tokenizer.get_chat_template(None, tools=[_DUMMY_TOOL])
    if not any(sign in template for sign in _NOT_HERMES):
        for sign, parser in _TEMPLATE_SIGNS:
            if sign in template:
                return parser
    raise ValueError(
        "rollout.tool_parser: auto cannot tell which tool-call format this model's chat template teaches (it writes "
        "none of <tool_call>{json}, <|python_tag|>, [TOOL_CALLS], [name(args)]); name it: rollout.tool_parser="
        + "|".join(TOOL_PARSERS)
    )


def turn_reader(tokenizer, parser: str) -> TurnReader:
    """The reader of a turn in format `parser` (TOOL_PARSERS). Built in the engine's process: the formats other than
    Hermes import vLLM."""
    if parser == "hermes":
        return lambda text, token_ids: parse_tool_calls(text)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    parser_class = ToolParserManager.get_tool_parser(parser)
    # A malformed call is the sample's outcome, not an error of the run: vLLM's parsers (and the parser engines some
    # of them delegate to) log each with a traceback.
    for package in ("vllm.tool_parsers", "vllm.parser"):
        logging.getLogger(package).setLevel(logging.CRITICAL)
    reader = parser_class(tokenizer)
    request = ChatCompletionRequest(model="rlpipe", messages=[])
    closing = set(tokenizer.all_special_ids)

    def read(text: str, token_ids: list[int]) -> dict:
        plain = {"role": "assistant", "content": text}
        end = len(token_ids)
        while end and token_ids[end - 1] in closing:  # the turn's end (eos, end of message) is no part of it
            end -= 1
        written = tokenizer.decode(token_ids[:end], skip_special_tokens=False)
        try:
            found = reader.extract_tool_calls(written, request)
        except Exception:  # noqa: BLE001 - whatever the model wrote is its sample's outcome
            return plain
        if not found.tools_called or not found.tool_calls:
            return plain
        calls = [_call(tool_call.function.name, tool_call.function.arguments) for tool_call in found.tool_calls]
        if None in calls:
            return plain
        return {"role": "assistant", "content": valid_text(found.content or "").strip(), "tool_calls": calls}

    return read


def _call(name, arguments) -> dict | None:
    """A parsed call as TRL gives it, or None where it is not one: its arguments (a JSON text) read into a mapping
    nested at most MAX_CALL_DEPTH deep."""
    if not isinstance(name, str) or not name:
        return None
    try:
        value = json.loads(valid_text(arguments)) if isinstance(arguments, str) else arguments
        if value is None:
            value = {}
        if not isinstance(value, dict) or call_depth(value) > MAX_CALL_DEPTH:
            return None
        # Lone surrogates from JSON escapes become U+FFFD, as in a Hermes call.
        value = json.loads(valid_text(json.dumps(value, ensure_ascii=False)))
    except (ValueError, TypeError, RecursionError):  # not JSON, Python's digit limit, a value JSON cannot hold
        return None
    return {"type": "function", "function": {"name": valid_text(name), "arguments": value}}
