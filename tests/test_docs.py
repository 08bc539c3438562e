"""The documents agree with the code: CI runs the README's test command, every link lands, and the layer map in
docs/development.md is the one tests/test_layers.py enforces."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_layers import LAYERS

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a `# comment` in a bash block is not a heading, a link in it no link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", _prose(page.read_text()), flags=re.M)}


def test_ci_runs_the_readme_test_command_exactly():
    command = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert command == 'pip install "torch==2.13.0" -e ".[dev]" && python -m pytest -q'
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert [command] in [block.strip().splitlines() for block in blocks], \
        "README.md must show .ci/run's last line as a bash block of its own (CI runs exactly the README's command)"
    assert 'pip install "torch==2.13.0" -e ".[dev]" && python -m nanopt.main' in README.read_text()


def test_the_readme_stays_a_guide():
    lines = len(README.read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines; put the detail on its page under docs/ and link it"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_lands_on_a_file_and_heading(page: Path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and file.suffix == ".md" and fragment not in _anchors(file):
            broken.append(f"{target} (no heading with that anchor in {file.name})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_the_layer_map_page_is_the_enforced_one():
    text = (REPO / "docs" / "development.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+?) \|", text, flags=re.M)
    documented = [tuple(m.split("/")[0] for m in re.findall(r"`([\w/*]+)`", modules)) for _, modules in rows]
    assert [int(n) for n, _ in rows] == list(range(len(LAYERS))), "docs/development.md: layer numbers 0, 1, 2, ..."
    assert documented == LAYERS, ("docs/development.md's layer table differs from tests/test_layers.py LAYERS: "
                                  "make the table list each layer's modules in the same order")


def test_what_the_documented_commands_write_into_the_checkout_is_ignored_by_git():
    """Prepared shards, exported models, demo tasks and plots the pages' commands write in the checkout (a relative
    --out, --make-tasks, data.source, or nanopt plot's default name) never show up as changes to commit."""
    ignored = {line.strip() for line in (REPO / ".gitignore").read_text().splitlines()}
    commands = "\n".join(re.findall(r"^```bash\n(.*?)^```", "\n".join(p.read_text() for p in PAGES), flags=re.S | re.M))
    written = re.findall(r"(?:--out|--make-tasks|--data\.source=|--data\.dir=)[ =]?([A-Za-z][\w.-]*/)", commands)
    assert {"data/", "exported/", "tasks/"} <= set(written)
    for top in sorted(set(written)):
        assert f"/{top}" in ignored or top in ignored, f"{top} (written by a documented command) is not in .gitignore"
    assert "nanopt plot runs/a runs/b " in commands and "/plot_*.png" in ignored  # plot_<metric>_<x>.png
