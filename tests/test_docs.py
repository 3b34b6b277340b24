"""The documentation a user reads: links that resolve, an options page that matches the code.

Plain unit tests over the markdown files: no torch work beyond importing the option table.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tools.options_page import OPTIONS_PAGE, REGENERATE, options_page

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) or ![alt](target); the target ends at whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|(?<![\w&/])#\d+\b", re.IGNORECASE)


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but ``-`` and ``_`` dropped, spaces
    to ``-`` (``"The Hydra app: multi-node"`` -> ``"the-hydra-app-multi-node"``)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``, with GitHub's ``-1``, ``-2`` for repeated ones."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """``file:line: target (why)`` for every relative link in ``path`` that does not resolve."""
    problems = []
    for number, line in _prose_lines(path.read_text()):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / unquote(file_part)).resolve() if file_part else path
            where = f"{path.relative_to(REPO)}:{number}: {target}"
            if not linked.exists():
                problems.append(f"{where} (no file {os.path.relpath(linked, REPO.resolve())})")
            elif anchor and linked.suffix == ".md" and unquote(anchor) not in anchors(linked):
                problems.append(f"{where} (no heading with anchor #{anchor} in {linked.name})")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    assert page.exists(), page
    assert broken_links(page) == []


def test_a_broken_link_or_anchor_is_reported(tmp_path, monkeypatch):
    """The check itself can fail: a missing file and a missing heading are both named."""
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "other.md").write_text("# Other page\n\n## A heading: with `code`, punctuation!\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading-with-code-punctuation) [self](#title) ![img](other.md)\n"
        "[gone](missing.md) [bad anchor](other.md#no-such-heading)\n"
        "```\n[in a code block](ignored.md)\n```\n"
        "`[inline code](ignored.md)` [web](https://example.com/x.md)\n# Title\n"
    )
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert "page.md:2: missing.md (no file missing.md)" in problems[0]
    assert "no heading with anchor #no-such-heading in other.md" in problems[1]


def test_github_slugs():
    assert github_slug("Data parallelism and ZeRO") == "data-parallelism-and-zero"
    assert github_slug("3-D: the axes together") == "3-d-the-axes-together"
    assert github_slug("torch.compile per block") == "torchcompile-per-block"
    assert github_slug("Why our own engine for ZeRO 0–2 instead of FSDP2") == (
        "why-our-own-engine-for-zero-02-instead-of-fsdp2"
    )
    assert github_slug("NVMe: direct and buffered I/O") == "nvme-direct-and-buffered-io"
    assert github_slug("`summary.json` keys") == "summaryjson-keys"


def test_the_readme_names_no_issue_numbers():
    readme = (REPO / "README.md").read_text()
    hits = [
        f"README.md:{n}: {line.strip()}"
        for n, line in enumerate(readme.splitlines(), 1)
        if ISSUE_NUMBER.search(line)
    ]
    assert hits == []
    assert ISSUE_NUMBER.search("fixed in issue #27") and ISSUE_NUMBER.search("see #27")
    assert not ISSUE_NUMBER.search("[x](docs/app.md#multi-node) and 3 issues")


def test_the_options_page_is_generated_from_the_option_table():
    assert OPTIONS_PAGE.read_text() == options_page(), (
        f"docs/options.md differs from the option table; rewrite it with: {REGENERATE}"
    )
