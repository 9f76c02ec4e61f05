"""A config from a YAML recipe plus `a.b=value` overrides: the recipe's file (or the shipped recipe of that name),
YAML that refuses a key given twice and bounds its aliases (yaml_bounds.py), the overrides set into it, typed
sections built, every check run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlpipe.config.coerce import OverrideText, build
from rlpipe.config.errors import ConfigError
from rlpipe.config.tree import Config
from rlpipe.config.yaml_bounds import BoundedSafeLoader, YamlBoundError


def load_config(recipe: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Recipe file, then `a.b=value` overrides, then type checks and cross-key validation."""
    recipe_path = find_recipe(recipe) if recipe else None
    tree = load_yaml(recipe_path) if recipe_path else {}
    for text in overrides:
        path, value = _parse_override(text)
        _set_path(tree, path, value, text.split("=", 1)[0])
    config = build(Config, tree)
    config.reward.resolve_files(recipe_path.parent if recipe_path else None)
    config.check()
    return config


def recipes_dir() -> Path:
    """The recipes rlpipe ships: rlpipe/configs/, which in a checkout is a link to the top-level configs/ (the
    folder returned)."""
    return (Path(__file__).resolve().parents[1] / "configs").resolve()


def default_recipe() -> Path:
    """The recipe a run takes when none is named: the shipped default.yaml."""
    return recipes_dir() / "default.yaml"


def find_recipe(recipe: str | Path) -> Path:
    """The recipe file `recipe` names; where no such file exists, the shipped recipe of that name (`default.yaml`,
    `configs/qwen3-8b-v6e.yaml`), so that an installed rlpipe runs the recipes it carries from any directory."""
    path = Path(recipe)
    if path.exists() or path.is_absolute():
        return path
    parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
    shipped = recipes_dir().joinpath(*parts) if parts else path
    return shipped if shipped.is_file() else path


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a YAML recipe file")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.load(path.read_text(), Loader=_RecipeLoader)
    except _DuplicateKey as err:
        raise ConfigError(f"{path}: {err}; give each key once") from None
    except YamlBoundError as err:
        raise ConfigError(f"{path}: {err}") from None
    except RecursionError:  # the parser recurses once per level
        raise ConfigError(f"{path}: nests deeper than YAML's reader can follow") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}") from None
    if data is None:  # an emptied or truncated file would otherwise train with every default
        raise ConfigError(f"{path}: the recipe is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int):
        super().__init__(f"duplicate key {key!r} (line {line})")


class _RecipeLoader(BoundedSafeLoader):
    """YAML's safe loader within bounds, and a key given twice in one mapping is an error: the safe loader keeps the
    last one silently, so a recipe could say two things and mean one."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<:` merges are meant to be overridden
                key = self.construct_object(key_node)
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _parse_override(text: str) -> tuple[list[str], OverrideText]:
    if "=" not in text:
        raise ConfigError(f"{text}: an override must look like section.key=value")
    dotted, raw = text.split("=", 1)
    if not dotted:
        raise ConfigError(f"{text}: an override must look like section.key=value")
    return dotted.split("."), OverrideText(raw)


def _set_path(tree: dict, path: list[str], value: Any, dotted: str) -> None:
    node = tree
    for part in path[:-1]:
        if node.get(part) is None:
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[path[-1]] = value
