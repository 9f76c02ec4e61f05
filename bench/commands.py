"""`rlpipe bench`'s command line: each benchmark's options, checked before it starts, and the call that runs it.
The benchmarks themselves are imported only once one is asked for."""

from __future__ import annotations

import argparse


def add_bench(commands) -> None:
    """`rlpipe bench WHAT`'s parsers, under the command line's `commands`."""
    bench = commands.add_parser("bench", help="benchmarks, as ratios against a baseline run alongside")
    benches = bench.add_subparsers(dest="what", required=True)
    for add in (_add_bench_learner, _add_bench_sync, _add_bench_kernels, _add_bench_agreement, _add_bench_e2e):
        add(benches).add_argument("--out", help="also write the results as JSON here")


def _add_bench_learner(benches) -> argparse.ArgumentParser:
    learner = benches.add_parser("learner", help="train-step throughput: eager vs graph, 1 vs 2 ranks, MFU")
    learner.add_argument("--layers", type=int, help="decoder layers (default 12, or the preset's)")
    learner.add_argument("--hidden", type=int, help="hidden width (default 512, or the preset's)")
    learner.add_argument("--seq", type=int, help="tokens a row (default 256, or the preset's)")
    learner.add_argument("--batch", type=int, help="rows a step (default 8, or the preset's)")
    learner.add_argument(
        "--preset",
        help="a released model's shape with random weights: qwen3-0.6b (28 x 1024, 8 rows of 2048 tokens), "
        "qwen3-1.7b (28 x 2048, 4 rows of 2048), smollm2-135m (30 x 576, 32 rows of 128); or tiny (2 x 64, 4 rows of "
        "64), a moment's step on a CPU",
    )
    learner.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="cuda: single-rank modes on one GPU in bf16 mixed precision (float32 master weights), MFU against the "
        "GPU's bf16 matmul peak measured in the same run",
    )
    learner.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step")
    learner.add_argument(
        "--modes",
        default=None,
        help="first one is the baseline; a -loraN suffix (eager-lora16) trains rank-N adapters (alpha 32) on every "
        "linear layer instead of every weight; xla-graph and xla-graph-m2 (2-device SPMD mesh) need torch_xla's "
        "environment; +loop / +pallas / +torch picks the MoE experts' implementation "
        "(default: eager,graph,eager-m2,graph-m2; with --device cuda: eager,graph; with --experts: "
        "eager+loop,eager,graph)",
    )
    learner.add_argument(
        "--rounds", type=int, default=1, help="> 1: time the single-rank modes again taking turns, best step each"
    )
    learner.add_argument("--experts", type=int, default=0, help="> 0: a Qwen3-MoE with this many experts a layer")
    learner.add_argument("--top-k", type=int, default=2, help="experts per token (with --experts)")
    learner.add_argument("--expert-intermediate", type=int, default=384, help="each expert's MLP width")
    learner.add_argument(
        "--group-size", type=int, default=1,
        help="> 1: rows come in groups sharing their prompt (half of --seq), as GRPO's samples do; mode "
        "eager-unshared runs them with learner.share_prompts=false",
    )
    return learner


def _add_bench_sync(benches) -> argparse.ArgumentParser:
    sync = benches.add_parser("sync", help="weight-sync bytes/s per transport against this host's memcpy")
    sync.add_argument("--models", default="smollm2-135m,random-500m")
    sync.add_argument("--transports", default="ray,shm,gloo")
    sync.add_argument("--ranks", default="1,2", help="learner ranks sending (each its own shards)")
    sync.add_argument("--bucket-mb", type=float, default=64.0)
    sync.add_argument("--repeats", type=int, default=5,
                      help="syncs per row, versions in turn through the same actors; the first is reported apart")
    sync.add_argument("--in-run-rounds", type=int, default=0,
                      help="> 0: also run the default recipe per transport, this many rounds, for the sync a step sees")
    sync.add_argument("--in-run-steps", type=int, default=6, help="training steps of each of those runs")
    return sync


def _add_bench_kernels(benches) -> argparse.ArgumentParser:
    kernels = benches.add_parser("kernels", help="fused (chunked) vs whole-logits log-probs: speed and peak memory")
    kernels.add_argument("--vocabs", default="49152,151936")
    kernels.add_argument("--tokens", default="1024,4096", help="tokens per call (sequence length x batch)")
    kernels.add_argument("--chunk", type=int, default=8192, help="vocabulary chunk of the fused path")
    kernels.add_argument("--repeats", type=int, default=1, help="timed runs after the first; the fastest counts")
    return kernels


def _add_bench_agreement(benches) -> argparse.ArgumentParser:
    agreement = benches.add_parser(
        "agreement", help="learner vs rollout log-probs: vLLM's model vs rlpipe's model inside vLLM, fp32 and bf16"
    )
    agreement.add_argument("--model", default="builtin:smollm2-135m-instruct", help="HF folder or builtin:NAME")
    agreement.add_argument("--impls", default="vllm,rlpipe")
    agreement.add_argument("--dtypes", default="float32,bfloat16")
    agreement.add_argument("--prompts", type=int, default=8)
    agreement.add_argument("--samples", type=int, default=4)
    agreement.add_argument("--max-tokens", type=int, default=64)
    return agreement


