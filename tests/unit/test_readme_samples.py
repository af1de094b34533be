"""The samples in README.md and docs/*.md show what the tool prints and accepts; their links lead somewhere."""

from __future__ import annotations

import re
import shlex
import unicodedata
from pathlib import Path

from hvdrun.health.check import CheckOptions, human_bytes

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_EXTERNAL = ("http://", "https://", "mailto:")


def _lines(page: Path) -> list[str]:
    return page.read_text().splitlines()


def _outside_fences(lines: list[str]) -> list[str]:
    """The lines that are not inside a fenced code block (fences may be indented, as inside a list item)."""
    kept, fenced = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return kept


def _slug(heading: str) -> str:
    """A heading's anchor as MkDocs' toc makes it: the rendered text, ASCII, punctuation dropped, lowercase,
    runs of spaces and hyphens made one '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("**", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets _1, _2, ... as in MkDocs."""
    anchors: set[str] = set()
    for line in _outside_fences(_lines(page)):
        if match := _HEADING.match(line):
            slug, n = _slug(match.group(2)), 1
            while slug in anchors:
                slug = f"{_slug(match.group(2))}_{n}"
                n += 1
            anchors.add(slug)
    return anchors


def _relative_links(page: Path) -> list[str]:
    """Link targets in the page's prose (not in code blocks or code spans) that stay inside the repository."""
    prose = "\n".join(re.sub(r"`[^`\n]*`", "", line) for line in _outside_fences(_lines(page)))
    return [target for target in _LINK.findall(prose) if not target.startswith(_EXTERNAL)]


def test_the_check_sample_shows_the_bandwidth_size_check_uses():
    pages = [page for page in PAGES if "$ hvdrun check " in page.read_text()]
    assert len(pages) >= 1
    for page in pages:
        assert f" bandwidth   allreduce of {human_bytes(CheckOptions.bandwidth_bytes)} " in page.read_text(), page


def test_every_hosts_sample_is_a_valid_plan():
    from hvdrun.hosts import parse_host_string
    from hvdrun.ranks import assign_slots

    lines = [line.removeprefix("$ ") for page in PAGES for line in _lines(page)]
    samples = [line.split("#")[0].replace("$(hostname)", "node0") for line in lines
               if line.startswith("hvdrun ") and " -H " in line]
    assert len(samples) >= 9
    for sample in samples:
        words = shlex.split(sample)
        hosts = parse_host_string(words[words.index("-H") + 1])
        if "-np" in words:
            assign_slots(hosts, int(words[words.index("-np") + 1]))  # -np within the slots


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    links = [(page, target) for page in PAGES for target in _relative_links(page)]
    assert len(links) >= 30
    broken = []
    for page, target in links:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target}: no file {path}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            where = path or page.name
            broken.append(f"{page.relative_to(ROOT)}: {target}: no heading with anchor #{anchor} in {where}")
    assert not broken, "\n".join(broken)
