"""The page sources follow the site's rules (read as text: no build, no kernel, fast).

- Code lines in code cells fit the page: at most 88 characters; so do the lines of package code
  a page includes with ``literalinclude`` and ``:pyobject:``.
- Checks are hidden, never removed: a ``remove-cell`` cell holds glue plumbing, not ``assert``.
- No page repeats the kernel set-up (docs/_ipython) or writes its own ``ord(ch) - 32`` tokenizer.
- Every page of the on-ramp and Parts I to III and V ends a self-check question with a hidden answer
  that the build computes: a dropdown with a glued value.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md")
               if "_build" not in p.parts and p.read_text().startswith("---\nfile_format: mystnb"))
CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```", re.S | re.M)
SELF_CHECK = ["attention", *(f"part{n}/{p.stem}" for n in (1, 2, 3, 5)
                             for p in sorted((DOCS / f"part{n}").glob("[0-9]*.md")))]


def name(page: Path) -> str:
    return page.relative_to(DOCS).with_suffix("").as_posix()


def cells(page: Path) -> list[str]:
    return CELL.findall(page.read_text())


def long_lines(page: Path) -> list[str]:
    return [line for c in cells(page) for line in c.splitlines() if len(line) > 88]


def removed_checks(page: Path) -> list[str]:
    return [c for c in cells(page)
            if c.startswith(":tags: [remove-cell]") and re.search(r"^\s*assert\b", c, re.M)]


def page_setup(page: Path) -> list[str]:
    """Kernel set-up (docs/_ipython does it) or a tokenizer of its own (kvdoc.teach.tokens has
    one)."""
    text = page.read_text()
    return [p for p in ("set_num_threads", "svg.hashsalt", "ord(ch) - 32") if p in text]


def has_self_check(page: Path) -> bool:
    blocks = re.findall(r"^:::\{admonition\}[^\n]*\n:class: dropdown\n(.*?)^:::", page.read_text(),
                        re.S | re.M)
    return any("{glue:text}" in b for b in blocks)


@pytest.mark.parametrize("rule, check", [("long-lines", long_lines),
                                         ("removed-checks", removed_checks),
                                         ("page-setup", page_setup)])
def test_rule_holds_on_every_page(rule, check):
    assert len(PAGES) > 10  # the glob found the site
    broken = sorted(name(p) for p in PAGES if check(p))
    assert not broken, f"{rule}: {broken}"


def test_learner_pages_end_with_a_computed_self_check():
    assert len(SELF_CHECK) >= 18  # the on-ramp and every page of Parts I to III and V
    missing = [p for p in SELF_CHECK if not has_self_check(DOCS / f"{p}.md")]
    assert not missing, missing


def test_the_checks_can_fail(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("```{code-cell} python\n:tags: [remove-cell]\nassert 1\n" + "x" * 89
                    + "\ntorch.set_num_threads(1)\n```\n\n"
                    ":::{admonition} Answer\n:class: dropdown\nno glue\n:::\n")
    assert removed_checks(page) and long_lines(page) and page_setup(page)
    assert not has_self_check(page)


INCLUDE = re.compile(r"```\{literalinclude\} \.\./\.\./kvdoc/(\w+/\w+)\.py\n:pyobject: ([\w.]+)")


def included_long_lines(text: str) -> list[str]:
    """Lines over 88 characters in the package objects a page includes with ``:pyobject:``."""
    long = []
    for module, name in INCLUDE.findall(text):
        obj = importlib.import_module("kvdoc." + module.replace("/", "."))
        for part in name.split("."):
            obj = getattr(obj, part)
        long += [f"{name}: {line}" for line in inspect.getsource(obj).splitlines()
                 if len(line) > 88]
    return long


def test_included_package_code_fits_the_page():
    includes = {name(p): INCLUDE.findall(p.read_text()) for p in PAGES}
    assert sum(map(len, includes.values())) >= 8  # the pages do include the real code
    broken = {name(p): lines for p in PAGES if (lines := included_long_lines(p.read_text()))}
    assert not broken, broken


def test_the_include_rule_can_fail():
    assert included_long_lines("```{literalinclude} ../../kvdoc/core/model.py\n"
                               ":pyobject: Decoder\n")
