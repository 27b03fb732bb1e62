"""The documentation holds together: a short README, working relative links, the two commands.

The README is the page a newcomer reads first, so it stays short; every relative link in it,
in `docs/` and in `deploy/README.md` must reach a file, and a link's `#anchor` into a Markdown
page must name one of that page's headings as GitHub slugs them. CI runs the README's own test
command, so the README must keep the two fenced commands exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "README.md"]
README_MAX_LINES = 250

FENCED_BLOCK = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
EXTERNAL = ("http://", "https://", "mailto:")


def without_code(markdown: str) -> str:
    """The text outside fenced code blocks, where a heading or a link can be."""
    return FENCED_BLOCK.sub("", markdown)


def github_slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lowercase, punctuation but `-` and `_` dropped,
    spaces turned into `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets `-1`, `-2`, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(without_code(page.read_text(encoding="utf-8"))):
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of a page's Markdown links that are neither web nor mail addresses."""
    text = INLINE_CODE.sub("", without_code(page.read_text(encoding="utf-8")))
    return [target for target in LINK.findall(text) if not target.startswith(EXTERNAL)]


def broken(page: Path, target: str) -> str | None:
    """Why a link of a page leads nowhere, or None when it reaches its file and heading."""
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    where = f"{page.relative_to(REPO)}: {target}"
    if not linked.exists():
        return f"{where}: no such file"
    if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
        return f"{where}: no heading #{anchor} in {linked.name}"
    return None


def test_readme_is_at_most_250_lines() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_relative_link_reaches_its_file_and_heading() -> None:
    links = [(page, target) for page in PAGES for target in relative_links(page)]
    assert len(links) > len(PAGES), "too few links found: is the link pattern wrong?"
    problems = [why for page, target in links if (why := broken(page, target)) is not None]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command", ["scripts/demo", "scripts/test"])
def test_readme_keeps_the_fenced_command(command: str) -> None:
    block = f"```sh\n{command}\n```"
    assert block in README.read_text(encoding="utf-8"), f"README.md lost the {command} block"


def test_headings_are_slugged_as_github_does() -> None:
    assert github_slug("Where issue 16's goals stand") == "where-issue-16s-goals-stand"
    assert (
        github_slug("Idle-gap prefetch (`elastic:prefetch=1`), WEKA agentic sessions")
        == "idle-gap-prefetch-elasticprefetch1-weka-agentic-sessions"
    )
    assert github_slug("Node KV pool (DRAM tier)") == "node-kv-pool-dram-tier"
