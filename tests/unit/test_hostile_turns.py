"""No turn a model writes stops the episode loop (rlpipe/tools/episodes.py): seeded random and hostile turns — calls
nested past the recursion limit, integers past Python's digit limit, lone surrogates and undecodable bytes, chat
control tokens, thousands of calls in one turn, huge arguments, tools whose results or errors cannot be written —
played through `run_episodes` with a scripted engine. Every episode ends within its limits, and no tool message
adds a special token beyond the template's own."""

from __future__ import annotations

import json
import random
import time

import pytest

from rlpipe.bench.tiny_model import build_tokenizer
from rlpipe.tools import Episode, EpisodeLimits, ToolThreads, Turn, calculator, run_episodes
from tests.unit.test_tools import Unprintable, UnprintableError

LIMITS = EpisodeLimits(max_turns=4, max_tokens=40, max_model_len=4000, tool_timeout_s=2.0, max_tool_calls_per_turn=8,
                       max_tool_time_s=0.5)
CONTROL = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>user\n"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


CALLS_RUN: list[str] = []  # the calls the test's tools ran


def echo(text: str) -> str:
    """Print the text, as the python tool prints what a program writes.

    Args:
        text: what to print
    """
    CALLS_RUN.append("echo")
    return text


def nap(seconds: float) -> str:
    """Sleep a little.

    Args:
        seconds: how long, at most 0.3
    """
    CALLS_RUN.append("nap")
    time.sleep(min(float(seconds), 0.3))
    return "rested"


def odd(kind: str):
    """Answer with what cannot be written as text, or fail so.

    Args:
        kind: object, integer, nesting, error or exit
    """
    CALLS_RUN.append("odd")
    if kind == "error":
        raise UnprintableError()
    if kind == "exit":
        raise SystemExit(kind)
    if kind == "integer":
        return 7**9000
    if kind == "nesting":
        nested: list = []
        for _ in range(50_000):
            nested = [nested]
        return nested
    return Unprintable()


TOOLS = {tool.__name__: tool for tool in (echo, nap, odd, calculator)}


