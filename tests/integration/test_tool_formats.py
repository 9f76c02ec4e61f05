"""Tiny models trained to call the calculator in two families' formats, Qwen's Hermes `<tool_call>` and Llama 3's
`<|python_tag|>` JSON, play episodes through a real vLLM engine: its runner reads each turn in the model's format (for
the Llama one, the format its chat template teaches: rollout.tool_parser auto), runs the calls, and answers them."""

from __future__ import annotations

import random

import pytest

from rlpipe.config import RolloutConfig
from rlpipe.tools import calculator
from rlpipe.types import Prompt
from tests.tiny_tool_model import arithmetic_question, build_tiny_tool_model

pytestmark = pytest.mark.integration
SYSTEM = "Use the calculator."


@pytest.mark.parametrize("call_format", ["hermes", "llama3_json"])
def test_a_tiny_tool_model_calls_the_calculator_in_its_own_format_through_an_engine(tmp_path, call_format):
    from rlpipe.rollout.engine import RolloutEngine

    model = build_tiny_tool_model(tmp_path / "model", SYSTEM, call_format=call_format)
    # The Hermes model's template lists the tools' names and teaches no format, so the format is named for it.
    parser = "hermes" if call_format == "hermes" else "auto"
    rollout = RolloutConfig(max_model_len=256, max_tokens=40, tools=["rlpipe.tools:calculator"], tool_parser=parser)
    engine = RolloutEngine(model, rollout, 0)
    try:
        rng = random.Random(7)
        questions = [arithmetic_question(rng) for _ in range(4)]
        prompts = [Prompt(i, question, [], chat=[{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": question}])
                   for i, (question, _) in enumerate(questions)]
        groups = engine.generate(prompts, 4)
    finally:
        engine.close()
    episodes = [(expression, completion) for (_, expression), group in zip(questions, groups) for completion in group]
    called = [(expression, c) for expression, c in episodes if c.tool_calls]
    # Trained on a call in every first turn, the model calls in most episodes at temperature 1.
    assert len(called) >= len(episodes) // 2, [c.text for _, c in episodes]
    tag = tokenizer_id(model, "<|python_tag|>") if call_format == "llama3_json" else None
    answered = 0
    for expression, completion in called:
        first, answer = completion.messages[0], completion.messages[1]
        (call,) = first["tool_calls"]
        assert call["function"]["name"] == "calculator", completion.text
        assert (answer["role"], answer["name"]) == ("tool", "calculator"), completion.text
        assert completion.mask.count(0) > 0 and completion.turns >= 2
        if tag is not None:  # the call as the model wrote it: Llama's marker, a special token
            assert completion.token_ids[0] == tag, completion.text
        try:
            expected = calculator(**call["function"]["arguments"])
        except Exception:  # noqa: BLE001 - a tiny model's expression may not parse; the model then reads an error
            continue
        answered += 1
        assert answer["content"] == expected, completion.text
    assert answered >= 1, [c.text for _, c in called]


def tokenizer_id(model: str, token: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(token)
