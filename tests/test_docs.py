"""The manual: docs/cli.md is exactly what scripts/cli_reference.py generates from the commands' --help,
the README stays a front door (at most 200 lines, linking every paper's page), and every relative link
in the README and docs/*.md points at a file that exists (and at a heading there, for a #fragment).

Pages under docs/reproductions/ are generated (tests/test_reproduction.py checks them); a link to the
page of a paper whose reproduction is not registered yet (no bench/reproduce/<key>.py) may point ahead.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
REPRODUCTIONS = DOCS / "reproductions"
PAPERS = ("hat", "andes", "disco", "llms", "cocoserve")
README_MAX_LINES = 200

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+).+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def cli_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "scripts" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list[Path]:
    """The hand-written manual and the README (the generated reproduction pages are not ours to check)."""
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code removed."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            out.append(CODE_SPAN.sub("", line))
    return out


def links(page: Path) -> list[str]:
    return [m[1] for line in prose_lines(page.read_text()) for m in LINK.finditer(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match[2])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def is_registered(paper: str) -> bool:
    return (REPO / "bench" / "reproduce" / f"{paper}.py").is_file()


def test_cli_reference_is_what_the_commands_help_says() -> None:
    expected = cli_reference().render()
    actual = (DOCS / "cli.md").read_text() if (DOCS / "cli.md").is_file() else ""
    if actual != expected:
        diff = "".join(list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True), "docs/cli.md",
                                                 "generated"))[:60])  # fmt: skip
        pytest.fail(f"docs/cli.md is out of date: run .venv/bin/python scripts/cli_reference.py\n{diff}")


def test_cli_reference_documents_every_command() -> None:
    import typer

    from testbed.cli import app

    text = (DOCS / "cli.md").read_text()
    root = typer.main.get_command(app)
    stack = [("testbed", root)]
    while stack:
        path, command = stack.pop()
        assert f"\n## {path}\n" in text, path
        for name, sub in getattr(command, "commands", {}).items():
            if not getattr(sub, "hidden", False):
                stack.append((f"{path} {name}", sub))
    assert "\n## testbed reproduce\n" in text
    assert "\x1b[" not in text, "ANSI escapes in the reference"


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move the rest into docs/"
    linked = set(links(README))
    for paper in PAPERS:
        assert f"docs/reproductions/{paper}.md" in linked, f"the README does not link {paper}'s page"
    for command in ("make demo", "make test", "testbed reproduce"):
        assert command in README.read_text(), command


def test_every_relative_link_points_at_a_file_and_heading() -> None:
    broken, ahead = [], []
    for page in pages():
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, fragment = target.partition("#")
            where = (page.parent / path_part).resolve() if path_part else page
            name = f"{page.relative_to(REPO)}: {target}"
            if not where.exists():
                paper = where.stem if where.parent == REPRODUCTIONS.resolve() and where.suffix == ".md" else None
                if paper in PAPERS and not is_registered(paper):
                    ahead.append(name)  # written by `testbed reproduce` once the paper is registered
                elif paper in PAPERS:
                    broken.append(f"{name} (a generated page: run `testbed reproduce {paper} --pages-only`)")
                else:
                    broken.append(f"{name} (no such file)")
                continue
            checked = where.suffix == ".md" and where.parent != REPRODUCTIONS.resolve()
            if fragment and checked and fragment not in anchors(where):
                broken.append(f"{name} (no heading #{fragment} in {where.relative_to(REPO)})")
    assert broken == [], "\n".join(dict.fromkeys(broken))
    unregistered = sorted({Path(a.split(": ", 1)[1]).stem for a in ahead})
    assert set(unregistered) <= set(PAPERS)


def test_the_manual_names_no_file_outside_the_repository() -> None:
    for page in pages():
        text = page.read_text()
        assert "../shared" not in text and "/work/" not in text, page.relative_to(REPO)
