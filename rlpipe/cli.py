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
from rlpipe.bench.commands import add_bench, run_bench
from rlpipe.config import Config, ConfigError, default_recipe, help_text, load_config

if TYPE_CHECKING:
    from rlpipe.run.progress import RunProgress

DEFAULT_RECIPE = default_recipe()


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
    add_bench(commands)
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
    from rlpipe.run.saved_weights import evaluate_saved_weights

    recipe, overrides = _recipe_and_overrides(args)
    try:
        _search_beside(recipe)
        return evaluate_saved_weights(args.path, recipe, overrides, args.out)
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
            "bench": run_bench}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = _parse_args(parser, argv)
    return COMMANDS.get(args.command, _run_recipe)(args, parser)


if __name__ == "__main__":
    sys.exit(main())
