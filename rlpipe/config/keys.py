"""How a config key is declared: a dataclass field with a default and a one-line meaning (`help` metadata), so that
`rlpipe train --help` can list every key and an error can always name the key at fault."""

from __future__ import annotations

import copy
from dataclasses import field
from typing import Any


def key(default: Any, help: str) -> Any:
    """A key of a section: `default`, copied for each instance when it is a list or a mapping."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})
