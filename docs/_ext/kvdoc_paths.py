"""Reading paths: every page of a path gets that path's own previous and next links.

The paths are docs/_ext/paths.json (the landing page lists them from the same file). A page on
one or more paths carries, above and below its text, one ``nav.kvdoc-path`` per path: its place
on the path and links to the path's previous and next pages, each with ``?path=NAME``. They are
hidden until kvdoc-paths.js sees which path the reader chose (the ``?path=`` of the address, or
the last one chosen in this tab); it then shows that path's links and hides the theme's
previous/next, which follow the book's order instead of the path's. A static site, no server.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

PATHS_FILE = Path(__file__).with_name("paths.json")


def load_paths() -> dict[str, dict]:
    """``{name: {"title": ..., "pages": [docname, ...]}}`` from paths.json."""
    return json.loads(PATHS_FILE.read_text(encoding="utf-8"))


def _link(app, pagename: str, target: str, name: str, rel: str, label: str) -> str:
    href = app.builder.get_relative_uri(pagename, target) + f"?path={name}"
    # a page left out of a partial build (KVDOC_PAGES) has no title: its name stands in
    title = html.escape(app.env.titles[target].astext() if target in app.env.titles else target)
    return f'<a class="kvdoc-path-{rel}" rel="{rel}" href="{html.escape(href)}">{label} {title}</a>'


def path_navs(app, pagename: str) -> str:
    """The hidden navigation blocks of every path ``pagename`` is on (empty if none)."""
    navs = []
    for name, path in load_paths().items():
        pages = path["pages"]
        if pagename not in pages:
            continue
        at = pages.index(pagename)
        home = app.builder.get_relative_uri(pagename, "index") + "#reading-paths"
        parts = [f'<span class="kvdoc-path-where">Path <a href="{home}">'
                 f'{html.escape(path["title"])}</a>, page {at + 1} of {len(pages)}</span>']
        if at > 0:
            parts.append(_link(app, pagename, pages[at - 1], name, "prev", "←"))
        if at + 1 < len(pages):
            parts.append(_link(app, pagename, pages[at + 1], name, "next", "Next:"))
        else:
            parts.append('<span class="kvdoc-path-end">End of the path</span>')
        navs.append(f'<nav class="kvdoc-path" data-path="{name}" hidden '
                    f'aria-label="reading path {html.escape(path["title"])}">'
                    + " ".join(parts) + "</nav>")
    return "".join(navs)


def _add_navs(app, pagename, templatename, context, doctree):
    if doctree is None or "body" not in context:
        return
    navs = path_navs(app, pagename)
    if navs:
        context["body"] = navs + context["body"] + navs


def setup(app):
    app.add_js_file("kvdoc-paths.js")
    app.connect("html-page-context", _add_navs)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
