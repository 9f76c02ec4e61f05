"""What reaches the terminal and what goes to the run's log file (rlpipe/reporting/logs.py), the live status line and the start-up
and final lines (rlpipe/reporting/metrics.py)."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlpipe.reporting.logs import (
    KNOWN_HARMLESS,
    PROGRESS_LOGGER,
    RELOAD_LOGGER,
    RELOAD_MESSAGE,
    KnownHarmless,
    LogSetup,
    driver_logging,
    logging_config,
)
from rlpipe.reporting.metrics import LiveStatus, MetricsLogger, roles_summary

REPO = Path(__file__).resolve().parents[2]


def _record(logger: str, message: str, *args, level: int = logging.WARNING) -> logging.LogRecord:
    """A record as `logging.getLogger(logger).log(level, message, *args)` makes it."""
    return logging.getLogger(logger).makeRecord(logger, level, "layerwise.py", 266, message, args, None)


def test_the_reload_warning_is_dropped_for_the_layers_that_never_receive_weights_only():
    quiet, quiet_tied = KnownHarmless(), KnownHarmless(tied_output_layer=True)
    for layer in ("RotaryEmbedding", "Llama3RotaryEmbedding"):  # a computed cache, in no checkpoint
        assert not quiet.filter(_record(RELOAD_LOGGER, RELOAD_MESSAGE, layer))
    # The output layer: re-derived from the embedding when tied, a weight the update missed otherwise.
    assert not quiet_tied.filter(_record(RELOAD_LOGGER, RELOAD_MESSAGE, "ParallelLMHead"))
    assert quiet.filter(_record(RELOAD_LOGGER, RELOAD_MESSAGE, "ParallelLMHead"))
    for layer in ("QKVParallelLinear", "VocabParallelEmbedding", "FusedMoE", "RMSNorm"):
        assert quiet_tied.filter(_record(RELOAD_LOGGER, RELOAD_MESSAGE, layer))
    # The same words at ERROR, or from another logger, are something else.
    assert quiet_tied.filter(_record(RELOAD_LOGGER, RELOAD_MESSAGE, "RotaryEmbedding", level=logging.ERROR))
    assert quiet_tied.filter(_record("vllm.other", RELOAD_MESSAGE, "RotaryEmbedding"))
    assert quiet_tied.filter(_record(RELOAD_LOGGER, "%s: Delayed processing", "RotaryEmbedding"))


def test_every_other_known_harmless_warning_is_matched_by_its_logger_and_message_start():
    quiet = KnownHarmless()
    for logger, start in KNOWN_HARMLESS:
        assert not quiet.filter(_record(logger, start + " and the rest of the message"))
        assert quiet.filter(_record(logger, start, level=logging.ERROR))
        assert quiet.filter(_record(logger + ".elsewhere", start))
    assert quiet.filter(_record("vllm.platforms.cpu", "Node %s is not in available memory nodes %s.", 0, [1]))
    # Ray's warning that token authentication is *off* is not harmless.
    assert quiet.filter(_record("ray._private.authentication.authentication_token_setup",
                                "Token authentication is disabled for this Ray cluster. Anyone with network access"))


def _source_text(module: str) -> str:
    """A module's source with adjacent string literals joined, found without importing it."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    path = Path(spec.submodule_search_locations[0]).joinpath(*rest).with_suffix(".py")
    return re.sub(r'"\s*\n\s*(f?)"', "", path.read_text())


@pytest.mark.parametrize("logger,start", KNOWN_HARMLESS + [(RELOAD_LOGGER, RELOAD_MESSAGE)])
def test_each_known_harmless_warning_is_written_so_by_the_installed_package(logger, start):
    """The filter matches the installed vLLM and Ray word for word: a message they reword would be shown again."""
    assert start in _source_text(logger)


