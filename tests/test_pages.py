"""The page sources follow the site's rules (read as text: no build, no kernel, fast).

- Code lines in code cells fit the page: at most 88 characters; so do the lines of package code
  a page includes with ``literalinclude`` and ``:pyobject:``.
- Checks are hidden, never removed: a ``remove-cell`` cell holds glue plumbing, not ``assert``.
- No page repeats the kernel set-up (docs/_ipython) or writes its own ``ord(ch) - 32`` tokenizer.
- Every page of the on-ramp and Parts I to III and V ends a self-check question with a hidden answer
  that the build computes: a dropdown with a glued value.
- Figures take their font sizes from docs/_ext/matplotlibrc, sized for a phone: no code cell and
  no module of the package sets one in points (``fontsize=8``, ``rcParams["font.size"] = 9``); a
  relative size (``fontsize="small"``) scales with the rc.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
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
    """Kernel set-up (docs/_ipython does it) or a tokenizer of its own (kvdoc.teach.display has
    one)."""
    text = page.read_text()
    return [p for p in ("set_num_threads", "svg.hashsalt", "ord(ch) - 32") if p in text]


def has_self_check(page: Path) -> bool:
    blocks = re.findall(r"^:::\{admonition\}[^\n]*\n:class: dropdown\n(.*?)^:::", page.read_text(),
                        re.S | re.M)
    return any("{glue:text}" in b for b in blocks)


# Font sizes, by keyword (any call: ax.text, legend, tick_params, plt.rc("axes", ...), dict(...))
# and by key (rcParams, rcParams.update, prop= and fontdict= dicts). ``size=`` counts only in
# the calls where matplotlib reads it as a font size: elsewhere (numpy, torch) it is a shape.
FONT_KEYWORDS = {"fontsize", "labelsize", "titlesize", "font_size"}
SIZE_CALLS = {"text", "annotate", "figtext", "set_title", "title", "suptitle", "supxlabel",
              "supylabel", "set_xlabel", "set_ylabel", "xlabel", "ylabel", "legend", "table",
              "set_label", "rc", "FontProperties"}
FONT_KEY = re.compile(r"^(size|fontsize|font\.size|[\w.]*(font|label|title)_?size)$")


def _number(node: ast.AST) -> bool:
    """A literal number, or a string that reads as one (matplotlib takes both as points)."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    if not isinstance(node, ast.Constant) or isinstance(node.value, bool):
        return False
    try:
        float(node.value)
    except (TypeError, ValueError):
        return False
    return True


def _called(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def font_sizes(source: str) -> list[str]:
    """The lines of Python ``source`` that set a font size in points."""
    lines = source.splitlines()
    try:
        tree = ast.parse(source)
    except SyntaxError:  # not Python (a cell that shows an error): the keyword form only
        return [line for line in lines
                if re.search(r"\b(fontsize|labelsize|titlesize)\s*=\s*[-+]?[\d.]", line)]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _called(node)
            bad = any(_number(k.value) and (k.arg in FONT_KEYWORDS
                                            or k.arg == "size" and name in SIZE_CALLS)
                      for k in node.keywords)
            bad |= name in {"set_fontsize", "set_size"} and any(map(_number, node.args))
        elif isinstance(node, ast.Dict):
            bad = any(isinstance(k, ast.Constant) and isinstance(k.value, str)
                      and FONT_KEY.match(k.value) and _number(v)
                      for k, v in zip(node.keys, node.values, strict=True))
        elif isinstance(node, ast.Assign):  # rcParams["font.size"] = 9
            bad = _number(node.value) and any(
                isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
                and isinstance(t.slice.value, str) and FONT_KEY.match(t.slice.value)
                for t in node.targets)
        else:
            continue
        if bad:
            found.append(lines[node.lineno - 1].strip())
    return found


def numeric_font_sizes(page: Path) -> list[str]:
    """Font sizes in points in a page's code cells (IPython magics and cell options left out)."""
    return [line for c in cells(page)
            for line in font_sizes("\n".join("" if re.match(r"\s*[%!]|:\w+:", line) else line
                                             for line in c.splitlines()))]


@pytest.mark.parametrize("rule, check", [("long-lines", long_lines),
                                         ("removed-checks", removed_checks),
                                         ("page-setup", page_setup),
                                         ("font-sizes", numeric_font_sizes)])
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
                    + "\ntorch.set_num_threads(1)\nax.set_title('t', fontsize=10)\n```\n\n"
                    ":::{admonition} Answer\n:class: dropdown\nno glue\n:::\n")
    assert removed_checks(page) and long_lines(page) and page_setup(page)
    assert numeric_font_sizes(page) == ["ax.set_title('t', fontsize=10)"]
    assert not has_self_check(page)


