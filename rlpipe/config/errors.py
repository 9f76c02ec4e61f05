"""How a bad config is reported: one line that names the key to change."""

from __future__ import annotations

import re


class ConfigError(ValueError):
    """A bad config: the message is one line and names the key."""


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless `ok`: each section's checks are a list of these, one per rule."""
    if not ok:
        raise ConfigError(message)


def one_line(err: BaseException) -> str:
    """An error's message on one line, whatever a library wrote (its type name when it has no message)."""
    return " ".join(str(err).split()) or type(err).__name__


def first_line(err: BaseException) -> str:
    """The first line of an error's message: where a multi-line report (Ray's, for a dead actor) says what happened."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the actor's name in its reports


def report_line(text: str) -> str:
    """An error report (a message and the traceback that came with it) as one line that says what went wrong: its
    first line, and where a traceback follows, the exception that traceback ends with, about which the first line is
    often silent (Ray's report of an actor whose start failed names only the actor; its process ids are left out).
    A message that names its error on its second line (pydantic's "1 validation error for X") keeps that line."""
    lines = [line.rstrip() for line in _ANSI.sub("", text).splitlines()]
    first = next((line.strip() for line in lines if line.strip()), "").split(" (pid=", 1)[0]
    frames = [index for index, line in enumerate(lines) if line.lstrip().startswith('File "')]
    after = lines[frames[-1] + 1:] if frames else []
    # After the last frame, its source line and carets are indented; the exception starts at the margin.
    start = next((index for index, line in enumerate(after) if line and not line[0].isspace()), None)
    if start is None:
        return first
    raised = after[start].strip()
    detail = after[start + 1] if start + 1 < len(after) else ""
    if detail[:1].isspace() and detail.strip() and not detail.strip().startswith("For further information"):
        raised = f"{raised}: {detail.strip().split(' [type=', 1)[0]}"  # pydantic's input echo can be long
    return raised if first.startswith("Traceback") or raised.startswith(first) else f"{first}: {raised}"


def error_line(err: BaseException) -> str:
    """`report_line` of an error's message (its type name when it has none)."""
    return report_line(str(err)) or type(err).__name__
