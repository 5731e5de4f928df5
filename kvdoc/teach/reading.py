"""Reading times for the landing page's reading paths: the words of a MyST page a reader reads
(:func:`prose_words`), its title, and the minutes for a list of pages (:func:`reading_minutes`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path

#: Words a minute behind the landing page's reading times: MyST's own default for its reading
#: time (myst-parser's ``words_per_minute``), a common figure for technical prose.
WORDS_PER_MINUTE = 200

_FENCE = re.compile(r"^(`{3,}|~{3,}|:{3,})\s*(?:\{([\w:.-]+)\})?\s*(\S*)")
# Fenced blocks a reader does not read as prose: code, doctests, raw reST, the table of contents.
_NOT_PROSE = {"code-cell", "code-block", "code", "doctest", "eval-rst", "toctree", "raw"}
_ROLE = re.compile(r"\{[\w:.-]+\}`([^`]*)`")  # {glue:text}`key`, {term}`logits`: the content
_LINK_TARGET = re.compile(r"\]\([^)]*\)")  # [text](target): the text
_WORD = re.compile(r"[^\W_]+(?:['\u2019-][^\W_]+)*")


def prose_words(text: str) -> int:
    r"""Words of a MyST page a reader reads: its front matter, code cells, other fenced code,
    doctests, raw reST and the table of contents left out, as are directive options and the
    syntax of roles and links; a glued value counts as one word, maths as its symbols.

    >>> prose_words("---\nkernelspec: {}\n---\n# A title\n\n```{code-cell} python\n"
    ...             "x = 1\n```\n\nThe {term}`KV cache` holds [keys](a.md).\n")
    7
    """
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        text = text[end + 5:] if end >= 0 else text
    words = 0
    skipping: str | None = None  # the fence of the code block being skipped
    kept: list[str] = []  # fences of the open directives whose content is prose (admonitions)

    def closes(stripped: str, marker: str) -> bool:
        return len(stripped) >= len(marker) and set(stripped) == {marker[0]}

    for line in text.splitlines():
        stripped = line.strip()
        if skipping is not None:
            if closes(stripped, skipping):
                skipping = None
            continue
        fence = _FENCE.match(stripped)
        if fence:
            marker, directive, info = fence.groups()
            if kept and directive is None and not info and closes(stripped, kept[-1]):
                kept.pop()
            elif directive is None or directive in _NOT_PROSE:
                skipping = marker  # code (with or without a language), or a non-prose block
            else:  # an admonition, a note, a figure: its title and content are prose
                kept.append(marker)
                words += len(_WORD.findall(stripped.split("}", 1)[1]))
            continue
        if re.match(r"^:[\w-]+:", stripped):
            continue  # a directive's option (:class: dropdown, :tags: [...])
        words += len(_WORD.findall(_LINK_TARGET.sub("]", _ROLE.sub(r"\1", line))))
    return words


def page_title(path: Path) -> str:
    """The title of a MyST page: its first level-one heading (``#`` and a space)."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    raise ValueError(f"{path} has no '# ' title")


def reading_minutes(pages: Iterable[Path]) -> int:
    """Minutes to read ``pages`` (MyST files) at :data:`WORDS_PER_MINUTE`, rounded up."""
    total = sum(prose_words(Path(p).read_text(encoding="utf-8")) for p in pages)
    return math.ceil(total / WORDS_PER_MINUTE)
