"""The front door and the docs: the reference pages are what the code generates, nothing cites a
file the repository does not have, and the README stays a short read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: where prose and code live (the tests' own data aside)
SOURCES = [ROOT / d for d in ("lmkv", "connectors", "benchmarks", "kernels", "scripts", "docs", "examples")]


def test_the_reference_pages_are_what_the_code_generates():
    """A setting, metric or command added without regenerating the pages fails here: run
    ``python -m lmkv.dev.reference docs/reference``."""
    pytest.importorskip("vllm")  # (the metrics page lists what lmkv adds to vLLM's /metrics)
    from lmkv.dev.reference import PAGES

    for name, make in PAGES.items():
        assert (ROOT / "docs" / "reference" / name).read_text() == make(), f"docs/reference/{name} is stale"


def _files() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "mkdocs.yml", ROOT / "pyproject.toml"]
    for base in SOURCES:
        out += [p for p in base.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".sh", ".cu", ".yml")]
    return out


def test_nothing_cites_a_file_the_repository_does_not_have():
    cited = re.compile(r"DESIGN\.md|BENCH\.md|STYLE\.md|shared/(research|traces|seeds)|\.\./shared")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in _files()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if cited.search(line)]
    assert not found, found


def test_every_page_the_docs_link_exists():
    """(``mkdocs build --strict`` checks the site; this checks the README's links too.)"""
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).resolve().exists(), f"{page.relative_to(ROOT)} links {target}"


def _prose(markdown: str) -> str:
    """The README's text outside code blocks (tables and headings included)."""
    return re.sub(r"```.*?```", " ", markdown, flags=re.S)


def test_the_readme_is_a_short_read():
    text = (ROOT / "README.md").read_text()
    prose = _prose(text)
    words = len(re.findall(r"\S+", prose))
    assert words <= 1500, f"{words} words outside code blocks"
    before_first_command = len(re.findall(r"\S+", _prose(text[: text.index("```")])))
    assert before_first_command <= 300, f"the first command comes after {before_first_command} words"
    sentences = [s for para in prose.split("\n\n") if not para.lstrip().startswith(("|", "#"))
                 for s in re.split(r"(?<=[.!?])\s+", " ".join(para.split()))]
    long = [s for s in sentences if len(s.split()) > 40]
    assert not long, long


def test_the_front_door_speaks_of_the_product_not_of_its_making():
    telltales = re.compile(r"\b(this session|was lent|none was lent|as before|this machine \(2 cores\))\b", re.I)
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        assert not telltales.search(page.read_text()), page.relative_to(ROOT)