def _add_bench_e2e(benches) -> argparse.ArgumentParser:
    e2e = benches.add_parser(
        "e2e", help="one GRPO workload three ways: rlpipe synchronous, rlpipe one-step async, TRL's GRPOTrainer"
    )
    e2e.add_argument("--model", default="tiny", choices=["tiny", "smollm2-135m"])
    e2e.add_argument("--steps", type=int, default=4, help="GRPO steps of each system (the default recipe's workload)")
    e2e.add_argument("--threshold", type=float, default=0.2, help="report the timed seconds to this mean step reward")
    e2e.add_argument("--trl", default="hf",
                     help="TRL generation: hf, hf-cb, vllm-colocate, vllm-colocate-tf (comma list)")
    e2e.add_argument("--systems", default="rlpipe-sync,rlpipe-async,trl",
                     help="which systems to run (also rlpipe-xla: rlpipe-sync with its learner on torch_xla, "
                     ".venv-xla)")
    e2e.add_argument("--repeats", type=int, default=1, help="rounds of all systems; each system's fastest is reported")
    e2e.add_argument("--png", help="reward-per-step plot (default: next to --out, else bench-e2e-MODEL.png)")
    e2e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="change the workload (a config override every system is set up from); repeatable")
    return e2e


def _split(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def _bench_sync(args, parser) -> int:
    from rlpipe.bench.sync import SYNC_MODELS, SYNC_TRANSPORTS, bench_sync

    for option, values, known in (("--models", args.models, SYNC_MODELS),
                                  ("--transports", args.transports, SYNC_TRANSPORTS)):
        unknown = [value for value in _split(values) if value not in known]
        if unknown:
            parser.error(f"bench sync {option}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    bench_sync(_split(args.models), _split(args.transports), [int(r) for r in _split(args.ranks)], args.bucket_mb,
               args.repeats, args.out, args.in_run_rounds, args.in_run_steps)
    return 0


def _bench_agreement(args, parser) -> int:
    from rlpipe.bench.agreement import bench_agreement

    bench_agreement(args.model, _split(args.impls), _split(args.dtypes), args.prompts, args.samples,
                    args.max_tokens, args.out)
    return 0


def _bench_e2e(args, parser) -> int:
    from rlpipe.bench.e2e import TRL_GENERATION, bench_e2e

    unknown = [g for g in _split(args.trl) if g not in TRL_GENERATION]
    if unknown:
        parser.error(f"bench e2e --trl: unknown {', '.join(unknown)} (known: {', '.join(TRL_GENERATION)})")
    bench_e2e(args.model, args.steps, args.threshold, _split(args.trl), _split(args.systems), args.out, args.png,
              args.repeats, args.overrides)
    return 0


def _bench_kernels(args, parser) -> int:
    from rlpipe.bench.kernels import bench_kernels

    numbers = [int(item) for item in _split(args.vocabs)], [int(item) for item in _split(args.tokens)]
    bench_kernels(*numbers, args.chunk, args.repeats, args.out)
    return 0


def _bench_learner(args, parser) -> int:
    from rlpipe.bench.learner import PRESETS, LearnerBenchShape, bench_learner, unsupported_modes

    if args.preset is not None and args.preset not in PRESETS:
        parser.error(f"bench learner --preset: unknown {args.preset!r} (known: {', '.join(PRESETS)})")
    given = {key: getattr(args, key) for key in ("layers", "hidden", "seq", "batch") if getattr(args, key) is not None}
    shape = LearnerBenchShape(
        **{**PRESETS.get(args.preset, {}), **given}, steps=args.steps,
        experts=args.experts, top_k=args.top_k, expert_intermediate=args.expert_intermediate, group=args.group_size,
    )
    if args.group_size < 1 or shape.batch % args.group_size:
        parser.error(f"bench learner --group-size: must be >= 1 and divide --batch ({shape.batch})")
    if args.experts < 0:
        parser.error("bench learner --experts: must be >= 0")
    if args.experts and not 1 <= args.top_k <= args.experts:
        parser.error(f"bench learner --top-k: must be between 1 and --experts ({args.experts})")
    default_modes = "eager,graph" if args.device == "cuda" else "eager,graph,eager-m2,graph-m2"
    modes = (args.modes or ("eager+loop,eager,graph" if args.experts else default_modes)).split(",")
    if args.device == "cuda":
        import torch

        problem = unsupported_modes(modes, args.device)
        if problem:
            parser.error(f"bench learner --modes {problem}")
        if args.rounds > 1:
            parser.error("bench learner --rounds: on cuda the modes run one after another, in a process each")
        if not torch.cuda.is_available():
            parser.error("bench learner --device cuda: no CUDA GPU is visible to torch")
    bench_learner(shape, modes, args.out, rounds=max(1, args.rounds), device=args.device)
    return 0


_BENCHES = {"sync": _bench_sync, "agreement": _bench_agreement, "e2e": _bench_e2e, "kernels": _bench_kernels,
            "learner": _bench_learner}


def run_bench(args, parser) -> int:
    """Run the benchmark `args.what` names with its parsed options."""
    return _BENCHES[args.what](args, parser)
