"""A tiny Qwen3 trained in seconds to call the calculator tool, for the multi-turn tests: its episodes call the real
tool, in Qwen's Hermes format or in Llama 3's JSON format. Only the tests use it, so it lives here rather than in the
package."""

from __future__ import annotations

import json

from rlpipe.bench.tiny_model import train_tokenizer

# A ChatML template that renders `tools=` itself, in one short line (the names of the tools), so that a tiny model's
# prompts stay short; tool messages render as ChatML turns of the role "tool".
TOOL_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if loop.first and tools %}\nTools: {{ tools | map(attribute='function.name') | join(', ') }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The same, teaching Llama 3's JSON calls as Llama 3.1's template does: after its <|python_tag|> special token.
LLAMA_TOOL_CHATML = TOOL_CHATML.replace("| join(', ') }}", "| join(', ') }} <|python_tag|>")
PYTHON_TAG = "<|python_tag|>"


def call_text(expression: str, call_format: str) -> str:
    """The model's call of the calculator on `expression` in `call_format` (hermes | llama3_json)."""
    if call_format == "llama3_json":
        return PYTHON_TAG + json.dumps({"name": "calculator", "parameters": {"expression": expression}})
    return f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}</tool_call>"


def arithmetic_question(rng) -> tuple[str, str]:
    """A question of the calculator recipe's kind (reasoning-gym's basic_arithmetic with three terms of 2-3 digits,
    + - *) and its expression."""
    terms = [str(rng.randint(10, 999)) for _ in range(3)]
    operators = [rng.choice("+-*") for _ in range(2)]
    expression = f"{terms[0]} {operators[0]} {terms[1]} {operators[1]} {terms[2]}"
    return f"Calculate {expression}.", expression


def tool_conversation(tokenizer, system_prompt: str, question: str, expression: str,
                      call_format: str = "hermes") -> tuple[list[int], list[int]]:
    """One episode as the engine would run it when the model calls the calculator on the question's expression and
    then answers with its result: the ids (prompt, first turn, the tool message as rlpipe.tools appends it, second
    turn) and which of them the model writes (1)."""
    from rlpipe.tools import calculator, render_conversation, tool_schemas, tool_suffix_ids

    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    prompt = render_conversation(tokenizer, messages, tool_schemas([calculator]))
    end = [tokenizer.eos_token_id]
    first = tokenizer(call_text(expression, call_format), add_special_tokens=False)["input_ids"] + end
    suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "calculator", "content": calculator(expression)}])
    second = tokenizer(calculator(expression), add_special_tokens=False)["input_ids"] + end
    ids = prompt + first + suffix + second
    return ids, [0] * len(prompt) + [1] * len(first) + [0] * len(suffix) + [1] * len(second)


def build_tool_tokenizer(folder, system_prompt: str, prompt_suffix: str = "", questions=None,
                         call_format: str = "hermes"):
    """The tiny tool model's tokenizer (TOOL_CHATML, the chat specials; for `llama3_json` LLAMA_TOOL_CHATML and the
    <|python_tag|> special token), trained on calculator episodes' text of `questions` (arithmetic_question's; 256
    of seed 0's when None), saved to `folder`: digits one by one, the call's JSON as few tokens."""
    import random

    from tokenizers import pre_tokenizers

    if questions is None:
        rng = random.Random(0)
        questions = [arithmetic_question(rng) for _ in range(256)]
    call = call_text("1 + 2", call_format).removeprefix(PYTHON_TAG)
    corpus = [f"system\n{system_prompt}\nTools: calculator\nuser\n{q}{prompt_suffix}\nassistant\n"
              f"{call}\ntool\n" for q, _ in questions]
    digits_apart = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    if call_format == "hermes":
        return train_tokenizer(folder, digits_apart, corpus, 448, TOOL_CHATML)
    tokenizer = train_tokenizer(folder, digits_apart, corpus, 448, LLAMA_TOOL_CHATML)
    tokenizer.add_special_tokens({"additional_special_tokens": [PYTHON_TAG]})
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_tiny_tool_model(folder, system_prompt: str, prompt_suffix: str = "", seed: int = 0, steps: int = 400,
                          lr: float = 5e-3, call_format: str = "hermes") -> str:
    """A tiny Qwen3 that calls the calculator tool (rlpipe.tools:calculator): trained briefly (supervised, on the
    model's tokens) on episodes of the calculator recipe's kind, whose first turn is a call of the question's
    expression in `call_format` (hermes: Qwen's <tool_call>; llama3_json: Llama 3's <|python_tag|>{...}) and whose
    second turn is the tool's result. Sampled at temperature 1, most episodes call
    the tool and some answer right. Its tokenizer splits digits one by one and learns the call's JSON as few tokens."""
    import random

    rng = random.Random(seed)
    questions = [arithmetic_question(rng) for _ in range(2048)]
    tokenizer = build_tool_tokenizer(folder, system_prompt, prompt_suffix, questions[:256], call_format)

    rows = [tool_conversation(tokenizer, system_prompt, q + prompt_suffix, e, call_format) for q, e in questions]
    return train_tiny_qwen3(folder, tokenizer, rows, 512, seed, steps, lr)


def train_tiny_qwen3(folder, tokenizer, rows: list[tuple[list[int], list[int]]], vocab_size: int, seed: int,
                     steps: int, lr: float) -> str:
    """A random 2-layer Qwen3 of `vocab_size` for `tokenizer`, trained on `rows` (`train_on_rows`), saved to `folder`
    (the tokenizer is there already)."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    train_on_rows(model, rows, tokenizer.pad_token_id, steps, lr)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    return str(folder)


def train_on_rows(model, rows: list[tuple[list[int], list[int]]], pad_id: int, steps: int, lr: float,
                  batch_size: int = 16) -> None:
    """Supervised steps on `rows` (token ids, and 1 where the model writes the token), cycling through them."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains faster on one thread than on two that other work shares
    try:
        for step in range(steps):
            chosen = [rows[(step * batch_size + i) % len(rows)] for i in range(batch_size)]
            width = max(len(ids) for ids, _ in chosen)
            ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in chosen])
            labels = torch.tensor([[t if m else -100 for t, m in zip(i, mask)] + [-100] * (width - len(i))
                                   for i, mask in chosen])
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        torch.set_num_threads(threads)
