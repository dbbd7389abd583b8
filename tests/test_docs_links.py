"""Every relative link in the Markdown docs leads somewhere: the file exists and, for a
`#fragment`, the page has that anchor (an explicit `<a id="...">` or a heading's GitHub slug).

The docs cross-link heavily (README -> docs/*.md#section, decisions.md <-> benchmarks.md); a
section renamed or moved used to leave links that land at the top of a 3,000-line page.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.md"),
                *(ROOT / "kvgate").rglob("*.md")])

LINK = re.compile(r"\]\(([^)\s]+)\)")
ANCHOR = re.compile(r"""<a\s+id=["']([^"']+)["']""")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped except - and _, spaces to -."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)               # inline code keeps its text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)      # a link keeps its label
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """The page's lines (numbered from 1) outside fenced code blocks: links and headings in
    code are not links."""
    out, fenced = [], False
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, line))
    return out


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path):
        found.update(ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for i, line in _prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            out.append((i, target))
    return out


def test_slugs_follow_github():
    assert github_slug("Hit rate against `max_wait_s` (default scenario, 2026-11-30)") == \
        "hit-rate-against-max_wait_s-default-scenario-2026-11-30"
    assert github_slug("What limits `kvgate` now") == "what-limits-kvgate-now"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path):
    broken = []
    for line, target in links(page):
        file_part, _, fragment = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"line {line}: {target} (no such file)")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"line {line}: {target} (no anchor #{fragment} in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)