def _run_worker(tmp_path, verbose: bool) -> tuple[str, str]:
    """configure_worker in a process of its own (it configures the process's logging), then a few records."""
    log_file = tmp_path / "logs" / "run.log"
    script = textwrap.dedent(f"""
        import logging, warnings
        from rlpipe.reporting.logs import LogSetup, configure_worker
        configure_worker(LogSetup({str(log_file)!r}, verbose={verbose}, who="rollout-0"), vllm=True)
        engine = logging.getLogger("vllm.v1.engine.core")
        engine.info("INFO from the engine")
        engine.error("ERROR from the engine")
        try:
            raise RuntimeError("the engine core died")
        except RuntimeError:
            engine.exception("EngineCore failed\\nsecond line")
        logging.getLogger("rlpipe.rollout.engine").error("FILE-ONLY line", extra={{"rlpipe_file_only": True}})
        logging.getLogger("vllm.config.vllm").warning("Enforce eager set, disabling torch.compile, CUDAGraphs")
        logging.getLogger("transformers.configuration_utils").info("INFO from transformers")
        warnings.warn("a Python warning")
        import os; print("CONFIG", os.environ["VLLM_LOGGING_CONFIG_PATH"])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    config_path = done.stdout.split("CONFIG ", 1)[1].strip()
    assert json.loads(Path(config_path).read_text())["handlers"]["file"]["filename"] == str(log_file)
    return done.stderr, log_file.read_text()


def test_an_actor_logs_info_to_the_file_and_warnings_to_stderr(tmp_path):
    terminal, log = _run_worker(tmp_path, verbose=False)
    assert "ERROR vllm.v1.engine.core: ERROR from the engine" in terminal
    assert "a Python warning" in terminal
    assert "INFO" not in terminal and "Enforce eager" not in terminal
    # An error with a traceback is one line on the terminal, naming the exception; the log file has all of it.
    assert "ERROR vllm.v1.engine.core: EngineCore failed: RuntimeError: the engine core died\n" in terminal
    assert "Traceback" not in terminal and "second line" not in terminal and "FILE-ONLY" not in terminal
    assert "RuntimeError: the engine core died" in log and "second line" in log and "FILE-ONLY line" in log
    for line in ("rollout-0 INFO vllm.v1.engine.core: INFO from the engine", "rollout-0 ERROR vllm.v1.engine.core: ERROR",
                 "rollout-0 WARNING vllm.config.vllm: Enforce eager", "rollout-0 INFO transformers.configuration_utils",
                 "a Python warning"):
        assert line in log


def test_verbose_puts_info_and_every_warning_back_on_stderr(tmp_path):
    terminal, log = _run_worker(tmp_path, verbose=True)
    for line in ("INFO vllm.v1.engine.core: INFO from the engine", "ERROR vllm.v1.engine.core: ERROR from the engine",
                 "WARNING vllm.config.vllm: Enforce eager", "INFO transformers.configuration_utils"):
        assert line in terminal
    assert "INFO from the engine" in log


def test_the_logging_config_handed_to_vllm_is_json_and_names_the_filter():
    config = logging_config(LogSetup("/run/logs/run.log", who="rollout-1", tied_output_layer=True))
    assert json.loads(json.dumps(config)) == config  # vLLM reads it from a JSON file (VLLM_LOGGING_CONFIG_PATH)
    assert config["filters"]["known_harmless"] == {"()": "rlpipe.reporting.logs.KnownHarmless", "tied_output_layer": True}
    assert config["handlers"]["console"]["level"] == "WARNING"
    assert "rollout-1" in config["formatters"]["file"]["format"]


@pytest.mark.parametrize("verbose", [False, True])
def test_the_driver_logs_to_the_file_and_puts_its_loggers_back(tmp_path, capsys, verbose):
    root, ray_logger = logging.getLogger(), logging.getLogger("ray")
    before = (list(root.handlers), root.level, list(ray_logger.handlers), ray_logger.propagate, ray_logger.level)
    log_file = tmp_path / "logs" / "run.log"
    with driver_logging(LogSetup(str(log_file), verbose=verbose)):
        logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
        logging.getLogger("ray._private.authentication.authentication_token_setup").warning(
            "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logging.getLogger("ray.worker").error("a real problem")
        logging.getLogger(PROGRESS_LOGGER).info("step 1/2 | reward 0.5")
    terminal, log = capsys.readouterr().err, log_file.read_text()
    assert "ERROR ray.worker: a real problem" in terminal
    assert "step 1/2" not in terminal  # printed by MetricsLogger itself
    assert ("Started a local Ray instance" in terminal) == verbose
    assert ("Token authentication is enabled" in terminal) == verbose
    for line in ("driver INFO ray._private.worker: Started a local Ray instance.", "Token authentication is enabled",
                 "driver INFO rlpipe.progress: step 1/2 | reward 0.5", "a real problem"):
        assert line in log
    assert (list(root.handlers), root.level, list(ray_logger.handlers), ray_logger.propagate, ray_logger.level) == before


def test_train_verbose_sets_run_verbose():
    from rlpipe.cli import _parse_args, _parser, _resolve

    assert _resolve(_parse_args(_parser(), ["train", "train.steps=3", "--verbose"])).run.verbose is True
    assert _resolve(_parse_args(_parser(), ["train", "train.steps=3"])).run.verbose is False


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_status_line_off_a_terminal_is_a_line_every_so_often():
    out = io.StringIO()
    status = LiveStatus(out, every_s=0.1, tick_s=0.02)
    with status.phase("step 1/2: generating"):
        time.sleep(0.35)
    lines = out.getvalue().splitlines()
    assert 2 <= len(lines) <= 4 and all(re.fullmatch(r"\.\.\. step 1/2: generating \(0 s\)", line) for line in lines)
    time.sleep(0.15)
    assert out.getvalue().splitlines() == lines  # nothing after the phase


def test_the_status_line_on_a_terminal_is_redrawn_and_erased_and_other_output_erases_it_first():
    out = _Terminal()
    status = LiveStatus(out, delay_s=0.0, tick_s=0.02)
    stdout = sys.stdout
    with status.phase("held-out evaluation"):
        time.sleep(0.1)
        print("a warning forwarded from an actor")
        time.sleep(0.1)
    assert sys.stdout is stdout
    text = out.getvalue()
    assert re.search(r"[|/\\-] held-out evaluation \(0 s\)", text)
    assert text.endswith("\r\033[K")
    status.write("step 1/2 | reward 0.5\n")
    assert out.getvalue().endswith("\r\033[Kstep 1/2 | reward 0.5\n")  # the status line was not left in front of it


def test_a_terminal_line_is_copied_to_the_log_file(tmp_path, caplog):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=2, stream=out)
    with caplog.at_level(logging.INFO, logger=PROGRESS_LOGGER):
        logger.note("held-out accuracy before training: 0.5")
        logger.log(1, {"reward/mean": 0.25})
    assert out.getvalue().splitlines()[0] == "held-out accuracy before training: 0.5"
    assert [r.getMessage() for r in caplog.records] == out.getvalue().splitlines()
    line = logger.final_line(90.0, tmp_path / "logs" / "run.log")
    assert line.startswith("done in 1.5 min; step reward 0.250 at the first step, 0.250 at the last; outputs in ")
    assert line.endswith(f"full log in {tmp_path / 'logs' / 'run.log'}")


def test_the_start_up_line_says_what_runs_where():
    from rlpipe.config import load_config

    cfg = load_config(None, ["learner.ranks=2", "rollout.num_engines=2", "rollout.tensor_parallel=2"])
    one = {"learner": ["a" * 56] * 2, "rollout": ["a" * 56] * 2, "reward": ["a" * 56]}
    assert roles_summary(cfg, one, "/r/logs/run.log") == (
        "roles: learner 2 ranks (cpu, eager, float32), rollout 2 engines (vLLM, float32, tensor-parallel 2), "
        "reward 1 worker; on one node. Full log: /r/logs/run.log"
    )
    two = {"learner": ["1" * 56, "1" * 56], "rollout": ["2" * 56, "1" * 56], "reward": ["1" * 56]}
    assert "; on 2 nodes (learner: 11111111; rollout: 11111111, 22222222; reward: 11111111)." in roles_summary(
        cfg, two, "/r/logs/run.log"
    )


# Ray's report of an actor whose start raised an error Ray could not pickle: a header naming the actor (coloured, with
# its process's ids), the traceback, and pydantic's message, which names the error on its second line.
ACTOR_START_REPORT = """The actor died because of an error raised in its creation task, \x1b[36mray::RolloutActor.__init__()\x1b[39m \
(pid=24525, ip=127.0.0.1, actor_id=1419a4, repr=<rlpipe.actors.rollout.RolloutActor object at 0x7f9e40b455d0>)
  File "/work/rlpipe/actors/rollout.py", line 154, in __init__
    self.engine = RolloutEngine(
                  ^^^^^^^^^^^^^^
  File "/site-packages/vllm/engine/arg_utils.py", line 1813, in create_model_config
    return ModelConfig(
           ^^^^^^^^^^^^
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (1024) is greater than the derived max_model_len. [type=value_error, \
input_value=ArgsKwargs((), {'model': '/tmp/m'}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error"""


def test_a_report_with_a_traceback_is_one_line_naming_the_exception_it_ends_with():
    from rlpipe.config import report_line

    assert report_line(ACTOR_START_REPORT) == (
        "The actor died because of an error raised in its creation task, ray::RolloutActor.__init__(): "
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: Value error, "
        "User-specified max_model_len (1024) is greater than the derived max_model_len."
    )
    chained = ('Traceback (most recent call last):\n  File "a.py", line 1, in f\n    g()\nKeyError: 0\n\nDuring '
               'handling of the above exception, another exception occurred:\n\nTraceback (most recent call last):\n'
               '  File "a.py", line 3, in f\n    raise ValueError("no row 0")\nValueError: no row 0')
    assert report_line(chained) == "ValueError: no row 0"
    assert report_line("a sync failed\nits second line") == "a sync failed"
    assert report_line("") == ""
