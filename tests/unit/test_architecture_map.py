"""docs/architecture.md's module map names exactly the Python modules of rlpipe/, actors/, rewards/ and bench/: none
missing, none that no longer exists, none twice. A map row is a table row whose first cell is one path in backticks,
under the page's "## Module map" heading; a package may be named by its folder (`rlpipe/tools/`), which stands for
its __init__.py."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
FOLDERS = ("rlpipe", "actors", "rewards", "bench")
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")


def module_files(repo: Path = REPO) -> set[str]:
    """Every .py file of the mapped folders, as a path from the repository root."""
    return {
        path.relative_to(repo).as_posix()
        for folder in FOLDERS
        for path in (repo / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def mapped_paths(text: str) -> list[str]:
    """The first-cell paths of the table rows in the "## Module map" section (up to the next "## " heading), a
    folder path (ending in /) turned into its __init__.py."""
    section = text.split("\n## Module map\n", 1)
    assert len(section) == 2, "docs/architecture.md has no '## Module map' section"
    body = re.split(r"\n## (?!#)", section[1], maxsplit=1)[0]
    paths = []
    for line in body.splitlines():
        match = ROW.match(line)
        if match:
            path = match.group(1)
            paths.append(path + "__init__.py" if path.endswith("/") else path)
    return paths


def map_problems(text: str, files: set[str]) -> list[str]:
    paths = mapped_paths(text)
    named = set(paths)
    problems = [f"missing from the map: {path}" for path in sorted(files - named)]
    problems += [f"in the map but not in the repository: {path}" for path in sorted(named - files)]
    problems += [f"in the map twice: {path}" for path in sorted({p for p in paths if paths.count(p) > 1})]
    return problems


def test_the_module_map_names_exactly_the_modules_that_exist():
    problems = map_problems(PAGE.read_text(), module_files())
    assert not problems, "docs/architecture.md's module map:\n" + "\n".join(problems)


def test_the_check_finds_a_missing_a_stale_and_a_doubled_module():
    files = {"rlpipe/__init__.py", "rlpipe/training/lora.py", "rlpipe/tools/__init__.py", "rlpipe/tools/calls.py"}
    rows = [
        "| `rlpipe/` | p |", "| `rlpipe/training/lora.py` | l |", "| `rlpipe/tools/` | t |", "| `rlpipe/tools/calls.py` | c |"
    ]

    def page(lines: list[str]) -> str:
        return "\n".join(["# A", "", "## Module map", "", "| module | owns |", "|---|---|", *lines, "", "## Next",
                          "| `rlpipe/elsewhere.py` | not in the map's section |"])

    assert map_problems(page(rows), files) == []
    assert map_problems(page(rows[:3]), files) == ["missing from the map: rlpipe/tools/calls.py"]
    assert map_problems(page([*rows, "| `rlpipe/tools.py` | t |"]), files) == [
        "in the map but not in the repository: rlpipe/tools.py"
    ]
    assert map_problems(page([*rows, rows[1]]), files) == ["in the map twice: rlpipe/training/lora.py"]


def test_the_page_keeps_its_lines_within_120_characters():
    long = [number for number, line in enumerate(PAGE.read_text().splitlines(), 1) if len(line) > 120]
    assert not long, f"docs/architecture.md: lines over 120 characters: {long}"
