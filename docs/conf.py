"""Sphinx configuration for the kvdoc site.

Every page under docs/ is a MyST-NB text notebook executed at build time. The build is
strict: a cell that raises, a cell that runs past the timeout, a missing glue key or any
other warning fails it (the Makefile passes -W --keep-going).
"""

from __future__ import annotations

import builtins
import json
import os
import sys
from importlib.metadata import version as _metadata_version
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE / "_ext"))

project = "kvdoc"
author = "the kvdoc authors"
copyright = "2026, the kvdoc authors"
# The installed package's metadata (pyproject.toml's version), so a page never names a version
# that the package it documents is not; shown in every page's footer (html_theme_options).
release = version = _metadata_version("kvdoc")

extensions = [
    "myst_nb",  # also provides the MyST parser; do not add myst_parser beside it
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",  # [source] links in the API reference, to pages in the site itself
    "sphinx_copybutton",
    # collapses the "Check yourself" answers (admonitions with :class: dropdown) until the reader
    # opens them; without it the theme prints them open. Its script and CSS ship in the wheel.
    "sphinx_togglebutton",
    "kvdoc_checks",  # docs/_ext: every image needs alt text
    "kvdoc_paths",  # docs/_ext: each reading path's own previous/next on its pages
]

exclude_patterns = [
    "_build", "_static", "_ext", "_templates", "_ipython", "**.ipynb_checkpoints", "README.md",
]

# Working on one page: KVDOC_PAGES="part2/2-operations part3/*" builds the landing page, the
# on-ramp (the part indexes link to it), the part indexes, the reference pages that run no code
# (every page may link to a glossary term or a reference) and the pages named (globs allowed),
# skipping the rest. Never set in CI.
_ALWAYS = ("index", "attention", "reference/glossary", "reference/references", "reference/names")
if os.environ.get("KVDOC_PAGES"):
    import fnmatch
    import pathlib

    _here = pathlib.Path(__file__).parent
    _wanted = os.environ["KVDOC_PAGES"].split()
    for _path in _here.rglob("*.md"):
        _doc = _path.relative_to(_here).with_suffix("").as_posix()
        if _doc.startswith("_build") or _doc in _ALWAYS or _doc.endswith("/index"):
            continue
        if not any(fnmatch.fnmatch(_doc, pattern) for pattern in _wanted):
            exclude_patterns.append(_doc + ".md")
    # a link into a skipped page has no target in this build (CI builds every page and keeps it)
    suppress_warnings = ["toc.excluded", "toc.not_readable", "myst.xref_missing", "ref.doc"]
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["kvdoc.css"]  # small dependency maps (kvdoc.teach.dependency_maps.map_table)

# --- notebooks -------------------------------------------------------------------------
# Cached locally (jupyter-cache re-runs a page only when its code changes); forced in CI,
# where every page runs from scratch, and by KVDOC_EXECUTE=force (make numeric-check).
_force = os.environ.get("CI") or os.environ.get("KVDOC_EXECUTE") == "force"
nb_execution_mode = "force" if _force else "cache"
# A cell that raises becomes a warning carrying the page name and the cell's traceback, and
# -W turns it into a failed build. (raise_on_error=True would abort without the traceback.)
nb_execution_raise_on_error = False
nb_execution_timeout = int(os.environ.get("KVDOC_CELL_TIMEOUT", "600"))  # seconds per cell
nb_merge_streams = True
# The kernels read docs/_ipython/profile_default/ipython_kernel_config.py (quiet start-up).
os.environ["IPYTHONDIR"] = str(Path(__file__).parent / "_ipython")
# Markdown outputs (the tables pages build with IPython.display.Markdown) are parsed as MyST:
# pipe tables and $maths$ render; CommonMark, the default, has no tables.
nb_render_markdown_format = "myst"
nb_execution_show_tb = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "substitution"]
myst_heading_anchors = 3

# Reproducible output: the kernel inherits this environment. A fixed hash seed makes set and
# dict-of-str ordering (and so anything printed from them) the same from build to build; the
# matplotlibrc beside the extension fixes matplotlib's SVG ids (svg.hashsalt).
os.environ["PYTHONHASHSEED"] = "0"
# A long cell's progress lines (kvdoc.teach.sweep_record.progress) go to the page and to this
# build's own standard error, so that the build log shows them as they happen; a kernel's own
# output goes only to its notebook.
if "KVDOC_BUILD_LOG" not in os.environ and Path(f"/proc/{os.getpid()}/fd/2").exists():
    os.environ["KVDOC_BUILD_LOG"] = f"/proc/{os.getpid()}/fd/2"
os.environ["MATPLOTLIBRC"] = str(_HERE / "_ext" / "matplotlibrc")

# --- API reference ---------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# A module-level value's repr is printed in its signature, and a few are paths of the checkout
# that built the site (kvdoc.teach.sweep_record.PACKAGE, found from __file__) or hold them (a
# module's repr names its file): on the site they would show this machine's folders, which are
# not the reader's. Such a value is dropped from the signature; its docstring still says what it
# is. tests/test_site.py fails on any page that still contains one of these paths.
_MACHINE_PATHS = tuple(sorted({str(_HERE.parent), str(_HERE.parent.absolute()), sys.prefix,
                               str(Path(sys.prefix).resolve())}))


def _drop_machine_values(app, doctree):
    from sphinx import addnodes

    for annotation in list(doctree.findall(addnodes.desc_annotation)):
        text = annotation.astext()
        if isinstance(annotation.parent, addnodes.desc_signature) and any(
                path in text for path in _MACHINE_PATHS):
            annotation.parent.remove(annotation)


# `-> bytes` in a signature or a field list is a cross-reference to "bytes", which Python's domain
# resolves to any documented attribute of that name
# (kvdoc.parallel.comparison.Comparison.bytes), and warns when there are two: a builtin type's
# name is left as text that links nowhere.
_BUILTIN_TYPES = frozenset(n for n, v in vars(builtins).items() if isinstance(v, type))


def _builtins_link_nowhere(app, doctree):
    from sphinx import addnodes

    for ref in list(doctree.findall(addnodes.pending_xref)):
        if ref.get("refdomain") == "py" and ref.get("reftarget") in _BUILTIN_TYPES:
            ref.replace_self(ref.children)


# --- doctest builder ---------------------------------------------------------------------
# Only the pages' {doctest} blocks run here; docstring examples pulled in by autodoc are run by
# pytest --doctest-modules in the package's own namespace.
doctest_test_doctest_blocks = ""
doctest_global_setup = """
import torch
torch.manual_seed(0)
"""

# --- HTML ---------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "kvdoc: the KV cache, derived and checked"
html_theme_options = {
    "show_toc_level": 2,
    # The sidebar's tree is two levels deep (sections, their pages). The theme resolves it to
    # depth 4 by default for every page written: the same HTML, a fifth longer a cached build.
    "max_navbar_depth": 2,
    "use_download_button": True,  # .ipynb (see _offer_notebook), .md source, print to PDF
    "use_fullscreen_button": False,
    "extra_footer": f'<p class="kvdoc-version">kvdoc {release}</p>',
}
html_context = {"default_mode": "auto"}  # without it a first visit logs "Got invalid theme mode"
html_favicon = "_static/favicon.svg"  # else browsers ask for /favicon.ico, which does not exist
# Self-contained pages: MathJax is served from _static/mathjax (see its README), never a CDN.
mathjax_path = "mathjax/tex-chtml-full.js"
html_last_updated_fmt = None  # no build timestamps: two builds of one commit should match
copybutton_prompt_text = r">>> |\.\.\. "
copybutton_prompt_is_regexp = True


# --- downloads -------------------------------------------------------------------------------
# The theme offers a page's executed notebook only when a launch service (Binder, Colab) is set,
# and those are external hosts. This offers it without one: the notebook MyST-NB wrote for the
# page is copied beside the page's source in _sources/, without per-cell execution timestamps and
# with numbered cell ids, so two builds write the same file, and with its prose in plain Markdown
# (docs/_ext/kvdoc_notebooks.py), so Jupyter shows the numbers the page shows. Runs before the
# theme's header buttons (priority 501).
def _offer_notebook(app, pagename, templatename, context, doctree):
    from kvdoc_notebooks import leftovers, readable_notebook
    from sphinx.util import logging

    executed = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    if doctree is None or not executed.is_file():
        return
    glue_file = executed.with_suffix(".glue.json")
    notebook = readable_notebook(
        _with_cached_outputs(app, json.loads(executed.read_text(encoding="utf-8"))),
        pagename, Path(app.srcdir),
        json.loads(glue_file.read_text(encoding="utf-8")) if glue_file.is_file() else None)
    left = leftovers(notebook)
    if left:
        logging.getLogger(__name__).warning(
            "the downloadable notebook of %s keeps MyST that Jupyter cannot show: %s",
            pagename, ", ".join(sorted(set(left))), location=pagename)
    for number, cell in enumerate(notebook.get("cells", [])):
        cell.get("metadata", {}).pop("execution", None)
        if "id" in cell:
            cell["id"] = f"cell-{number}"  # MyST-NB draws random cell ids on every build
    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                      encoding="utf-8")
    context["ipynb_source"] = f"{pagename}.ipynb"


def _with_cached_outputs(app, notebook: dict) -> dict:
    # MyST-NB 1.4 writes a page that it served from jupyter-cache without the outputs: it merges
    # them into a copy of the notebook and writes the original. The cache has them.
    config = app.env.mystnb_config
    if config.execution_mode != "cache" or any(
            c.get("outputs") for c in notebook.get("cells", [])):
        return notebook
    import nbformat
    from jupyter_cache import get_cache
    from myst_nb.ext.glue import extract_glue_data_cell

    try:
        _, merged = get_cache(config.execution_cache_path).merge_match_into_notebook(
            nbformat.from_dict(notebook))
    except KeyError:  # not in the cache after all
        return notebook
    for cell in merged.cells:  # glue(..., display=False) records leave, as on a first run
        if cell.cell_type == "code":
            extract_glue_data_cell(cell)
    return json.loads(nbformat.writes(merged))


# --- parallel reads ------------------------------------------------------------------------------
# `sphinx-build -j N` (the Makefile passes it) executes N pages' notebooks at once, each in a
# one-thread kernel (docs/_ipython). Sphinx gives each worker a fixed slice of pages in name order
# (about sqrt(10 pages / N) of them), which put the heavy part3 pages into one slice and left the
# other worker idle; one page per task lets whichever worker is free take the next page.
def _one_page_per_task(docnames, nproc, maxbatch=10):
    return [[name] for name in docnames]


def _before_reading(app, env, docnames):
    import shutil

    import sphinx.builders

    if docnames and app._kvdoc_fresh_records is not None:
        shutil.rmtree(app._kvdoc_fresh_records, ignore_errors=True)

    # Sphinx 9 names the chunking function in its builders module; another version may not.
    if hasattr(sphinx.builders, "make_chunks"):
        app._kvdoc_make_chunks = sphinx.builders.make_chunks
        sphinx.builders.make_chunks = _one_page_per_task
    # jupyter-cache creates its folder and database on first use without a lock (a second worker
    # doing the same at once fails): create them here, before the workers start.
    config = env.mystnb_config
    if config.execution_mode == "cache":
        import hashlib

        from jupyter_cache import get_cache

        # The cache keys a page's outputs on its code alone, but the kernels' settings change
        # them too (docs/_ipython: figures as SVG; docs/_ext/matplotlibrc: their sizes): when
        # those files change, the cache starts empty, so no page keeps outputs made under the
        # old settings.
        cache = Path(config.execution_cache_path)
        profile = _HERE / "_ipython" / "profile_default"
        settings = [profile / "ipython_kernel_config.py", *sorted(profile.glob("startup/*.py")),
                    _HERE / "_ext" / "matplotlibrc"]
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in settings)).hexdigest()
        stamp = cache / "kvdoc-kernel-settings.sha256"
        if cache.exists() and (not stamp.is_file() or stamp.read_text() != digest):
            shutil.rmtree(cache)
        get_cache(config.execution_cache_path).db  # noqa: B018 (creates the database)
        stamp.write_text(digest)


def _after_reading(app, env):
    # Writing keeps Sphinx's own slices: writing a page is quick, a task per page would not be.
    if hasattr(app, "_kvdoc_make_chunks"):
        import sphinx.builders

        sphinx.builders.make_chunks = app._kvdoc_make_chunks


def _viewcode_module(app, modname, attribute):
    """The module whose source page links documented ``modname.attribute``: viewcode's own
    rule (None) for a class or function defined under that name, the documenting module itself
    for anything else (an instance, an alias). viewcode follows an object to its ``__module__``,
    which for an instance (a config, a dtype) or an alias is another module's: that module's
    source page then links back under the anchors of whichever page reached it first (Sphinx 9
    keeps the first), anchors that do not exist and differ between parallel builds; and a
    source page of torch's was written for a dtype."""
    import importlib

    try:
        value = importlib.import_module(modname)
        for name in attribute.split("."):
            value = getattr(value, name)
    except Exception:  # viewcode's own rule reports what it cannot import
        return None
    return None if getattr(value, "__qualname__", None) == attribute else modname


def setup(app):
    # The broken-variant sweep that several pages show runs once a build and is read by every
    # kernel after that (kvdoc.teach.sweep_record): kept beside the build's execution cache
    # (MyST-NB puts jupyter_execute and .jupyter_cache in the output folder's parent), so each
    # build folder (html, numeric, repro/a, repro/b) has its own and `make clean` removes it.
    # A forced build runs every page from scratch, and so the sweep (once): its records go when
    # it starts reading pages (_before_reading), not here, as a builder that reads none (make
    # doctest reuses html's environment) must leave them for the next (make repro-check).
    app._kvdoc_fresh_records = None
    if "KVDOC_RECORDS" not in os.environ:
        records = Path(app.outdir).parent / "records"
        app._kvdoc_fresh_records = records if _force else None
        os.environ["KVDOC_RECORDS"] = str(records)
    app.connect("viewcode-follow-imported", _viewcode_module)
    app.connect("doctree-read", _drop_machine_values)
    app.connect("doctree-read", _builtins_link_nowhere)
    app.connect("html-page-context", _offer_notebook, priority=500)
    app.connect("env-before-read-docs", _before_reading)
    app.connect("env-updated", _after_reading)
