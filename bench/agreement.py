"""`rlpipe bench agreement`: learner vs rollout log-probs of the sampled tokens, per engine model and dtype."""

from __future__ import annotations

import json

import torch

from rlpipe.bench.common import in_fresh_process


AGREEMENT_QUESTIONS = [
    "What is 17 + 25?", "Name three primary colours.", "Write a haiku about rain.", "What is the capital of France?",
    "Explain what a prime number is.", "Compute 9 * 8.", "List the days of the week.", "What does a compiler do?",
]


def _sampled(model_path: str, impl: str, dtype: str, prompts: int, samples: int, max_tokens: int, results) -> None:
    """One engine (vLLM's model or rlpipe's inside vLLM) samples completions: each sample's prompt ids, completion
    ids and the engine's log-probs of them."""
    from transformers import AutoTokenizer

    from rlpipe.config import RolloutConfig
    from rlpipe.data.prompts import render_prompt
    from rlpipe.rollout.engine import RolloutEngine
    from rlpipe.types import Prompt

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    questions = [AGREEMENT_QUESTIONS[i % len(AGREEMENT_QUESTIONS)] for i in range(prompts)]
    batch = [Prompt(i, q, render_prompt(tokenizer, q, None)) for i, q in enumerate(questions)]
    engine = RolloutEngine(model_path, RolloutConfig(dtype=dtype, model_impl=impl, max_tokens=max_tokens), seed=0)
    groups = engine.generate(batch, samples, temperature=1.0)
    engine.close()
    results.put([(prompt.token_ids, c.token_ids, c.logprobs) for prompt, group in zip(batch, groups) for c in group])


def _agreement(model_path: str, sampled: list, results) -> None:
    """The fp32 learner model's log-probs of the sampled tokens against the engine's. In a process of its own: where
    vLLM serves a family through its Transformers backend, it rewrites that family's transformers classes in the
    engine's process, and the learner's model cannot be built (nor run) there."""
    from rlpipe.models import load_model
    from rlpipe.training.train_engine import token_logprobs

    model = load_model(model_path).eval()
    gaps = []
    with torch.no_grad():
        for prompt_ids, completion_ids, logprobs in sampled:
            ids = torch.tensor([prompt_ids + completion_ids])
            learner = token_logprobs(model, ids)[0, len(prompt_ids) :]
            gaps.append(learner - torch.tensor(logprobs))
    gap = torch.cat(gaps).double()
    results.put({
        "tokens": gap.numel(),
        "mean_abs": gap.abs().mean().item(),
        "max_abs": gap.abs().max().item(),
        "kl_k3": (torch.exp(gap) - gap - 1).mean().item(),  # KL(rollout || learner) on the rollout's samples
    })


def bench_agreement(model: str, impls: list[str], dtypes: list[str], prompts: int, samples: int, max_tokens: int,
                    out: str | None = None) -> list[dict]:
    """|learner - rollout| log-prob of the sampled tokens, for each engine model and dtype; the learner runs
    rlpipe's model in fp32 (the default learner)."""
    from rlpipe.models.builtin import resolve_model_path

    model_path = resolve_model_path(model)
    rows = []
    print(f"{model_path}: {prompts} prompts x {samples} samples x up to {max_tokens} tokens, learner fp32", flush=True)
    for dtype in dtypes:
        for impl in impls:
            sampled = in_fresh_process(_sampled, model_path, impl, dtype, prompts, samples, max_tokens)
            measured = in_fresh_process(_agreement, model_path, sampled)
            row = {"model_impl": impl, "dtype": dtype, **measured}
            rows.append(row)
            print(f"  engine {impl:>6} {dtype:>8}: mean |d logprob| {row['mean_abs']:.3g}, max {row['max_abs']:.3g}, "
                  f"KL {row['kl_k3']:.3g} over {row['tokens']} tokens", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"model": model_path, "rows": rows}, f, indent=2)
    return rows
