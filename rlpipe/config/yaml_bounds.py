"""YAML read within bounds. An alias stands for the whole node its anchor names, so a few lines of anchors, each
a list of aliases of the one before ("billion laughs"), stand for billions of nodes: read, they are a few shared
Python objects, but writing the config out (the run folder's config.yaml) or walking it builds every one. A document
whose aliases stand for more than MAX_ALIAS_NODES nodes, or whose alias refers to the node that holds it, is refused
as soon as it is read, before anything is built from it."""

from __future__ import annotations

from typing import Any

import yaml

# A shipped recipe has about a hundred nodes in all; anchors that share a few of its sections stay far below this.
MAX_ALIAS_NODES = 10_000


class YamlBoundError(ValueError):
    """A document past a bound; the message says which, in one line."""


class BoundedSafeLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a document whose aliases stand for more than MAX_ALIAS_NODES nodes."""

    def compose_document(self):
        node = super().compose_document()
        added = alias_nodes(node)
        if added > MAX_ALIAS_NODES:
            raise YamlBoundError(f"its aliases stand for {added} nodes, more than the {MAX_ALIAS_NODES} allowed")
        return node


def alias_nodes(root: yaml.Node) -> int:
    """How many nodes the aliases under `root` add once each is replaced by the node it names: the expanded count
    less the nodes written out. Walked without recursion, each node once (the count of a shared node is kept)."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_counted = stack.pop()
        if children_counted:
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
            on_path.discard(id(node))
            continue
        if id(node) in sizes:
            continue
        if id(node) in on_path:  # depth first: a node met again before it is counted holds itself
            raise YamlBoundError("an alias refers to the node that holds it")
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node))
    return sizes[id(root)] - len(sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def safe_load(text: str) -> Any:
    """`yaml.safe_load` within the bounds; raises YamlBoundError past one, yaml.YAMLError for malformed text and
    RecursionError for nesting deeper than the parser (which recurses) can follow."""
    return yaml.load(text, Loader=BoundedSafeLoader)
