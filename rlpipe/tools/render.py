"""Tool turns through the chat template, and tool calls read from the model's text: a conversation's prompt rendered
with its tools' schemas, the ids of tool messages appended after a finished assistant turn (TRL's
`_get_tool_suffix_ids`), and Qwen/Hermes-style `<tool_call>` blocks parsed as TRL's `parse_response` gives them. Pure
functions of a tokenizer and text; of rlpipe it imports only the chat templating of rlpipe.data (texts kept as
text), which imports nothing."""

from __future__ import annotations

import json
import re

from rlpipe.data.templating import kept_contents, templated_ids, valid_text

# Qwen/Hermes-style tool calls, the format TRL's response schemas parse for those families.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# A call nested deeper is read as malformed: deep enough for any tool's arguments, and far from what Python's
# recursion limit lets pickling (Ray), logging and reward functions carry.
MAX_CALL_DEPTH = 64
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

# Said to a model whose chat template does not render `tools=` (ChatML templates without tool support, e.g.
# SmolLM2's): the tool block Qwen2.5's template writes into the system message, so the model learns one format.
TOOLS_SYSTEM_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def render_conversation(tokenizer, messages: list[dict], schemas: list[dict], messages_as_text: bool = False,
                        **template_kwargs) -> list[int]:
    """Token ids of a conversation's prompt with its tools: rendered by the chat template with `tools=`; a template
    that ignores tools gets them in its system message (TOOLS_SYSTEM_BLOCK), so the model is told of them.
    `messages_as_text` (data.special_tokens_in_prompts: text): a special token's text in a message is tokenized as
    plain text (rlpipe/data/templating.py)."""

    def render(conversation, **extra) -> str:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True, **template_kwargs, **extra
        )

    def with_tools(keep) -> str:
        kept = kept_contents(messages, keep)
        text = render(kept, tools=schemas)
        if not schemas or text != render(kept):
            return text
        block = TOOLS_SYSTEM_BLOCK.format(tools="\n".join(json.dumps(s) for s in schemas))
        if kept and kept[0]["role"] == "system":
            kept = [{**kept[0], "content": f"{kept[0]['content']}\n\n{block}"}, *kept[1:]]
        else:
            kept = [{"role": "system", "content": block}, *kept]
        return render(kept)

    return templated_ids(tokenizer, with_tools, messages_as_text)


def tool_suffix_ids(tokenizer, tool_messages: list[dict], **template_kwargs) -> list[int]:
    """The ids that follow a finished assistant turn when `tool_messages` answer it, up to the next assistant
    header: TRL's `_get_tool_suffix_ids` (a minimal conversation rendered with and without the tool messages, the
    shorter cut after its last end-of-sequence token, the difference taken). The messages' names and contents are
    tools' and the model's text: a special token's text in them is tokenized as plain text, so a tool that prints
    `<|im_end|>` cannot end its message or start a turn (rlpipe/data/templating.py)."""

    def ids(answered: bool) -> list[int]:
        def render(keep) -> str:
            calls = [{"type": "function", "function": {"name": keep(tool_messages[0]["name"]), "arguments": {}}}]
            conversation = [
                {"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls},
            ]
            if answered:
                conversation += [{**m, **{k: keep(m[k]) for k in ("name", "content") if k in m}} for m in tool_messages]
            return tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=answered, **template_kwargs
            )

        return templated_ids(tokenizer, render)

    prefix, full = ids(False), ids(True)
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template renders a tool message by changing what came before it")
    return full[len(prefix) :]


def tool_call_bodies(text: str) -> list[str]:
    """The text inside each `<tool_call>...</tool_call>` block, trimmed, in order: what the pattern
    `<tool_call>\\s*(.*?)\\s*</tool_call>` finds, read in one pass (that pattern's backtracking takes seconds on a
    `<tool_call>` followed by a few thousand spaces)."""
    bodies, position = [], 0
    while (start := text.find(TOOL_CALL_OPEN, position)) != -1:
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end == -1:
            break
        bodies.append(text[start + len(TOOL_CALL_OPEN) : end].strip())
        position = end + len(TOOL_CALL_CLOSE)
    return bodies


def parse_tool_calls(text: str) -> dict:
    """An assistant turn as TRL's `parse_response` gives it: {"role": "assistant", "content": ..., "tool_calls":
    [{"type": "function", "function": {"name", "arguments"}}]} when the text holds Qwen-style tool calls. A malformed
    call makes the whole turn plain text, as TRL's fallback does: one that is not JSON (Python's limits included: an
    integer of more than 4300 digits, nesting past the recursion limit), names no tool, or nests deeper than
    MAX_CALL_DEPTH. Lone surrogates in a call, as characters or as JSON escapes, become U+FFFD."""
    bodies = tool_call_bodies(text)
    calls = [_read_call(body) for body in bodies]
    if not calls or None in calls:
        return {"role": "assistant", "content": text}
    content = text[: text.index(TOOL_CALL_OPEN)].strip()
    return {"role": "assistant", "content": content, "tool_calls": calls}


def _read_call(body: str) -> dict | None:
    """A block's call as TRL gives it, or None where the block holds none."""
    try:
        call = json.loads(valid_text(body))
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError, as is the integer digit limit
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call_depth(call) > MAX_CALL_DEPTH:
        return None
    if _SURROGATE_ESCAPE.search(body):
        call = json.loads(valid_text(json.dumps(call, ensure_ascii=False)))
    arguments = call.get("arguments")
    return {"type": "function", "function": {"name": call["name"], "arguments": {} if arguments is None else arguments}}


def call_depth(value) -> int:
    """How deep lists and mappings nest in `value`, counted without recursion (stopping past MAX_CALL_DEPTH)."""
    deepest, pending = 0, [(value, 1)]
    while pending and deepest <= MAX_CALL_DEPTH:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            pending += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest
