"""The notebook a page offers for download, written so that Jupyter shows what the page shows.

MyST-NB's executed notebook keeps each prose cell as MyST source: ``{glue:text}`` placeholders
where the page prints a computed figure, roles such as ``{term}`` and ``{doc}``, ``:::``
admonitions, ``{glue:figure}`` and ``{literalinclude}`` fences, links to ``.md`` files. Jupyter
renders none of them, so a downloaded notebook would lose every number its prose cites.
:func:`readable_notebook` rewrites the prose cells into plain Markdown: glued values written in
(formatted as the page formats them), figures embedded, included code copied in, roles turned
into their text, admonitions into block quotes, links pointed at the sibling notebooks.
:func:`leftovers` lists any MyST construct that survived; the build fails on one.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from myst_nb.core.variables import format_plain_text

ROLE = re.compile(r"\{(?P<role>[a-z][a-z:-]*)\}`(?P<body>[^`]*)`")
FENCE = re.compile(r"^(?P<mark>`{3,}|:{3,})\{(?P<name>[a-z][a-z:-]*)\}[ \t]*(?P<arg>.*)$")
LINK = re.compile(r"\]\((?P<path>[^)#\s]+)\.md(?P<anchor>#[^)\s]*)?\)")
TARGET = re.compile(r"^\([A-Za-z0-9_.:-]+\)=\s*$")
CODE_ROLES = {"mod", "class", "func", "meth", "data", "attr", "obj", "exc", "py:mod",
              "py:class", "py:func", "py:meth", "py:data", "py:attr", "py:obj", "py:exc"}


def glued_outputs(notebook: dict, glue_file: dict | None = None) -> dict[str, dict[str, Any]]:
    """The data of every ``glue(...)`` value, by key: from the notebook's outputs and from the
    ``<page>.glue.json`` MyST-NB writes beside it (where ``display=False`` values go)."""
    out = {key: output.get("data", {}) for key, output in (glue_file or {}).items()}
    for cell in notebook.get("cells", []):
        for output in cell.get("outputs", []):
            name = output.get("metadata", {}).get("scrapbook", {}).get("name")
            if name is not None:
                out[name] = output.get("data", {})
    return out


def _text_and_target(body: str) -> tuple[str, str]:
    """``"words <target>"`` -> (words, target); ``"target"`` -> (target, target)."""
    m = re.fullmatch(r"\s*(.*?)\s*<([^<>]+)>\s*", body, re.S)
    return (m.group(1), m.group(2)) if m else (body, body)


def _role(role: str, body: str, glued: dict, link: Callable[[str], str | None]) -> str:
    if role in ("glue", "glue:text", "glue:md"):
        # key:format (a format spec for text, "myst" or "commonmark" for Markdown)
        key, _, spec = body.rpartition(":") if ":" in body else (body, "", "")
        data = glued.get(key)
        if data is None:  # the page's build has warned of it: left as is, and warned of again
            return f"{{{role}}}`{body}`"
        if role == "glue:md" and "text/markdown" in data:
            return "".join(data["text/markdown"])
        return format_plain_text("".join(data["text/plain"]), spec or "s")
    text, target = _text_and_target(body)
    if role in CODE_ROLES:
        name = text.lstrip("~")
        return f"`{name.rsplit('.', 1)[-1] if text.startswith('~') else name}`"
    if role == "doc":
        href = link(target)
        shown = text if text != target else Path(target).name
        return f"[{shown}]({href})" if href else shown
    if role == "math":
        return f"${body}$"
    return text  # term, ref, abbr, and the rest: the words the page shows


def _figure(key: str, options: dict[str, str], caption: str, glued: dict) -> list[str]:
    data = glued[key]
    alt = options.get("alt", "").replace('"', "&quot;")
    for mime in ("image/svg+xml", "image/png"):
        if mime in data:
            payload = "".join(data[mime])
            if mime == "image/svg+xml":
                import base64

                payload = base64.b64encode(payload.encode()).decode()
            img = f'<img alt="{alt}" src="data:{mime};base64,{payload.strip()}">'
            return [img, "", f"*{caption.strip()}*" if caption.strip() else ""]
    return [f"*{caption.strip()}*"]


def _included(arg: str, options: dict[str, str], source_dir: Path) -> list[str]:
    path = (source_dir / arg.strip()).resolve()
    text = path.read_text(encoding="utf-8")
    if "pyobject" in options:
        tree = ast.parse(text)
        parts = options["pyobject"].split(".")
        nodes = tree.body
        node = None
        for part in parts:
            node = next(n for n in nodes if getattr(n, "name", None) == part)
            nodes = getattr(node, "body", [])
        lines = text.splitlines()
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        text = "\n".join(lines[start - 1:node.end_lineno])
    return ["```python", *text.rstrip("\n").splitlines(), "```"]


def plain_markdown(text: str, glued: dict, link: Callable[[str], str | None],
                   source_dir: Path) -> str:
    """One prose cell of MyST as plain Markdown (see the module's docstring).

    ``link(docpath)`` is the href for a page of the site (None: no notebook to link to);
    ``source_dir`` is the folder of the page's source, for ``literalinclude`` paths.
    """
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            mark, name, arg = fence["mark"], fence["name"], fence["arg"]
            body, i = [], i + 1
            while i < len(lines) and lines[i].strip() != mark:
                body.append(lines[i])
                i += 1
            i += 1
            options = {}
            while body and re.match(r"^:[a-z-]+:", body[0]):
                key, _, value = body.pop(0)[1:].partition(":")
                options[key] = value.strip()
            inner = "\n".join(body)
            if name == "glue:figure":
                block = _figure(arg.strip(), options, plain_markdown(
                    inner, glued, link, source_dir), glued)
            elif name == "literalinclude":
                block = _included(arg, options, source_dir)
            elif name in ("raw", "toctree"):
                block = []  # interactive HTML, the site's navigation: only the site has them
            elif name in ("math",):
                block = ["$$", inner.strip(), "$$"]
            elif name in ("doctest", "code-block", "code"):
                block = [f"```{arg.strip() or 'python'}", *body, "```"]
            else:  # admonitions and the like: a block quote under its title
                title = arg.strip() or name.capitalize()
                converted = plain_markdown(inner, glued, link, source_dir)
                block = [f"> **{_roles(title, glued, link)}**", ">",
                         *[f"> {row}".rstrip() for row in converted.splitlines()]]
            out.extend([*block, ""])
            continue
        if TARGET.match(line):
            i += 1
            continue
        out.append(_roles(line, glued, link))
        i += 1
    return "\n".join(out)


def _roles(line: str, glued: dict, link: Callable[[str], str | None]) -> str:
    line = ROLE.sub(lambda m: _role(m["role"], m["body"], glued, link), line)

    def md_link(m: re.Match) -> str:
        href = link(m["path"])
        return f"]({href}{m['anchor'] or ''})" if href else f"]({m['path']}.html)"
    return LINK.sub(md_link, line)


def leftovers(notebook: dict) -> list[str]:
    """MyST constructs still in the notebook's prose cells (the build fails on any)."""
    found = []
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        text = "".join(cell.get("source", []))
        found += [m.group(0) for m in ROLE.finditer(text)]
        found += [m.group(0) for m in map(FENCE.match, text.splitlines()) if m]
    return found


def readable_notebook(notebook: dict, page: str, srcdir: Path,
                      glue_file: dict | None = None) -> dict:
    """The notebook with its prose cells in plain Markdown; ``page`` is its docname (e.g.
    ``part3/6-memory``), ``srcdir`` the site's source folder, ``glue_file`` the contents of
    its ``.glue.json``."""
    glued = glued_outputs(notebook, glue_file)
    here = (srcdir / page).parent

    def link(target: str) -> str | None:
        doc = (here / target).resolve() if not target.startswith("/") else srcdir / target[1:]
        source = doc.with_suffix(".md")
        if not source.is_file():
            return None
        rel = Path(*([".."] * len(Path(page).parent.parts)), doc.relative_to(srcdir))
        is_notebook = "file_format: mystnb" in source.read_text(encoding="utf-8")[:200]
        return rel.with_suffix(".ipynb" if is_notebook else ".html").as_posix()

    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "markdown":
            text = plain_markdown("".join(cell["source"]), glued, link, here)
            cell["source"] = text.splitlines(keepends=True)
        elif "outputs" in cell:
            cell["outputs"] = joined_text(merged_streams(cell["outputs"]))
    return notebook


def joined_text(outputs: list[dict]) -> list[dict]:
    """Outputs with each text (a stream's, a ``text/...`` or SVG value) as one string.

    nbformat stores multi-line text as a string or a list of lines, and the two are the same
    notebook; a page served from jupyter-cache comes back with lists where a fresh run wrote
    strings, so without this a cached build's download differs from a fresh build's.
    """
    def one(value: object) -> object:
        return "".join(value) if isinstance(value, list) else value

    for output in outputs:
        if "text" in output:
            output["text"] = one(output["text"])
        data = output.get("data", {})
        for mime in data:
            if mime.startswith("text/") or mime == "image/svg+xml":
                data[mime] = one(data[mime])
    return outputs


def merged_streams(outputs: list[dict]) -> list[dict]:
    """A cell's outputs with each stream (stdout, stderr) in one output, as the page shows it.

    A cell that prints as it goes (progress lines) sends several stream outputs. MyST-NB's
    ``nb_merge_streams`` appends the later ones to the first *in place* while rendering, yet
    keeps them in the executed notebook, so the notebook would print them twice: a later
    output that the first already ends with is dropped, any other appended to it.
    """
    def text(output: dict) -> str:
        raw = output.get("text", "")
        return raw if isinstance(raw, str) else "".join(raw)

    first: dict[str, dict] = {}
    later: dict[str, list[str]] = {}
    kept = []
    for output in outputs:
        name = output.get("name") if output.get("output_type") == "stream" else None
        if name is None or name not in first:
            kept.append(output)
            if name is not None:
                first[name], later[name] = output, []
        else:
            later[name].append(text(output))
    for name, texts in later.items():
        head = text(first[name])
        tail = "".join(t.rstrip() + "\n" for t in texts if t.rstrip())
        if tail and not head.endswith(tail):
            first[name]["text"] = head.rstrip() + "\n" + tail
    return kept
