"""The README is the front page and the docs are split by reader: every relative link between them (and to
files of the checkout) must lead somewhere, every #anchor to a heading of its target, and the README must keep
the set-up commands CI runs (`make test`, `make test-hosts`) first."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MD = MarkdownIt("commonmark").enable("table")


def github_slug(text: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in text.lower() if c.isalnum() or c in "-_ ")
    return kept.replace(" ", "-")


def _inline_text(token) -> str:
    return "".join(child.content for child in token.children or [] if child.type in ("text", "code_inline"))


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2, ... for repeats."""
    tokens = MD.parse(page.read_text())
    seen: dict[str, int] = {}
    found: set[str] = set()
    for i, token in enumerate(tokens):
        if token.type != "heading_open":
            continue
        slug = github_slug(_inline_text(tokens[i + 1]))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(page: Path) -> list[str]:
    """Every link target outside code (inline links; code spans and blocks are not links)."""
    targets: list[str] = []
    for token in MD.parse(page.read_text()):
        for child in token.children or []:
            if child.type == "link_open":
                targets.append(str(child.attrs["href"]))
    return targets


def test_every_page_has_links_to_check() -> None:
    assert len(PAGES) >= 7, [p.name for p in PAGES]  # README + operators, admins, scheduler authors, ...
    assert all(links(page) for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for href in links(page):
        parts = urlsplit(href)
        if parts.scheme or href.startswith("//"):
            continue  # the web is not checked here
        target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        if not target.exists():
            broken.append(f"{href}: no file {target}")
            continue
        if parts.fragment and target.suffix == ".md" and parts.fragment not in anchors(target):
            broken.append(f"{href}: no heading #{parts.fragment} in {target.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_every_doc_is_reachable_from_the_readme() -> None:
    linked = {(REPO / urlsplit(h).path).resolve() for h in links(REPO / "README.md") if not urlsplit(h).scheme}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs not linked from README.md: {missing}"


def test_the_readme_shows_the_set_up_commands_first() -> None:
    """CI (.ci/run) runs the README's test commands: the first code block is make demo, make test, make test-hosts."""
    first_block = next(t for t in MD.parse((REPO / "README.md").read_text()) if t.type == "fence")
    commands = [re.split(r"\s+#", line)[0].strip() for line in first_block.content.splitlines()]
    assert [c for c in commands if c] == ["make demo", "make test", "make test-hosts"]
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test ||" in ci and "make test-hosts ||" in ci


def test_the_slug_rule_matches_githubs() -> None:
    assert github_slug("Host lab (`make test-hosts`)".replace("`", "")) == "host-lab-make-test-hosts"
    assert github_slug("API (HTTP/JSON on the Unix socket)") == "api-httpjson-on-the-unix-socket"
    assert github_slug("The job → agent channel") == "the-job--agent-channel"
