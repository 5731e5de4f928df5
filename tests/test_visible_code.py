"""Code a reader sees runs as shown (read as text with ``ast``: no build, no kernel, fast).

A cell tagged ``remove-cell`` or ``remove-input`` never reaches the reader, so a visible cell
that loads a name bound only in such cells would fail when copied. Checks belong in openable
check cells (``hide-cell`` or ``hide-input``), never in the code a reader copies, so a main
cell holds no ``assert``.
"""

from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md")
               if "_build" not in p.parts and p.read_text().startswith("---\nfile_format: mystnb"))
CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```", re.S | re.M)
TAGS = re.compile(r"^:?tags:\s*\[([^\]]*)\]", re.M)
REMOVED = {"remove-cell", "remove-input"}
OPENABLE = {"hide-cell", "hide-input"}
BUILTINS = set(dir(builtins)) | {"__file__", "__name__", "display", "get_ipython"}


@dataclass
class Cell:
    tags: set[str]
    code: str

    @property
    def visible(self) -> bool:
        return not self.tags & REMOVED

    @property
    def main(self) -> bool:
        """A cell the reader sees open and is meant to copy."""
        return self.visible and not self.tags & OPENABLE


def split_cells(text: str) -> list[Cell]:
    """The code cells of a MyST-NB page, with their tags and their code without options."""
    out = []
    for body in CELL.findall(text):
        lines = body.splitlines()
        if lines and lines[0] == "---":  # a YAML options block
            end = lines.index("---", 1)
            options, lines = lines[1:end], lines[end + 1:]
        else:
            n = next((k for k, line in enumerate(lines) if not line.startswith(":")), len(lines))
            options, lines = lines[:n], lines[n:]
        found = TAGS.search("\n".join(options))
        tags = {t.strip().strip("'\"") for t in found.group(1).split(",")} if found else set()
        # IPython magics and shell escapes are not Python
        code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)
        out.append(Cell(tags - {""}, code))
    return out


def bound_and_loaded(code: str) -> tuple[set[str], set[str]]:
    bound, loaded = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
    return bound, loaded


def offenders(text: str) -> list[str]:
    """Names visible cells load but only removed cells bind, and ``assert`` in main cells."""
    cells = split_cells(text)
    visible_bound, visible_loaded, removed_bound = set(), set(), set()
    found = []
    for cell in cells:
        bound, loaded = bound_and_loaded(cell.code)
        if cell.visible:
            visible_bound |= bound
            visible_loaded |= loaded
        else:
            removed_bound |= bound
        if cell.main and any(isinstance(n, ast.Assert) for n in ast.walk(ast.parse(cell.code))):
            found.append("assert")
    hidden_only = (visible_loaded & removed_bound) - visible_bound - BUILTINS
    return sorted(set(found)) + sorted(hidden_only)


def name(page: Path) -> str:
    return page.relative_to(DOCS).with_suffix("").as_posix()


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_visible_code_runs_as_shown(page):
    problems = offenders(page.read_text())
    assert not problems, f"{name(page)}: visible code needs names from removed cells or asserts"


def page(*cells: tuple[str, str]) -> str:
    """A synthetic page of (tags line or "", code) cells."""
    body = "".join(f"```{{code-cell}} python\n{t + chr(10) if t else ''}{c}\n```\n\n"
                   for t, c in cells)
    return "---\nfile_format: mystnb\n---\n\n" + body


@pytest.mark.parametrize("text, expected", [
    # a visible cell loads a name only a removed cell binds
    (page((":tags: [remove-cell]", "PROMPTS = [1, 2]"), ("", "len(PROMPTS)")), ["PROMPTS"]),
    (page(("---\ntags: [remove-input]\n---", "LONG = 3"), ("", "LONG + 1")), ["LONG"]),
    # used inside a function or a comprehension still counts
    (page((":tags: [remove-cell]", "k = 2"), ("", "def f():\n    return [k for _ in 'ab']")),
     ["k"]),
    # an assert in a main cell; in a hide-cell check it is where it belongs
    (page(("", "x = 1\nassert x == 1")), ["assert"]),
    (page(("", "x = 1"), (":tags: [hide-cell]", "assert x == 1")), []),
    # bound where the reader sees it (a hide-cell can be opened), imports and builtins included
    (page((":tags: [remove-cell]", "import torch\nn = 1"), (":tags: [hide-cell]", "n = 1"),
          ("", "import torch\nprint(len(range(n)), torch)")), []),
    # a removed cell may use whatever it likes; magics are skipped
    (page(("", "%matplotlib inline\ny = 2"), (":tags: [remove-cell]", "glue('y', y + z)")), []),
])
def test_offenders_finds_what_a_reader_cannot_run(text, expected):
    assert offenders(text) == expected
