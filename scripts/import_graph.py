"""The import graph of rlpipe/, actors/, rewards/ and bench/: its arrows and every cycle in it.

Usage: python scripts/import_graph.py [--runtime-only] [--rooms] [--arrows]

Every import counts, at module level and inside functions (a function-level import still ties the two modules
together); imports under `if TYPE_CHECKING:` are counted unless --runtime-only. actors/, rewards/ and bench/ are
named as they install: rlpipe.actors, rlpipe.rewards, rlpipe.bench. An arrow to a package means its __init__.py;
`from pkg import sub` points at pkg.sub where sub is a module. With --rooms, a subpackage (config/, weightsync/,
actors/, ...) counts as one node and each top-level module of rlpipe/ as one. Exit status 1 where a cycle exists.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"rlpipe": "rlpipe", "actors": "rlpipe.actors", "rewards": "rlpipe.rewards", "bench": "rlpipe.bench"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _canonical(name: str) -> str:
    head, _, rest = name.partition(".")
    if head in ("actors", "rewards", "bench"):  # the folders imported by their checkout names
        return f"rlpipe.{head}" + (f".{rest}" if rest else "")
    return name


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for inner in ast.walk(child):
                    if hasattr(inner, "lineno"):
                        lines.add(inner.lineno)
    return lines


def arrows(known: dict[str, Path], runtime_only: bool) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> where: 'file:line (module|function|type-checking)'."""
    found: dict[tuple[str, str], list[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _type_checking_lines(tree)
        is_package = path.name == "__init__.py"
        top_level = {id(node) for node in tree.body} | {
            id(inner) for node in tree.body if isinstance(node, (ast.If, ast.Try)) for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_canonical(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = _canonical(node.module)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in known else source)
            else:
                continue
            kind = "type-checking" if node.lineno in typing_only else (
                "module" if id(node) in top_level else "function")
            if runtime_only and kind == "type-checking":
                continue
            for target in targets:
                # `import a.b.c` names a.b.c; keep the longest prefix that is one of ours
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in known and target != name:
                    where = f"{path.relative_to(ROOT)}:{node.lineno} ({kind})"
                    found.setdefault((name, target), []).append(where)
    return found


def room(name: str) -> str:
    """rlpipe.x for a top-level module or subpackage of rlpipe (rlpipe.weightsync.codec -> rlpipe.weightsync)."""
    return ".".join(name.split(".")[:2])


def cycles(names: list[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, list[str]] = {name: [] for name in names}
    for a, b in edges:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    sys.setrecursionlimit(10000)

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in names:
        if name not in index:
            visit(name)
    return sorted(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-only", action="store_true", help="leave out imports under TYPE_CHECKING")
    parser.add_argument("--rooms", action="store_true", help="one node per subpackage and top-level module")
    parser.add_argument("--arrows", action="store_true", help="print every arrow")
    args = parser.parse_args()
    known = modules()
    found = arrows(known, args.runtime_only)
    if args.rooms:
        rooms: dict[tuple[str, str], list[str]] = {}
        for (a, b), where in found.items():
            if room(a) != room(b):
                rooms.setdefault((room(a), room(b)), []).extend(where)
        known = {room(name): path for name, path in known.items()}
        found = rooms
    if args.arrows:
        for (a, b), where in sorted(found.items()):
            print(f"{a} -> {b}    {', '.join(where)}")
    components = cycles(sorted(known), set(found))
    mutual = sorted((a, b) for a, b in found if a < b and (b, a) in found)
    print(f"{len(known)} nodes, {len(found)} arrows, {len(components)} cycles (strongly connected components), "
          f"{len(mutual)} pairs importing each other")
    for component in components:
        print("cycle: " + ", ".join(component))
        members = set(component)
        for (a, b), where in sorted(found.items()):
            if a in members and b in members:
                print(f"    {a} -> {b}    {', '.join(where)}")
    return 1 if components else 0


if __name__ == "__main__":
    sys.exit(main())