@pytest.mark.parametrize("line", [
    "ax.text(0, 0, 'a', fontsize=8)", "ax.legend(fontsize=10.5)", "ax.text(0, 0, 'a', size=9)",
    "ax.set_title('t', fontsize='9')", "ax.tick_params(labelsize=8)", "plt.rc('font', size=9)",
    "plt.rc('axes', titlesize=10)", "plt.rcParams['font.size'] = 9",
    "mpl.rcParams['legend.fontsize'] = 8", "plt.rcParams.update({'font.size': 9})",
    "ax.legend(prop={'size': 8})", "label.set_fontsize(9)", "style = dict(fontsize=8)",
    "%matplotlib inline\nax.text(0, 0, 'a', fontsize=8)",
])
def test_the_font_size_rule_can_fail(tmp_path, line):
    page = tmp_path / "p.md"
    page.write_text(f"```{{code-cell}} python\n:tags: [remove-cell]\n{line}\n```\n")
    assert numeric_font_sizes(page) == [line.splitlines()[-1]]


def test_the_font_size_rule_takes_relative_sizes_and_shapes():
    assert not font_sizes("ax.legend(fontsize='small')\nax.set_title('t', size='large')\n"
                          "torch.randint(0, 9, size=(2, 3))\nrng.integers(9, size=4)\n"
                          "plt.plot(xs, markersize=3)\npool = BlockPool(c, block_size=4)\n")


PACKAGE = sorted((ROOT / "kvdoc").rglob("*.py"))


def test_package_figures_take_the_rc_font_sizes():
    assert len(PACKAGE) > 20  # the glob found the package
    broken = {p.relative_to(ROOT).as_posix(): lines for p in PACKAGE
              if (lines := font_sizes(p.read_text()))}
    assert not broken, broken


def test_the_package_font_size_rule_can_fail():
    assert font_sizes(inspect.getsource(_bad_figure)) == ['ax.text(0, 0, "x", fontsize=8)']


def _bad_figure(ax):  # what test_package_figures_take_the_rc_font_sizes catches in kvdoc/
    ax.text(0, 0, "x", fontsize=8)


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


# A version of torch or transformers named on a page or in the README is the one this build
# runs (the pins in constraints.txt), at the precision the text gives; a link into transformers'
# code names that release's tag. Other systems (vLLM, SGLang) are releases read, not installed.
TYPED_VERSION = re.compile(r"\b(transformers|torch|PyTorch) v?(\d+\.\d+(?:\.\d+)?)\b")
TRANSFORMERS_TAG = re.compile(r"huggingface/transformers/(?:blob|tree)/v(\d+\.\d+\.\d+)/")


def typed_versions(text: str) -> list[str]:
    """The torch and transformers versions ``text`` names that are not the installed ones."""
    import torch
    import transformers

    installed = {"torch": torch.__version__.split("+")[0],
                 "transformers": transformers.__version__}
    named = [(lib.lower().replace("pytorch", "torch"), version)
             for lib, version in TYPED_VERSION.findall(text)]
    named += [("transformers", version) for version in TRANSFORMERS_TAG.findall(text)]
    return [f"{lib} {version} (this build: {installed[lib]})" for lib, version in named
            if not (installed[lib] == version or installed[lib].startswith(version + "."))]


def test_typed_versions_are_the_ones_the_build_runs():
    texts = [p for p in DOCS.rglob("*.md") if "_build" not in p.parts] + [ROOT / "README.md"]
    wrong = {str(p.relative_to(ROOT)): w for p in texts if (w := typed_versions(p.read_text()))}
    assert not wrong, wrong


def test_the_version_rule_can_fail():
    import torch

    assert typed_versions("torch 1.0, PyTorch 1.0.1 and transformers 5.24") == [
        f"torch 1.0 (this build: {torch.__version__.split('+')[0]})",
        f"torch 1.0.1 (this build: {torch.__version__.split('+')[0]})"]
    assert typed_versions("huggingface/transformers/blob/v4.0.0/src") != []
