"""Held-out evaluation: greedy accuracy, and with `eval.samples_per_prompt` = k > 1 also mean@k and pass@k over k
sampled completions per prompt. The same evaluation runs during training (before the first step, every
`eval.every` steps, after the last: rlpipe/run/controller.py) and on saved weights without training (`rlpipe eval`).

pass@j is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"): with c of
n samples correct, 1 - C(n - c, j) / C(n, j), averaged over prompts; it is reported for j = 2, 4, 8, ... below n,
and n. mean@n is the mean share of correct samples (the estimator's pass@1). A sample is correct when its reward
reaches `reward.success_threshold`; an unscored sample counts as wrong.
"""

from __future__ import annotations

import math

from rlpipe.reporting.metrics import rollout_metrics
from rlpipe.types import LoopRoles

# Engines are seeded with step EVAL_SEED_STEP + s for the sampled evaluation after s steps: seeds no training step
# uses, and the same in a resumed run. Each training step seeds the engines again before it generates, so an
# evaluation leaves the training's samples as they would have been without it.
EVAL_SEED_STEP = 1_000_000


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, c of them correct, is
    correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The j of the pass@j reported for n samples per prompt: the powers of two from 2 below n, and n."""
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n] if n > 1 else []


def sampled_figures(correct: list[int], n: int) -> dict[str, float]:
    """mean@n and pass@j (see `pass_ks`) from each prompt's count of correct samples out of n."""
    if not correct:
        return {}
    figures = {f"mean@{n}": sum(correct) / (n * len(correct))}
    for k in pass_ks(n):
        figures[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(correct)
    return figures


def due(step: int, cfg) -> bool:
    """Whether the held-out set is evaluated after `step`: every `eval.every` steps, and after the last."""
    return step == cfg.train.steps or (cfg.eval.every > 0 and step % cfg.eval.every == 0)


def evaluate(roles: LoopRoles, eval_set, cfg, step: int, trainer_state=None) -> dict | None:
    """The held-out figures of the engines' current weights after `step` training steps: {"step", "accuracy"
    (greedy), "tool_call_rate" (greedy episodes that called a tool, where the recipe has tools), and with
    eval.samples_per_prompt = k > 1 "mean@k" and "pass@j"}; None without held-out prompts.
    `roles` generates, seeds and scores (the run's Roles, or the engines alone for `rlpipe eval`)."""
    if len(eval_set) == 0:
        return None
    prompts = eval_set.prompts(range(len(eval_set)))
    threshold = cfg.reward.success_threshold
    greedy = roles.generate(prompts, 1, temperature=0.0)
    roles.score(greedy, trainer_state)
    figures = rollout_metrics(greedy, threshold)
    point = {"step": step, "accuracy": figures["accuracy"]}
    if "tool_call_rate" in figures:  # multi-turn episodes: how many greedy episodes called a tool
        point["tool_call_rate"] = figures["tool_call_rate"]
    if cfg.eval.sampled:
        k = cfg.eval.samples_per_prompt
        temperature = cfg.rollout.temperature if cfg.eval.temperature is None else cfg.eval.temperature
        roles.seed(EVAL_SEED_STEP + step)
        groups = roles.generate(prompts, k, temperature=temperature)
        roles.score(groups, trainer_state)
        correct = [sum(r is not None and r >= threshold for r in group.rewards) for group in groups]
        point.update(sampled_figures(correct, k))
    return point


def metrics(point: dict | None) -> dict[str, float]:
    """A point's figures as the step's metrics: eval/accuracy, eval/mean@k, eval/pass@j."""
    return {f"eval/{name}": value for name, value in (point or {}).items() if name != "step"}


def describe(point: dict) -> str:
    """`0.50 (greedy); mean@4 0.38, pass@2 0.55, pass@4 0.75`; with tools `0.50 (greedy, tool calls in 0.75)`."""
    greedy = ("step", "accuracy", "checkpoint", "tool_call_rate")
    sampled = [f"{name} {value:.2f}" for name, value in point.items() if name not in greedy]
    calls = f", tool calls in {point['tool_call_rate']:.2f}" if "tool_call_rate" in point else ""
    return f"{point['accuracy']:.2f} (greedy{calls})" + (f"; {', '.join(sampled)}" if sampled else "")


def best(points: list[dict]) -> dict | None:
    """The point of the highest greedy accuracy, then the highest mean@k; the earliest of equals."""
    if not points:
        return None
    mean = lambda point: next((v for name, v in point.items() if name.startswith("mean@")), 0.0)  # noqa: E731
    return max(points, key=lambda point: (point["accuracy"], mean(point), -point["step"]))
