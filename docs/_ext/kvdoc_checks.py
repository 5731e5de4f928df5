"""Site checks that Sphinx does not make by itself; each is a warning, so ``-W`` fails the build.

- Every image has alt text: a ``{figure}``/``{image}`` with ``:alt:``, or a ``{glue:figure}``
  with ``:alt:``. The warning names the page and line, and the image.
- Every figure holds an image: a ``{glue:figure}`` of a matplotlib figure glued as text only
  (``<Figure size ...>``, e.g. when the kernel's backend is not the inline one) is an error.
"""

from __future__ import annotations

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)


def _located(node: nodes.Node) -> nodes.Node:
    """The node itself or its nearest ancestor that knows its line (output images do not)."""
    while node.line is None and node.parent is not None:
        node = node.parent
    return node


def check_figures(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    """Warn about every image of ``docname`` without alt text, and every figure without an image."""
    for image in doctree.findall(nodes.image):
        if not str(image.get("alt", "")).strip():
            uri = image.get("uri", "?")
            logger.warning(f"image without alt text in {docname}: {uri}; add :alt: to its figure",
                           location=_located(image), type="kvdoc", subtype="alt")
    for figure in doctree.findall(nodes.figure):
        if not any(True for _ in figure.findall(nodes.image)):
            logger.warning(f"figure without an image in {docname}: {figure.astext()[:80]!r}; "
                           "was it glued as text (a non-inline matplotlib backend)?",
                           location=figure, type="kvdoc", subtype="figure")


def setup(app: Sphinx) -> dict:
    app.connect("doctree-resolved", check_figures)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
