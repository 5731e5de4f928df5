"""One name per quantity: the pages' maths uses the glossary's symbols, never an alias.

The symbol table is the glossary's "Symbols" section (docs/reference/glossary.md). For the
quantities that papers name in several ways, ``ALIASES`` lists the names a page must not use in
its maths (``$...$``, ``$$...$$``, also inside a cell's strings, which become Markdown tables)
or in the shapes its code comments give.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"

# glossary symbol -> (its LaTeX spelling, names that mean the same quantity elsewhere)
ALIASES = {
    "D_h": ("D_h", ("d_k", "d_h", "d_v", "d_{k}", "d_{h}", "d_{head}", "d_{\\text{head}}", "D")),
    "H_kv": ("H_{kv}", ("H_{KV}", "H_\\text{kv}", "n_{kv}", "h_{kv}", "G_{kv}")),
    "d_model": ("d_{model}", ("d_{emb}", "d_{hidden}", "d_{\\text{model}}", "D_{model}")),
}


def maths(text: str) -> list[str]:
    """The maths spans of a page's source: display blocks first, then inline ``$...$`` (which
    may run over a line break, not over a blank line), then the shapes that code comments
    give (``# [B, H_kv, T, D_h]``).

    >>> maths("a $x_1$ b\\n$$\\nD\\n$$\\n $y\\n z$ k  # [B, T, D]")
    ['\\nD\\n', 'x_1', 'y\\n z', 'B, T, D']
    """
    display = re.findall(r"\$\$(.+?)\$\$", text, flags=re.S)
    rest = re.sub(r"\$\$(.+?)\$\$", " ", text, flags=re.S)
    inline = re.findall(r"(?<![\\$])\$(?!\s)((?:[^$\n]|\n(?!\s*\n))+?)(?<![\s\\])\$", rest)
    shapes = re.findall(r"#[^\n]*?\[([\w, ]+)\]", rest)
    return display + inline + shapes


def uses(span: str, name: str) -> bool:
    """Whether ``name`` is a whole symbol in ``span`` (``D`` is not in ``D_h`` or ``\\Delta``)."""
    return re.search(rf"(?<![A-Za-z\\_{{]){re.escape(name)}(?![A-Za-z_{{])", span) is not None


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def test_the_symbol_table_names_each_kept_symbol():
    glossary = (DOCS / "reference" / "glossary.md").read_text(encoding="utf-8")
    table = glossary[glossary.index("## Symbols"):glossary.index("## Model and attention")]
    entries = re.findall(r"^(\S+)\n  ", table, flags=re.M)
    assert [s for s in ALIASES if s not in entries] == [], entries


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_maths_uses_one_name_per_quantity(page: Path):
    found = [f"{alias} (write {latex}) in ${span.strip()}$"
             for span in maths(page.read_text(encoding="utf-8"))
             for latex, aliases in ALIASES.values() for alias in aliases if uses(span, alias)]
    assert found == []


def test_the_scan_finds_an_alias():
    text = "heads of size $d_k$, and $2 \\times L \\times D\n \\times s$, $D_h$ and $\\Delta$"
    spans = maths(text)
    hits = [a for span in spans for _, aliases in ALIASES.values() for a in aliases
            if uses(span, a)]
    assert hits == ["d_k", "D"]
