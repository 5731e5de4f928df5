"""The landing page's reading times: the word count reads prose, not code or markup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdoc.teach.display import WORDS_PER_MINUTE, page_title, prose_words, reading_minutes

DOCS = Path(__file__).resolve().parent.parent / "docs"

PAGE = """---
file_format: mystnb
kernelspec:
  name: python3
---

# Four words of title

Some prose with a {term}`glossary term` and a [link](part1/index.md).

```{code-cell} python
:tags: [remove-cell]
these words are code and never counted
```

:::{admonition} Answer
:class: dropdown
Three more words.
:::

````{note}
Two here.
```python
not prose either
```
````

```sh
make html
```
"""


def test_prose_words_count_prose_only():
    # title 4 + "Some prose with a glossary term and a link" 9 + 1 "Answer" + 3 + 2
    assert prose_words(PAGE) == 4 + 9 + 1 + 3 + 2


@pytest.mark.parametrize("code", ["```{code-cell} python\n", "```python\n", "```{doctest}\n"])
def test_code_adds_nothing(code: str):
    block = code + "a b c d e f g h\n```\n"
    assert prose_words(PAGE + block) == prose_words(PAGE)
    assert prose_words(PAGE + "Plain prose.\n") == prose_words(PAGE) + 2  # the check can fail


def test_minutes_round_up(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text("# t\n\n" + "word " * (WORDS_PER_MINUTE - 1))  # one minute's words
    assert reading_minutes([page]) == 1
    page.write_text("# t\n\n" + "word " * WORDS_PER_MINUTE)
    assert reading_minutes([page]) == 2
    assert page_title(page) == "t"


def paths() -> dict[str, dict]:
    return json.loads((DOCS / "_ext" / "paths.json").read_text(encoding="utf-8"))


def test_the_reading_paths_name_real_pages_once():
    found = paths()
    assert set(found) == {"new", "generate", "serving"}
    for name, path in found.items():
        pages = path["pages"]
        assert [p for p in pages if not (DOCS / f"{p}.md").is_file()] == [], name
        assert len(set(pages)) == len(pages), name  # a page twice would have two "next"s


def test_the_landing_page_lists_each_path_and_offers_the_tour_first():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for name in paths():
        assert f"```{{glue}} path-{name}-pages\n```" in index, name  # a list, not a paragraph
    assert index.index("(tour.md)") < index.index("path-new-pages")
    # someone sizing a deployment starts where their own model's numbers are
    assert paths()["serving"]["pages"][0] == "reference/calculator"


def test_the_tour_reads_in_under_ten_minutes():
    tour = DOCS / "tour.md"
    assert reading_minutes([tour]) < 10, prose_words(tour.read_text(encoding="utf-8"))
