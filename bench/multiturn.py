"""A multi-turn rollout step against a single-turn one of the same total tokens, on one engine in this process.

The recipe's prompts (configs/calculator.yaml unless given) are generated twice, the two kinds taking turns:
as episodes with the recipe's tools, and as plain completions whose `max_tokens` is the episodes' mean count of
model tokens, so that both generate about the same tokens (EOS may end either earlier: the tokens generated are
reported). For the episodes the wall time is split into the engine (vLLM's generation calls), the tools (their
calls, run in threads) and the driver (the rest: parsing turns, rendering tool messages through the chat
template, bookkeeping). Nothing here starts Ray.

    python bench/multiturn.py [--recipe configs/calculator.yaml] [--prompts 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _timed(owner, name: str, spent: dict[str, float]):
    """Add the seconds every call of `owner.name` takes to `spent[name]` while the context lasts."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "configs" / "calculator.yaml"))
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts a step")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--rounds", type=int, default=2, help="steps of each kind, taking turns")
    parser.add_argument("--out", help="also write the figures as JSON here")
    args = parser.parse_args()

    import rlpipe.tools.episodes
    from rlpipe.startup import preflight
    from rlpipe.config import load_config
    from rlpipe.data.prompts import PromptSet, load_rows
    from rlpipe.models.builtin import resolve_model_path
    from rlpipe.rollout.engine import RolloutEngine
    from rlpipe.tools.runner import SingleTurn

    cfg = load_config(args.recipe, [f"data.eval_size={args.prompts}"])
    model_path = resolve_model_path(cfg.model.path)
    tokenizer_path, tokenizer = preflight.check_tokenizer(cfg.model, model_path)
    train_rows, eval_rows = load_rows(cfg.data, cfg.run.seed)
    prompts = PromptSet(eval_rows, tokenizer, cfg.data, id_offset=len(train_rows),
                        max_prompt_tokens=cfg.max_prompt_tokens).prompts(range(len(eval_rows)))
    engine = RolloutEngine(model_path, cfg.rollout, cfg.run.seed, tokenizer_path, cfg.sync, progress_bars=False)
    multi_turn = engine.episode_runner
    rows = {"multi": [], "single": []}
    try:
        engine.generate(prompts[:2], 1)  # warm-up: the first generation builds what later ones reuse
        for _ in range(args.rounds):
            spent: dict[str, float] = {}
            engine.episode_runner = multi_turn
            started = time.perf_counter()
            with _timed(engine, "_run", spent), _timed(rlpipe.tools.episodes, "run_tool_calls", spent):
                groups = engine.generate(prompts, args.samples)
            wall = time.perf_counter() - started
            episodes = [c for group in groups for c in group]
            model_tokens = sum(c.model_tokens for c in episodes)
            rows["multi"].append({
                "wall_s": wall, "samples": len(episodes), "model_tokens": model_tokens,
                "all_tokens": sum(len(c.token_ids) for c in episodes),
                "turns": statistics.mean(c.turns for c in episodes),
                "tool_calls": sum(c.tool_calls for c in episodes),
                "engine_s": spent.get("_run", 0.0), "tools_s": spent.get("run_tool_calls", 0.0),
            })
            engine.episode_runner = SingleTurn()
            max_tokens = max(1, round(model_tokens / len(episodes)))
            started = time.perf_counter()
            groups = engine.generate(prompts, args.samples, max_tokens=max_tokens)
            wall = time.perf_counter() - started
            completions = [c for group in groups for c in group]
            rows["single"].append({"wall_s": wall, "samples": len(completions), "max_tokens": max_tokens,
                                   "model_tokens": sum(len(c.token_ids) for c in completions)})
    finally:
        engine.episode_runner = multi_turn
        engine.close()

    def median(kind: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[kind])

    multi_rate = median("multi", "samples") / median("multi", "wall_s")
    single_rate = median("single", "samples") / median("single", "wall_s")
    wall = median("multi", "wall_s")
    engine_s, tools_s = median("multi", "engine_s"), median("multi", "tools_s")
    print(f"{args.prompts} prompts x {args.samples} samples, medians of {args.rounds} steps of each kind")
    print(f"multi-turn:  {multi_rate:6.2f} samples/s, {median('multi', 'model_tokens') / wall:7.1f} model tokens/s, "
          f"{median('multi', 'turns'):.2f} turns, {median('multi', 'tool_calls'):.0f} tool calls; "
          f"engine {engine_s:.2f} s, tools {tools_s:.2f} s, driver {wall - engine_s - tools_s:.2f} s of {wall:.2f} s")
    print(f"single-turn: {single_rate:6.2f} samples/s, "
          f"{median('single', 'model_tokens') / median('single', 'wall_s'):7.1f} model tokens/s "
          f"(max_tokens {rows['single'][0]['max_tokens']})")
    print(f"multi-turn / single-turn samples/s: {multi_rate / single_rate:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
