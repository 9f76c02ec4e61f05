"""Help text: every key with its meaning and the value a recipe and overrides give it (`rlpipe train --help`)."""

from __future__ import annotations

import dataclasses

import yaml

from rlpipe.config.tree import Config


def describe(cls=Config, prefix: str = "", instance=None) -> list[tuple[str, str, str]]:
    """(dotted key, default, meaning) for every key, in declaration order."""
    rows = []
    instance = cls() if instance is None else instance
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):  # a section: its defaults are those of this field, not of the class
            rows.extend(describe(type(value), key + ".", value))
            continue
        if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            value = [dataclasses.asdict(d) for d in value]
        shown = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")
        rows.append((key, shown, f.metadata.get("help", "")))
    return rows


def help_text(config: Config | None = None, source: str | None = None) -> str:
    """Every key with its meaning and default: the value in `config` (what a recipe and overrides resolve to, named
    by `source`), else the built-in default."""
    rows = describe(instance=config)
    width = max(len(k) for k, _, _ in rows)
    where = f", with the values of {source}" if source else ""
    lines = [f"config keys{where} (override any with key=value, e.g. train.steps=20):"]
    for key, default, meaning in rows:
        lines.append(f"  {key:<{width}}  {meaning}  [default: {default}]")
    return "\n".join(lines)
