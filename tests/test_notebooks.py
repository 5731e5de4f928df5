"""The downloadable notebooks: prose in plain Markdown, every glued figure written in."""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

from kvdoc_notebooks import (  # noqa: E402
    joined_text,
    leftovers,
    merged_streams,
    readable_notebook,
)

PROSE = """\
(my-target)=
## Bytes

The cache holds {glue:text}`n:,` bytes, {glue:text}`r:.2f` of a {term}`block <block size>`,
per {func}`~kvdoc.core.cache.DynamicCache.update` and {mod}`kvdoc.core`; see
{doc}`../part3/6-memory`, {doc}`the glossary <../reference/glossary>` and
[the mask](../part3/2-offset-mask.md#mask-alignment); {ref}`Another page <sav-roofline>`.

:::{admonition} Check yourself
:class: dropdown
The answer is {glue:text}`n` ({glue:md}`m:myst`).
:::

```{glue:figure} fig
:alt: A line.
:name: fig-line

The caption, {glue:text}`r:.1f`.
```

```{literalinclude} ../../kvdoc/core/cache.py
:pyobject: offset_causal_mask
```
"""


def notebook(prose: str) -> dict:
    return {"cells": [{"cell_type": "markdown", "source": prose.splitlines(keepends=True)},
                      {"cell_type": "code", "source": ["glue('fig', fig)"], "outputs": [
                          {"metadata": {"scrapbook": {"name": "fig"}},
                           "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}}]}]}


def test_prose_becomes_plain_markdown_with_the_figures_the_page_shows():
    glue_file = {"n": {"data": {"text/plain": "1234567"}}, "r": {"data": {"text/plain": "0.456"}},
                 "m": {"data": {"text/markdown": "**bold**", "text/plain": "x"}}}
    nb = readable_notebook(notebook(PROSE), "part1/1-generation", DOCS, glue_file)
    text = "".join(nb["cells"][0]["source"])
    assert leftovers(nb) == [], leftovers(nb)
    assert "holds 1,234,567 bytes, 0.46 of a block," in text
    assert "per `update` and `kvdoc.core`" in text
    # an executed page links to its notebook, a page that runs no code to its HTML
    assert "[6-memory](../part3/6-memory.ipynb)" in text
    assert "[the glossary](../reference/glossary.html)" in text
    assert "](../part3/2-offset-mask.ipynb#mask-alignment)" in text
    assert "Another page" in text and "(my-target)=" not in text
    assert "> **Check yourself**" in text and "> The answer is 1234567 (**bold**)." in text
    assert '<img alt="A line." src="data:image/png;base64,iVBORw0KGgo=">' in text
    assert "*The caption, 0.5.*" in text
    assert "def offset_causal_mask(" in text and "```python" in text


def test_leftovers_names_what_jupyter_cannot_show():
    nb = {"cells": [{"cell_type": "markdown",
                     "source": ["Left {glue:text}`x` and\n", ":::{note}\n", "a\n", ":::\n"]},
                    {"cell_type": "code", "source": ["{glue:text}`y` in code is code"]}]}
    assert leftovers(nb) == ["{glue:text}`x`", ":::{note}"]


def test_a_key_the_page_never_glued_is_left_and_named():
    # the page's cell that glues it raised: the build already fails on that, and the notebook
    # must not hide the cell's error behind a KeyError of its own
    nb = readable_notebook(notebook("Only {glue:text}`gone:,` here."), "p", DOCS, {})
    assert leftovers(nb) == ["{glue:text}`gone:,`"]


def _stream(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def test_streams_a_cell_printed_in_several_outputs_appear_once():
    merged = merged_streams([_stream("a 1/3\na 2/3\na 3/3\n"), _stream("a 2/3\n"),
                             {"output_type": "execute_result", "data": {}},
                             _stream("a 3/3\n"), _stream("warn\n", "stderr")])
    assert [o.get("name") for o in merged] == ["stdout", None, "stderr"]
    assert merged[0]["text"] == "a 1/3\na 2/3\na 3/3\n"  # MyST-NB had merged them already
    merged = merged_streams([_stream("a 1/3\n"), _stream("a 2/3\n"), _stream("a 3/3\n")])
    assert [o["text"] for o in merged] == ["a 1/3\na 2/3\na 3/3\n"]  # merged here


def test_a_cached_and_a_fresh_run_give_the_same_outputs():
    cached = [{"output_type": "stream", "name": "stdout", "text": ["a\n", "b\n"]},
              {"output_type": "execute_result", "data": {"text/plain": ["{'x':\n", " 1}"],
                                                         "application/json": [1, 2]}}]
    fresh = [{"output_type": "stream", "name": "stdout", "text": "a\nb\n"},
             {"output_type": "execute_result", "data": {"text/plain": "{'x':\n 1}",
                                                        "application/json": [1, 2]}}]
    assert joined_text(cached) == fresh

