"""The lists of pages a reader starts from against the site's navigation (mkdocs.yml): every page
of the site is linked from the README's documentation list and from the docs' home page, so a new
page cannot be left out of them. The navigation is read as text (no mkdocs, no YAML parser)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Pages whose place in a list is taken by another link: the home page itself, and the figures
# page, which is bench/RESULTS.md included as it is.
STANDS_FOR = {"index.md": None, "benchmark-figures.md": "bench/RESULTS.md"}


def nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:\n", 1)[1]
    nav = re.split(r"\n(?=\S)", nav, maxsplit=1)[0]  # up to the next top-level key
    return re.findall(r":\s*(\S+\.md)\s*$", nav, re.M)


def links(path: Path) -> set[str]:
    found = re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", path.read_text())
    return {str((path.parent / link).resolve().relative_to(ROOT)) for link in found}


def test_the_navigation_is_read() -> None:
    pages = nav_pages()
    assert "getting-started.md" in pages
    assert "guides/memory-tier.md" in pages
    assert len(pages) >= 25, pages


def test_the_readme_links_every_page_of_the_site() -> None:
    linked = links(ROOT / "README.md")
    for page in nav_pages():
        target = STANDS_FOR.get(page, f"docs/{page}")
        if target is not None:
            assert target in linked, f"README.md's documentation list lacks {target}"


def test_the_home_page_links_every_page_of_the_site() -> None:
    linked = links(ROOT / "docs" / "index.md")
    for page in nav_pages():
        if page in STANDS_FOR:
            continue
        assert f"docs/{page}" in linked, f"docs/index.md lacks a link to {page}"
