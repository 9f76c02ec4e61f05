"""`rlpipe train | eval | config show | plan | submit | export | plot | bench`: runs take a recipe plus key=value
overrides."""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import signal
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from rlpipe.rewards import RewardConfigError, RewardFailure
from rlpipe.training.checkpoint import CheckpointError
from rlpipe.api import add_reward_search_path, train_with_restarts
from rlpipe.config import Config, ConfigError, help_text, load_config, recipes_dir

if TYPE_CHECKING:
    from rlpipe.run.progress import RunProgress

DEFAULT_RECIPE = recipes_dir() / "default.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpipe", description="GRPO post-training with Ray, vLLM and torch")
    parser.add_argument("--version", action="version", version=f"rlpipe {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    parser.run_commands = {}  # for `_parse_args`, which parses these on their own
    _add_run_commands(commands, parser.run_commands)
    _add_eval(commands, parser.run_commands)
    _add_submit(commands)
    _add_plot(commands)
    _add_export(commands)
    _add_bench(commands)
    return parser


def _add_run_commands(commands, run_commands: dict) -> None:
    """The commands that run a recipe with overrides: train, config, plan, rehearse."""
    for name, summary in (
        ("train", "run GRPO post-training"),
        ("config", "print the resolved config (`rlpipe config show [RECIPE] [key=value ...]`)"),
        (
            "plan",
            "per-chip memory of learner and rollout against the TPU slices' HBM, load and host-RAM peaks against "
            "the deploy manifests' pod limits (exit 1: does not fit)",
        ),
        (
            "rehearse",
            "run every start-up step of a TPU recipe that needs no chip, in a real start's order: the plan, the "
            "engines' config, the learner step compiled on fake TPU tensors, the kernels compiled for the chip "
            "(needs the tpu extra; exit 1 when a check fails)",
        ),
    ):
        sub = commands.add_parser(
            name,
            help=summary,
            description=summary,
            epilog=None,  # the config keys with the values this command line would use: set by `_parse_args`
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        run_commands[name] = sub
        if name == "config":
            sub.add_argument("action", choices=["show"])
        sub.add_argument("recipe", nargs="?", help=f"YAML recipe (default: {DEFAULT_RECIPE.name})")
        sub.add_argument("overrides", nargs="*", help="section.key=value overrides")
        if name == "rehearse":
            sub.add_argument("--json", metavar="PATH", help="also write every check, with what it measured, as JSON")
        if name == "train":
            sub.add_argument("--address", help="join this Ray cluster (same as ray.address=...)")
            sub.add_argument(
                "--verbose", action="store_true",
                help="also show vLLM, Ray and transformers INFO on the terminal; it is always in "
                "<run_dir>/logs/run.log (same as run.verbose=true)",
            )
            sub.add_argument(
                "--resume", nargs="?", const="latest", metavar="PATH",
                help="continue from this run's latest checkpoint, or from PATH (a checkpoint or run directory)",
            )
            sub.add_argument(
                "--auto-resume", action="store_true",
                help="when a worker dies for good (a learner rank, an engine past rollout.max_restarts), restart the "
                "run from its latest checkpoint, up to train.max_auto_resumes times",
            )


def _add_eval(commands, run_commands: dict) -> None:
    evaluate = commands.add_parser(
        "eval",
        help="evaluate saved weights on the held-out set (engines and reward workers only, no learner)",
        description="The held-out evaluation of a run (greedy accuracy; mean@k and pass@k with "
        "eval.samples_per_prompt=k) on the weights of PATH: a run directory (its latest checkpoint), a checkpoint "
        "directory or a Hugging Face folder (an export). A checkpoint is evaluated with its run's config, an HF "
        "folder with the recipe given (default: configs/default.yaml); overrides apply on top. Prints one line and "
        "writes eval.json into the checkpoint or HF folder (--out to change), its log beside it.",
        epilog=None,  # the config keys, as for train (`_parse_args`)
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_commands["eval"] = evaluate
    evaluate.add_argument("path", metavar="PATH",
                          help="a run directory, a checkpoint directory or a Hugging Face folder")
    evaluate.add_argument("recipe", nargs="?", help="YAML recipe (default: the checkpoint's config, else default.yaml)")
    evaluate.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    evaluate.add_argument("--out", metavar="FILE", help="where to write the figures (default: PATH's eval.json)")
    evaluate.add_argument("--verbose", action="store_true", help="also show vLLM, Ray and transformers INFO")


def _add_submit(commands) -> None:
    submit = commands.add_parser(
        "submit", help="run a recipe as a Ray job on a cluster and follow its logs (exit status: the job's)"
    )
    submit.add_argument("--address", required=True, help="the cluster's dashboard URL, e.g. http://HEAD:8265")
    submit.add_argument("--working-dir", default=".", help="uploaded as the job's code (default: here)")
    submit.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="job environment variable")
    submit.add_argument("--runtime-env", help="a Ray runtime-env YAML to start from (e.g. deploy/runtime_env.yaml)")
    submit.add_argument("--no-wait", action="store_true", help="return once the job is submitted")
    submit.add_argument("recipe", help="YAML recipe inside the working directory")
    submit.add_argument("overrides", nargs="*", help="section.key=value overrides")


def _add_plot(commands) -> None:
    plot = commands.add_parser(
        "plot",
        help="draw a run's curves from its metrics.jsonl (to RUN_DIR/curves.png), or several runs overlaid (-o)",
        description="Reward (mean, +-1 std band, smoothed), held-out accuracy (mean@k, pass@k) at every evaluation, "
        "loss, gradient norm, response length, entropy, KL, the learner-vs-rollout log-prob gap and step time by "
        "phase, from each run's metrics.jsonl and summary.json; panels whose metrics a run did not log are left out.",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory (the one holding metrics.jsonl)")
    plot.add_argument("-o", "--out", help="the image to write (.png, .svg, .pdf ...); default RUN_DIR/curves.png "
                      "for one run, required for several")
    plot.add_argument("--smooth", type=float, default=None, metavar="W",
                      help="weight of the moving average over steps, in [0, 1) (default 0.6; 0: raw values only)")


def _add_export(commands) -> None:
    export = commands.add_parser(
        "export", help="write a checkpoint's weights as a Hugging Face folder with a model card (README.md; LoRA "
        "adapters: a PEFT adapter folder)"
    )
    export.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its latest checkpoint)")
    export.add_argument("out_dir", help="the folder to create (never overwritten)")
    export.add_argument(
        "--push-to-hub", metavar="ORG/NAME",
        help="then upload the folder to this Hugging Face Hub model repository (token: HF_TOKEN or `hf auth login`; "
        "endpoint: HF_ENDPOINT)",
    )
    export.add_argument("--private", action="store_true", help="create the --push-to-hub repository as private")
    export.add_argument("--merge", action="store_true",
                        help="for LoRA adapters: the base with them merged in, instead of a PEFT adapter folder")


def _add_bench(commands) -> None:
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
        "--preset", help="a released model's shape with random weights: qwen3-0.6b (28 x 1024, 2048-token rows)"
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


def _refused(err: Exception, status: int, what: str = "") -> int:
    """One line on stderr for the error that ends the command (`what` before it), and the command's exit status."""
    print(f"rlpipe: {what}{err}", file=sys.stderr)
    return status


def _version() -> str:
    try:
        return metadata.version("rlpipe")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
        return "unknown (not installed; pip install -e . records it)"


def _recipe_and_overrides(args) -> tuple[str | None, list[str]]:
    recipe, overrides = args.recipe, list(args.overrides)
    # `rlpipe train train.steps=3`: the first positional is an override, not a recipe.
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        recipe, overrides = None, [recipe, *overrides]
    if getattr(args, "address", None):
        overrides.append(f"ray.address={args.address}")
    if getattr(args, "verbose", False):
        overrides.append("run.verbose=true")
    return recipe, overrides


def _resolve(args) -> Config:
    recipe, overrides = _recipe_and_overrides(args)
    _search_beside(recipe)
    return load_config(recipe or DEFAULT_RECIPE, overrides)


def _search_beside(recipe: str | None) -> None:
    """A reward module beside the recipe or in the current directory imports in every process of the run, without
    PYTHONPATH."""
    from rlpipe.config import find_recipe

    add_reward_search_path(*([str(find_recipe(recipe).resolve().parent)] if recipe else []), str(Path.cwd()))


def _export(args) -> int:
    """`rlpipe export CHECKPOINT OUT_DIR [--push-to-hub ORG/NAME [--private]]`: the folder with its model card,
    then the push."""
    from rlpipe.training.checkpoint import export
    from rlpipe.run.hub_push import HubPushError, check_can_push, checkpoint_card_inputs, push_folder, write_model_card

    try:
        if args.push_to_hub:
            check_can_push(args.push_to_hub, "--push-to-hub")
        config, summary = checkpoint_card_inputs(args.checkpoint)
        folder = export(args.checkpoint, args.out_dir, merge=args.merge)
        write_model_card(folder, config, summary)
        print(f"exported to {folder}")
    except (CheckpointError, HubPushError) as err:
        return _refused(err, 2)
    if args.push_to_hub:
        try:
            print(f"pushed to {push_folder(folder, args.push_to_hub, args.private)}")
        except HubPushError as err:
            return _refused(err, 1)
    return 0


def _is_help(arg: str) -> bool:
    return arg == "-h" or (len(arg) > 2 and "--help".startswith(arg))  # argparse takes --he for --help


def _config_help(sub: argparse.ArgumentParser, command: str, rest: list[str]) -> str:
    """The config keys for `rlpipe COMMAND ... --help`, each with the value this command line would run with: the
    recipe it names (else the default recipe) with its overrides applied, and rlpipe's built-in default for keys
    neither sets. A command line that does not resolve shows the built-in defaults and says why."""
    args = None
    with contextlib.suppress(SystemExit), contextlib.redirect_stderr(io.StringIO()):  # no usage error before help
        args = sub.parse_intermixed_args([a for a in rest if not _is_help(a)], argparse.Namespace(command=command))
    recipe, overrides = _recipe_and_overrides(args) if args is not None else (None, [])
    shown = recipe or f"{DEFAULT_RECIPE.parent.name}/{DEFAULT_RECIPE.name}"
    source = f"{shown} with the overrides given" if overrides else shown
    try:
        return help_text(load_config(recipe or DEFAULT_RECIPE, overrides), source)
    except ConfigError as err:
        return help_text(source=f"the built-in defaults, not those of {source} ({err})")


def _parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`train`, `config` and `plan` take options and overrides in any order (`rlpipe train RECIPE --resume latest
    key=value` as well as `rlpipe train RECIPE key=value --resume latest`): argparse's one pass reads the positionals
    in one run, so overrides after an option would be left over."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in parser.run_commands:
        return parser.parse_args(argv)
    if any(_is_help(arg) for arg in argv[1:]):
        sub = parser.run_commands[argv[0]]
        sub.epilog = _config_help(sub, argv[0], argv[1:])
    args = parser.run_commands[argv[0]].parse_intermixed_args(argv[1:], argparse.Namespace(command=argv[0]))
    resume = getattr(args, "resume", None)
    if resume and "=" in resume and not Path(resume).exists():  # `--resume key=value`: latest, then an override
        args.overrides.insert(0, resume)  # where it stood on the command line: before the later overrides
        args.resume = "latest"
    return args


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


BENCHES = {"sync": _bench_sync, "agreement": _bench_agreement, "e2e": _bench_e2e, "kernels": _bench_kernels,
           "learner": _bench_learner}


def _submit(args, parser) -> int:
    from rlpipe.run.submit import SubmitError, submit

    try:
        return submit(args.address, args.recipe, list(args.overrides), args.working_dir, args.env,
                      args.runtime_env, follow=not args.no_wait)
    except ConfigError as err:
        return _refused(err, 2, "config error: ")
    except SubmitError as err:
        return _refused(err, 2)


def _plot(args, parser) -> int:
    from rlpipe.reporting.plots import SMOOTHING, PlotError, plot_runs

    try:
        written = plot_runs(args.run_dirs, args.out, SMOOTHING if args.smooth is None else args.smooth)
    except PlotError as err:
        return _refused(err, 2, "plot: ")
    print(f"curves written to {written}")
    return 0


def _eval(args, parser) -> int:
    from rlpipe.actors.calls import WorkerLost

    try:
        return evaluate_saved_weights(args)
    except (ConfigError, RewardConfigError) as err:
        return _refused(err, 2, "config error: ")
    except CheckpointError as err:
        return _refused(err, 2, "eval: ")
    except WorkerLost as err:
        return _refused(err, 1)


def _run_recipe(args, parser) -> int:
    """train, config, plan and rehearse: the recipe resolved with its overrides, then the command."""
    try:
        cfg = _resolve(args)
        if args.command == "config":
            import yaml

            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        if args.command == "rehearse":
            from rlpipe.tpu.rehearse import rehearse_command

            return rehearse_command(cfg, args.json)
        if args.command == "plan":
            from rlpipe.plan import format_plan, plan

            result = plan(cfg)
            print(format_plan(result))
            return 0 if result.ok else 1
        return _train(cfg, args)
    except (ConfigError, RewardConfigError) as err:
        return _refused(err, 2, "config error: ")
    except CheckpointError as err:
        return _refused(err, 2)


def _train(cfg: Config, args) -> int:
    from rlpipe.actors.calls import WorkerLost
    from rlpipe.run.hub_push import HubPushError, after_run, check_can_push
    from rlpipe.run.progress import RunProgress
    from rlpipe.weightsync import NonFiniteWeights

    try:
        if cfg.metrics.push_to_hub:
            check_can_push(cfg.metrics.push_to_hub, "metrics.push_to_hub")
    except HubPushError as err:
        return _refused(err, 2, "config error: ")
    progress = RunProgress()
    # A run that stops mid-way says in one line where, what it lost since its last checkpoint (the checkpoints
    # written stay) and the command that continues it; the traceback is in its run.log.
    try:
        with _sigterm_as_interrupt():
            summary = train_with_restarts(cfg, args.resume, args.auto_resume, progress)
            after_run(cfg, summary)
    except KeyboardInterrupt as err:
        reason, status = _interruption(err)
        print(_stop_line(reason, progress, args), file=sys.stderr)
        return status
    except WorkerLost as err:
        print(_stop_line(str(err), progress, args), file=sys.stderr)
        return 1
    except RewardFailure as err:
        print(_stop_line(str(err), progress, args, when=" once the function is fixed"), file=sys.stderr)
        return 1
    except NonFiniteWeights as err:  # not a lost worker: a restart from the last checkpoint would diverge again
        print(_stop_line(str(err), progress, args, when=" with a change that keeps it from diverging"),
              file=sys.stderr)
        return 1
    except CheckpointError as err:
        if progress.run_dir is None:  # the checkpoint to resume from, refused before the run started
            raise
        print(_stop_line(str(err), progress, args), file=sys.stderr)  # a save that failed: a full disk
        return 2
    except HubPushError as err:  # after the run: its checkpoints and export are complete
        return _refused(err, 1)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where Ctrl-C raises KeyboardInterrupt: the run stops the same way."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (`kill`, a job scheduler, `ray job stop`) ends the run as Ctrl-C does: roles shut down, one line."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _interruption(err: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the run, and the exit status shells give a process that signal ended (128 + its number)."""
    if isinstance(err, Terminated):
        return "terminated (SIGTERM)", 128 + signal.SIGTERM
    return "interrupted (Ctrl-C)", 128 + signal.SIGINT


def _stop_line(reason: str, progress: RunProgress, args, when: str = "") -> str:
    """The one line of a run that stopped: why, the step it reached, its last checkpoint, the steps lost since, and
    the command that continues it (`when`: what to do before)."""
    if progress.run_dir is None:
        return f"rlpipe: {reason}; {progress.where()}"
    return f"rlpipe: {reason}; {progress.where()}; {_continue_command(progress, args, when)}"


def _continue_command(progress: RunProgress, args, when: str) -> str:
    """The command line that continues the run, as its own was typed (recipe, overrides, options): with `--resume`
    (the run's latest checkpoint, or the path of another run's it branched off and has not saved past), or without a
    checkpoint the same command again."""
    words = ["rlpipe", "train", *([args.recipe] if args.recipe else []), *args.overrides]
    if args.address:
        words += ["--address", args.address]
    words += [flag for flag, given in (("--verbose", args.verbose), ("--auto-resume", args.auto_resume)) if given]
    if progress.own_checkpoint():
        return f"resume{when}: {shlex.join([*words, '--resume'])}"
    if progress.checkpoint is not None:
        return f"resume{when}: {shlex.join([*words, '--resume', str(progress.checkpoint)])}"
    if progress.must_overwrite() and "run.overwrite=true" not in words:  # its logged steps would refuse a new run
        words.append("run.overwrite=true")
    return f"start again{when}: {shlex.join(words)}"


COMMANDS = {"submit": _submit, "plot": _plot, "export": lambda args, parser: _export(args), "eval": _eval,
            "bench": lambda args, parser: BENCHES[args.what](args, parser)}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = _parse_args(parser, argv)
    return COMMANDS.get(args.command, _run_recipe)(args, parser)


def evaluate_saved_weights(args) -> int:
    """`rlpipe eval PATH [RECIPE] [key=value ...]`: the held-out evaluation of a run (rlpipe/run/evaluation.py) on saved
    weights, by engines and reward workers alone. Every input is checked before Ray starts; a checkpoint is exported
    to a temporary HF folder first, which the engines load."""
    import json
    import tempfile
    from types import SimpleNamespace

    import yaml

    from rlpipe.training import checkpoint
    from rlpipe.run import evaluation
    from rlpipe.startup import preflight
    from rlpipe.run.controller import reward_state
    from rlpipe.data.prompts import PromptSet, load_rows, reward_columns
    from rlpipe.reporting.logs import LogSetup
    from rlpipe.rewards.contract import EPISODE_COLUMNS

    weights = Path(args.path)
    if not weights.exists():
        raise CheckpointError(f"{weights}: no such file or directory")
    recipe, overrides = _recipe_and_overrides(args)
    _search_beside(recipe)
    hf_folder = (weights / "config.json").is_file()
    if hf_folder:
        source, step = weights, 0  # an export's step is not recorded: seeded as the evaluation before training
        cfg = load_config(recipe or DEFAULT_RECIPE, overrides)
    else:
        try:
            source = checkpoint.resolve(weights)
        except CheckpointError as err:
            raise CheckpointError(f"{weights}: not a Hugging Face folder (no config.json), nor a run or checkpoint "
                                  f"directory ({err})") from None
        trainer = checkpoint.read_trainer_state(source, needs=checkpoint.EXPORT_FIELDS)
        step = int(trainer.get("step", 0))
        if recipe:
            cfg = load_config(recipe, overrides)
        else:  # the run's own config, as the checkpoint records it
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="rlpipe-eval-") as recorded:
                yaml.safe_dump(trainer["config"], recorded, sort_keys=False)
                recorded.flush()
                cfg = load_config(recorded.name, overrides)
    out = Path(args.out) if args.out else source / "eval.json"
    if not out.parent.is_dir():
        raise ConfigError(f"--out: folder {out.parent} does not exist")
    with tempfile.TemporaryDirectory(prefix="rlpipe-eval-") as scratch:
        if hf_folder:
            model_path = str(weights.resolve())
        else:  # the engines load HF folders: the checkpoint's weights as one (its tokenizer included)
            model_path = str(checkpoint.export(source, Path(scratch) / "model", merge=True))  # LoRA: merged
            cfg.model.tokenizer = None
        cfg.model.path = model_path
        preflight.check_model(model_path)
        tokenizer_path, tokenizer = preflight.check_tokenizer(cfg.model, model_path)
        train_rows, eval_rows = load_rows(cfg.data, cfg.run.seed)
        if not eval_rows:
            raise ConfigError("data.eval_size: no held-out prompts to evaluate (set data.eval_size above 0)")
        columns = reward_columns(train_rows, cfg.data.prompt_field)
        if cfg.rollout.environment_factory:  # as in training: reward functions also get the episodes' environments
            columns = [*columns, *EPISODE_COLUMNS]
        preflight.check_reward_functions(cfg.reward, columns)
        preflight.check_rollout_tools(cfg.rollout)
        eval_set = PromptSet(eval_rows, tokenizer, cfg.data, id_offset=len(train_rows),
                             max_prompt_tokens=cfg.max_prompt_tokens)
        if cfg.data.overlong == "drop":  # the prompts the run itself evaluated
            eval_set.drop_overlong()
        preflight.check_prompts(eval_set)
        point = _evaluate_on_engines(cfg, model_path, tokenizer_path, columns, eval_set, step,
                                     reward_state(cfg, SimpleNamespace(train_set=train_rows), step, "eval"),
                                     LogSetup(str(out.with_suffix(".log")), verbose=cfg.run.verbose))
    record = {"path": str(weights), "weights": str(source), "step": step, "prompts": len(eval_set), **point}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"held-out accuracy of {weights} (step {step}, {len(eval_set)} prompts): {evaluation.describe(point)}; "
          f"written to {out}")
    return 0


def _evaluate_on_engines(cfg: Config, model_path: str, tokenizer_path: str | None, columns: list[str], eval_set,
                         step: int, state, logs) -> dict:
    """Start Ray (or join `ray.address`), the engines on `model_path` and the reward workers; evaluate; stop them."""
    from rlpipe.run import evaluation
    from rlpipe.actors.cluster import start_ray
    from rlpipe.actors.eval_roles import EvalRoles
    from rlpipe.reporting.logs import driver_logging

    with driver_logging(logs):
        start_ray(cfg)
        roles = EvalRoles(cfg, model_path, tokenizer_path, columns, log=logs)
        try:
            return evaluation.evaluate(roles, eval_set, cfg, step, state)
        finally:
            roles.shutdown()


if __name__ == "__main__":
    sys.exit(main())
