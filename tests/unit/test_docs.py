"""The documentation: README.md stays a short user's guide, every relative link in the project's pages resolves to a
file inside the repository (and its #anchor to a heading there), and the pages describe what rlpipe does, not how
it is developed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = sorted(
    {README, *(REPO / "docs").glob("*.md"), *(REPO / "examples").glob("*/README.md"), *(REPO / "deploy").rglob("*.md")}
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
# Words about how the project is developed rather than what it does.
DEVELOPMENT_WORDS = re.compile(
    r"\bstop \d+|\bround \d+|\bthis round\b|\bsession\b|\bdeveloped (on|here)\b|\bdevelopment machines?\b",
    re.IGNORECASE,
)


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def _prose(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of the page outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for _, line in _prose(page):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_the_pages_are_found():
    names = {_name(page) for page in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/benchmarks.md", "docs/tpu.md"} <= names


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines; move details to docs/"


def _links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link outside fenced code, a link's text may span lines."""
    prose = _prose(page)
    text = "\n".join(line for _, line in prose)
    return [(prose[text.count("\n", 0, match.start(1))][0], match.group(1)) for match in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve_inside_the_repository(page):
    broken = []
    for number, target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        where = f"{_name(page)}:{number}: {target}"
        if not resolved.is_relative_to(REPO):
            broken.append(f"{where} points outside the repository")
        elif not resolved.exists():
            broken.append(f"{where} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{where}: no heading #{anchor} in {_name(resolved)}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_words_about_how_the_project_is_developed(page):
    found = [
        f"{_name(page)}:{number}: {match.group(0)!r}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for match in DEVELOPMENT_WORDS.finditer(line)
    ]
    assert not found, "\n".join(found)


def _yaml_blocks(page: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)


@pytest.mark.parametrize("block", range(len(_yaml_blocks(REPO / "docs" / "tpu.md"))))
def test_the_tpu_pages_recipes_pass_rlpipe_plan_as_written(block, tmp_path, capsys):
    from rlpipe.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(_yaml_blocks(REPO / "docs" / "tpu.md")[block])
    assert main(["plan", str(recipe)]) == 0, capsys.readouterr()


def test_the_readmes_first_reward_compares_the_answer_not_a_suffix(tmp_path):
    """The README's `my_rewards.py`, run as a file-path reward: "I think 142" is wrong for 42."""
    from rlpipe.rewards import load_reward

    blocks = re.findall(r"```python\n(# my_rewards\.py.*?)```", README.read_text(), re.DOTALL)
    assert len(blocks) == 1, "README.md's first custom reward (a python block starting '# my_rewards.py')"
    (tmp_path / "my_rewards.py").write_text(blocks[0])
    reward = load_reward(f"{tmp_path / 'my_rewards.py'}:answer_and_brevity")
    scores = reward(completions=["I think 142", "I think 42", "42", "Roughly 42.5"], answer=["42"] * 4)
    assert [score["score"] for score in scores] == [0.0, 1.0, 1.5, 0.0]
