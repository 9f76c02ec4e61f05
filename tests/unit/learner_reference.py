"""Saved learner updates: three GRPO updates on fixed batches for every loss configuration, eager and graph, one and
two ranks. The saved parameters and metrics pin the learner's numbers, so a restructuring of the learner that
changes what is trained fails `test_learner_reference.py`.

    python -m tests.unit.learner_reference          # rewrite tests/data/learner_reference.* from the current code

Only rewrite it when a change to the numbers is intended, and say so in the commit.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from tests.weights import whole_weights

STEPS = 3
DATA = Path(__file__).resolve().parents[1] / "data"
REFERENCE = DATA / "learner_reference.json"
PROJECTIONS = 8

# name -> (model family, ranks, overrides). Every case trains three steps of `batches()`.
CASES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "grpo": ("qwen3", 1, ()),
    "grpo-seq-mean": ("qwen3", 1, ("algo.loss_agg=seq-mean-token-mean", "algo.tis_cap=null")),
    "grpo-sum-norm": ("qwen3", 1, ("algo.loss_agg=seq-mean-token-sum-norm", "algo.advantage_scale=none")),
    "grpo-symmetric-clip": ("qwen3", 1, ("algo.clip_low=0.1", "algo.clip_high=0.1")),
    "kl-k1": ("qwen3", 1, ("algo.kl_beta=0.05", "algo.kl_estimator=k1")),
    "kl-k2": ("qwen3", 1, ("algo.kl_beta=0.05", "algo.kl_estimator=k2")),
    "kl-k3-two-optimizer-steps": (
        "qwen3", 1, ("algo.kl_beta=0.05", "train.mini_batch_size=3", "train.micro_batch_size=3",
        "train.lr_schedule=cosine", "train.warmup_steps=1"),
    ),
    "mis-token": ("qwen3", 1, ("algo.mis_threshold=1.5", "algo.mis_level=token")),
    "mis-sequence": ("qwen3", 1, ("algo.mis_threshold=1.5", "algo.mis_level=sequence", "algo.tis_cap=null")),
    "padded-rows": ("qwen3", 1, ("learner.packing=false", "learner.skip_zero_advantage=false")),
    "moe-router": ("qwen3_moe", 1, ("algo.router_aux_loss_coef=0.1",)),
    "graph-kl": ("qwen3", 1, ("learner.graph=true", "algo.kl_beta=0.05")),
    "graph-moe-router": ("qwen3_moe", 1, ("learner.graph=true", "algo.router_aux_loss_coef=0.1")),
    "two-ranks-kl": ("qwen3", 2, ("algo.kl_beta=0.05",)),
    "two-ranks-graph-moe": ("qwen3_moe", 2, ("learner.graph=true", "algo.router_aux_loss_coef=0.1")),
}


def config(model_path: str, ranks: int, overrides: tuple[str, ...]):
    from rlpipe.config import load_config

    return load_config(
        None,
        [
            f"model.path={model_path}",
            "learner.length_buckets=[16]",
            "data.max_prompt_tokens=8",
            "rollout.max_tokens=8",
            "rollout.group_size=3",
            "train.prompts_per_step=2",
            "train.micro_batch_size=2",
            "train.lr=1e-3",
            "train.adam_eps=1e-4",  # keeps float noise in near-zero gradients from becoming full-size Adam steps
            f"train.steps={STEPS}",
            f"learner.ranks={ranks}",
            *overrides,
        ],
    )


def batches():
    """Three steps of 6 samples: random prompts, completions and rollout log-probs; the second step's first two
    samples have advantage 0 (skipped where the learner skips them)."""
    from rlpipe.types import TrainBatch

    generator = torch.Generator().manual_seed(0)
    out = []
    for step in range(STEPS):
        prompts = [torch.randint(3, 300, (int(n),), generator=generator).tolist() for n in torch.randint(2, 7, (6,))]
        # Two samples of each group share their prompt, as GRPO groups do.
        prompts[1], prompts[4] = prompts[0], prompts[3]
        completions = [torch.randint(3, 300, (int(n),), generator=generator).tolist() for n in torch.randint(1, 8, (6,))]
        logprobs = [(-6.0 + torch.randn(len(c), generator=generator)).tolist() for c in completions]
        advantages = torch.randn(6, generator=generator)
        if step == 1:
            advantages[:2] = 0.0
        out.append(TrainBatch.from_sequences(prompts, completions, logprobs, advantages.tolist(), pad_id=0))
    return out


def _train(model_path: str, ranks: int, overrides: tuple[str, ...], rank: int = 0, port: int = 0):
    """(parameters after three steps on rank 0, this rank's sums per step)."""
    from rlpipe.training.learner import Learner

    torch.manual_seed(0)
    learner = Learner.from_config(model_path, config(model_path, ranks, overrides), rank, ranks)
    learner.join_process_group("127.0.0.1", port)
    sums = [learner.train_step(batch) for batch in batches()]
    state = whole_weights(learner)
    return state, sums


def _rank(rank, ranks, model_path, overrides, port, results):
    torch.set_num_threads(1)
    state, sums = _train(model_path, ranks, overrides, rank, port)
    results.put((rank, {k: v.detach().numpy().copy() for k, v in state.items()} if rank == 0 else None, sums))
    torch.distributed.destroy_process_group()


def run_case(name: str, models: dict[str, str]) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """The parameters and the combined metrics of every step of case `name`."""
    from rlpipe.training.learner import combine_rank_metrics
    from rlpipe.parallel.mesh import find_free_port

    family, ranks, overrides = CASES[name]
    model_path = models[family]
    if ranks == 1:
        state, sums = _train(model_path, 1, overrides)
        return state, [combine_rank_metrics([s]) for s in sums]
    context = mp.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    procs = [context.Process(target=_rank, args=(r, ranks, model_path, overrides, port, results)) for r in range(ranks)]
    for proc in procs:
        proc.start()
    outputs = sorted((results.get(timeout=900) for _ in procs), key=lambda out: out[0])
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise RuntimeError(f"learner rank of case {name} exited with {proc.exitcode}")
    state = {k: torch.from_numpy(v) for k, v in outputs[0][1].items()}
    metrics = [combine_rank_metrics([sums[step] for _, _, sums in outputs]) for step in range(STEPS)]
    return state, metrics


def fingerprint(tensor: torch.Tensor) -> list[float]:
    """A tensor's values seen through 8 fixed random projections (float64), then its largest magnitude: a few
    numbers per tensor that move by about d when any entry moves by d, so the reference stays small. (A plain sum
    would not do: rounding noise of the same sign in every entry adds up in it.)"""
    values = tensor.detach().double().flatten()
    generator = torch.Generator().manual_seed(values.numel())
    directions = torch.randn(PROJECTIONS, values.numel(), generator=generator, dtype=torch.float64)
    return [*(directions @ values).tolist(), float(values.abs().max())]


def build_models(folder: Path) -> dict[str, str]:
    from rlpipe.bench.tiny_model import build_tiny_model

    return {family: build_tiny_model(folder / family, family) for family in ("qwen3", "qwen3_moe")}


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    saved = json.loads(REFERENCE.read_text()) if REFERENCE.exists() and sys.argv[1:] else {}
    with tempfile.TemporaryDirectory() as folder:
        models = build_models(Path(folder))
        for name in names:
            print(f"case {name}", flush=True)
            state, metrics = run_case(name, models)
            saved[name] = {"parameters": {key: fingerprint(value) for key, value in state.items()}, "metrics": metrics}
    DATA.mkdir(exist_ok=True)
    REFERENCE.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
