"""A tiny Qwen3 trained in seconds to judge as the judge tests need: to any non-empty response it replies `Score: 7`,
to an empty one `I cannot rate this.` (no score). Only the tests use it, so it lives here rather than in the package."""

from __future__ import annotations

TEMPLATE = "Q: {question}\nA: {completion}"
SCORED, UNSCORED = "Score: 7", "I cannot rate this."


def build_tiny_judge(folder, seed: int = 0, steps: int = 300, lr: float = 5e-3) -> str:
    import random

    from rlpipe.bench.tiny_model import build_tokenizer
    from tests.tiny_tool_model import train_tiny_qwen3

    tokenizer = build_tokenizer(folder)
    rng = random.Random(seed)
    rows = []
    for _ in range(1024):
        question = f"Calculate {rng.randint(0, 40)} + {rng.randint(0, 40)}."
        words = rng.randint(0, 12)
        response = tokenizer.decode([rng.randrange(3, tokenizer.vocab_size) for _ in range(words)])
        if rng.random() < 0.25:
            response = ""
        request = [{"role": "user", "content": TEMPLATE.format(question=question, completion=response)}]
        prompt = tokenizer.apply_chat_template(request, add_generation_prompt=True, tokenize=True, return_dict=False)
        reply = tokenizer(SCORED if response.strip() else UNSCORED, add_special_tokens=False)["input_ids"]
        reply += [tokenizer.eos_token_id]
        rows.append((list(prompt) + reply, [0] * len(prompt) + [1] * len(reply)))
    return train_tiny_qwen3(folder, tokenizer, rows, 384, seed, steps, lr)