def _call(name, arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _hostile_turn(rng: random.Random) -> str:
    """One turn of a kind the model might write, picked at random."""
    control = rng.choice(CONTROL)
    kinds = [
        lambda: "<tool_call>" + "[" * rng.randint(900, 20_000) + "</tool_call>",
        lambda: "<tool_call>" + '{"name": "echo", "arguments": ' * rng.randint(100, 3000) + "</tool_call>",
        lambda: '<tool_call>{"name": "echo", "arguments": {"text": ' + "9" * rng.randint(4301, 20_000)
        + "}}</tool_call>",
        lambda: '<tool_call>{"name": "calculator", "arguments": {"expression": 1e999}}</tool_call>',
        lambda: r'<tool_call>{"name": "echo\ud800", "arguments": {"text": "\udc00 \ud83d\ude00"}}</tool_call>',
        lambda: '<tool_call>{"name": "echo", "arguments": {"text": "\udcff\udcfe raw"}}</tool_call>' + "\udcff",
        lambda: "\ufffd\ufffd" + _call("echo", {"text": "\ufffd" * 50}),
        lambda: _call("echo", {"text": control * rng.randint(1, 50)}),
        lambda: _call(control, {}) + _call(f"x{control}y", {"text": control}),
        lambda: control + _call("echo", {"text": "after a control token"}),
        lambda: "".join(_call(rng.choice(["echo", control, "nap"]), {"text": control}) for _ in range(3000)),
        lambda: _call("echo", {"text": "x" * rng.randint(50_000, 200_000)}),
        lambda: _call("echo", {"text": "".join(rng.choice("ab<|>\n{}[]\"\\") for _ in range(2000))}),
        lambda: "<tool_call>" + " " * rng.randint(2000, 20_000),
        lambda: "<tool_call>" * rng.randint(100, 3000) + "</tool_call>" * rng.randint(0, 3),
        lambda: _call("odd", {"kind": rng.choice(["object", "integer", "nesting", "error", "exit"])}),
        lambda: _call("echo", [1, 2, 3]) + _call("echo", "text") + _call("echo", {"unknown": 1}),
        lambda: '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        lambda: _call("nap", {"seconds": 0.3}) * 2,
        lambda: _call("calculator", {"expression": "9" * 150 + " * " + "9" * 40}),
        lambda: "".join(rng.choice(["<tool_call>", "</tool_call>", "{", "}", "[", '"', ":", control, "é", "\x00", " "])
                        for _ in range(rng.randint(1, 3000))),
        lambda: "The answer is 5.",
    ]
    return rng.choice(kinds)()


def _scripted_engine(tokenizer, scripts: dict[int, list[str]], rng: random.Random):
    """Answers each request with its episode's next scripted text (the episode found by the context's first id), as a
    few arbitrary ids ending with the end-of-turn token: the loop reads the text, and keeps the ids as they are."""
    plain = [i for i in range(3, 60)]  # no special token among them

    def sample_turn(requests):
        turns = []
        for context, max_tokens in requests:
            ids = [rng.choice(plain) for _ in range(rng.randint(1, 6))] + [tokenizer.eos_token_id]
            finish = rng.choice(["stop"] * 9 + ["length"])
            if len(ids) > max_tokens:
                ids, finish = ids[:max_tokens], "length"
            turns.append(Turn(ids, [-0.5] * len(ids), scripts[context[0]].pop(0), finish))
        return turns

    return sample_turn


def _special_ids(tokenizer, ids: list[int]) -> list[int]:
    specials = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return [token for token in ids if token in specials]


def test_every_episode_of_hostile_turns_ends_within_its_limits(tokenizer):
    rng = random.Random(20261207)
    episodes = [Episode([100 + number, 7, 8, 9], dict(TOOLS)) for number in range(60)]
    scripts = {episode.prompt_ids[0]: [_hostile_turn(rng) for _ in range(LIMITS.max_turns)] for episode in episodes}
    CALLS_RUN.clear()
    run_episodes(episodes, _scripted_engine(tokenizer, scripts, rng), tokenizer, LIMITS, threads=ToolThreads())

    for episode in episodes:
        assert episode.finish_reason in ("stop", "length")
        assert 1 <= episode.turns <= LIMITS.max_turns and episode.length <= LIMITS.max_model_len
        assert len(episode.token_ids) == len(episode.mask) == len(episode.logprobs)
        assert len([m for m in episode.messages if m["role"] == "assistant"]) == episode.turns
        tool_messages = [m for m in episode.messages if m["role"] == "tool"]
        # Each appended tool turn: the template's header and end around each message, and the next reply's header;
        # nothing a tool printed or a model named reads as a special token.
        tool_turns = sum(1 for i, mask in enumerate(episode.mask) if not mask and (i == 0 or episode.mask[i - 1]))
        tool_ids = [token for token, mask in zip(episode.token_ids, episode.mask) if not mask]
        assert len(_special_ids(tokenizer, tool_ids)) == 2 * len(tool_messages) + tool_turns
        for message in episode.messages:  # what reward functions and logs get is valid text
            if message["role"] == "tool" or "tool_calls" in message:
                json.dumps({k: v for k, v in message.items() if k != "content" or message["role"] == "tool"},
                           ensure_ascii=False).encode("utf-8")
    # The hostile kinds were met, and the loop answered what it could.
    assert max(e.tool_calls for e in episodes) >= 3000 and len(CALLS_RUN) <= 8 * sum(e.turns for e in episodes)
    tool_contents = [m["content"] for e in episodes for m in e.messages if m["role"] == "tool"]
    assert any("could not be written as text" in c for c in tool_contents)
    assert any("<|im_end|>" in c for c in tool_contents)
    assert sum(e.finish_reason == "length" for e in episodes) and sum(e.finish_reason == "stop" for e in episodes)
