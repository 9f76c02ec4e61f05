"""How a bad config is reported: one line that names the key to change."""

from __future__ import annotations


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
