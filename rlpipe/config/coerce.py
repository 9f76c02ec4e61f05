"""Typed sections from what a recipe and overrides hold: each value checked against its field's type hint and
converted only where YAML is ambiguous, each error one line naming the key.

Hand-written on purpose: pydantic's lax mode converts what rlpipe refuses (`true` or `2.0` to an int, `"yes"` to a
bool), its strict mode refuses what rlpipe converts (`1e-3`, which YAML 1.1 reads as text, to a float), and either
way its errors would have to be rewritten into these one-line messages."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from rlpipe.config.errors import ConfigError
from rlpipe.config.yaml_bounds import YamlBoundError, safe_load


@dataclass(frozen=True)
class OverrideText:
    """An override's right-hand side, parsed only once the field's type is known."""

    text: str

    def resolve(self, hint: Any, key: str) -> Any:
        # Text keys take the text as typed: `data.system_prompt=Answer: 42` or `run.name=001` must not
        # become a mapping or an integer, and `#` must not start a YAML comment there.
        if _accepts_text(hint) and self.text not in ("null", "~"):
            return self.text
        try:
            return safe_load(self.text) if self.text != "" else ""
        except yaml.YAMLError:
            return self.text
        except YamlBoundError as err:
            raise ConfigError(f"{key}: {err}") from None
        except RecursionError:  # the parser recurses once per level
            raise ConfigError(f"{key}: nests deeper than YAML's reader can follow") from None


def _accepts_text(hint: Any) -> bool:
    if hint is str:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_accepts_text(arg) for arg in typing.get_args(hint))
    return False


def build(cls, data: Any, prefix: str = ""):
    """An instance of the section `cls` from a mapping (None: a section written with no keys under it)."""
    if isinstance(data, cls):
        return data
    if isinstance(data, OverrideText):
        data = data.resolve(cls, prefix or "config")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for name in data:
        if name not in names:
            where = f"{prefix}.{name}" if prefix else str(name)
            raise ConfigError(f"{where}: unknown key (known: {', '.join(sorted(names))})")
    values = {}
    for name, value in data.items():
        where = f"{prefix}.{name}" if prefix else name
        values[name] = coerce(value, hints[name], where)
    return cls(**values)


def coerce(value: Any, hint: Any, key: str) -> Any:
    """`value` as a field of type `hint` takes it, or a ConfigError naming `key`."""
    if isinstance(value, OverrideText):
        value = value.resolve(hint, key)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _one_of(value, args, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = args or (Any,)
        return [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint not in _SCALARS:
        raise ConfigError(f"{key}: unsupported config type {hint!r}")
    return _SCALARS[hint](value, key)


def _one_of(value: Any, args: tuple, key: str) -> Any:
    """A union's value: None where the union allows it, else the first member type that takes it (the first
    member's error when none does)."""
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in (a for a in args if a is not type(None)):
        try:
            return coerce(value, arg, key)
        except ConfigError as err:
            errors.append(err)
    raise errors[0]


def _boolean(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    return value


def _integer(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
    return value


def _number(value: Any, key: str) -> float:
    if isinstance(value, str):  # YAML 1.1 reads exponents without a dot (1e-3) as strings
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
    return value


_SCALARS = {bool: _boolean, int: _integer, float: _number, str: _text}
