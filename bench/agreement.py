"""`rlpipe bench agreement`: learner vs rollout log-probs of the sampled tokens, per engine model and dtype."""

from __future__ import annotations

import json

import torch

from rlpipe.bench.common import in_fresh_process


AGREEMENT_QUESTIONS = [
    "What is 17 + 25?", "Name three primary colours.", "Write a haiku about rain.", "What is the capital of France?",
    "Explain what a prime number is.", "Compute 9 * 8.", "List the days of the week.", "What does a compiler do?",
]


def _agreement_run(model_path: str, impl: str, dtype: str, prompts: int, samples: int, max_tokens: int, results) -> None:
    """One engine (vLLM's model or rlpipe's inside vLLM) samples completions; the fp32 learner model scores the
    same tokens. In a fresh process, so engines never share one."""
    from transformers import AutoTokenizer

    from rlpipe.config import RolloutConfig
    from rlpipe.data.prompts import render_prompt
    from rlpipe.training.train_engine import token_logprobs
    from rlpipe.models import load_model
    from rlpipe.rollout.engine import RolloutEngine
    from rlpipe.types import Prompt

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    questions = [AGREEMENT_QUESTIONS[i % len(AGREEMENT_QUESTIONS)] for i in range(prompts)]
    batch = [Prompt(i, q, render_prompt(tokenizer, q, None)) for i, q in enumerate(questions)]
    engine = RolloutEngine(model_path, RolloutConfig(dtype=dtype, model_impl=impl, max_tokens=max_tokens), seed=0)
    groups = engine.generate(batch, samples, temperature=1.0)
    engine.close()
    model = load_model(model_path).eval()
    gaps = []
    with torch.no_grad():
        for prompt, completions in zip(batch, groups):
            for completion in completions:
                ids = torch.tensor([prompt.token_ids + completion.token_ids])
                learner = token_logprobs(model, ids)[0, len(prompt.token_ids) :]
                gaps.append(learner - torch.tensor(completion.logprobs))
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
            measured = in_fresh_process(_agreement_run, model_path, impl, dtype, prompts, samples, max_tokens)
            row = {"model_impl": impl, "dtype": dtype, **measured}
            rows.append(row)
            print(f"  engine {impl:>6} {dtype:>8}: mean |d logprob| {row['mean_abs']:.3g}, max {row['max_abs']:.3g}, "
                  f"KL {row['kl_k3']:.3g} over {row['tokens']} tokens", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"model": model_path, "rows": rows}, f, indent=2)
    return rows
