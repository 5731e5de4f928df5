"""The built site holds in a reader's browser: headless Chromium, network limited to a local server.

For each page: no request to any host but the local server, no failed request, no console error,
every maths element rendered by the site's own MathJax, every image loaded (and with alt text),
every answer (a ``:class: dropdown`` admonition) and hidden code cell closed as rendered (none of
its text visible until the reader opens it, and some once opened), no path of the machine
that built the site in the page, and nothing that makes the page wider than a 412 px phone (a
wide table scrolls inside its own box).

- ``test_browser_check_catches_a_bad_page``: the check itself can fail (a page that breaks every
  rule).
- ``test_throwaway_site_holds``: a one-page site built with the project's conf.py, _ext and
  _static (maths, a glued figure, code) passes: the configuration makes self-contained pages,
  and the download button's notebook is part of the site.
- ``test_compare_builds_exempts_timing_pages_only``: the reproducibility comparison of
  ``make repro-check`` (scripts/compare_builds.py; ``.ci/run`` runs it on the whole site) flags
  any difference except on the timing pages.
- ``test_every_built_page``: every page of the built site (``$KVDOC_SITE``, default
  docs/_build/html). ``make test`` runs it after ``make html`` (``make site-check``); ``make
  pytest`` deselects it, because the site is not built yet then.

Without Chromium these tests are skipped with a loud reason outside CI, and fail under CI
(``CI`` set), where ``.ci/run`` installs it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_docs_build import make

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kvdoc_browser", ROOT / "scripts" / "browser.py")
browser = importlib.util.module_from_spec(_spec)
sys.modules["kvdoc_browser"] = browser
_spec.loader.exec_module(browser)
_spec = importlib.util.spec_from_file_location(
    "kvdoc_compare_builds", ROOT / "scripts" / "compare_builds.py")
compare_builds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_builds)


def chromium() -> str:
    """The Chromium executable, or a loud skip (outside CI) / failure (under CI) without one."""
    exe = browser.find_chromium()
    if exe is None:
        message = f"BROWSER TEST NOT RUN: Chromium not found; {browser.INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        sys.stderr.write(f"\n*** {message} ***\n")
        pytest.skip(message)
    return exe


BAD_PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>bad</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<script src="https://cdn.example.org/mathjax.js"></script>
</head><body>
<p>Inline maths that nothing renders: <span class="math">\(x^2\)</span></p>
<img src="_images/missing.png" alt="a figure that is not there">
<img src="ok.svg">
<script>console.error("boom from the page");</script>
<div class="dropdown admonition"><p class="admonition-title">Answer</p>
<p>An answer printed open under its question.</p></div>
<details class="hide above-input"><summary>Show code cell source</summary>
<div class="cell_input">a hidden cell, closed until clicked</div></details>
<details class="hide above-input"><summary>Show code cell source</summary></details>
<div style="width: 900px">a line of fixed width, wider than a phone</div>
<div style="overflow-x: auto"><table style="width: 900px"><tr><td>scrolls in its box</td></tr>
</table></div>
<p>default: &lt;module 'kvdoc.measure.bench' from '/build/clone/kvdoc/measure/bench.py'&gt;</p>
</body></html>
"""
OK_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4">'
          '<rect width="4" height="4"/></svg>')


def test_browser_check_catches_a_bad_page(tmp_path):
    exe = chromium()
    (tmp_path / "index.html").write_text(BAD_PAGE)
    (tmp_path / "ok.svg").write_text(OK_SVG)
    report = browser.check_site(tmp_path, exe, forbidden=("/build/clone", "/elsewhere"))
    (page,) = report.pages
    assert page.external == ["https://cdn.example.org/mathjax.js"], page
    assert any("missing.png" in f and "404" in f for f in page.failed), page
    assert any("boom from the page" in e for e in page.console_errors), page
    assert (page.maths, page.maths_unrendered, page.mathjax_loaded) == (1, 1, False), page
    assert page.images == 2, page
    assert [u.rsplit("/", 1)[1] for u in page.images_broken] == ["missing.png"], page
    assert [u.rsplit("/", 1)[1] for u in page.images_without_alt] == ["ok.svg"], page
    # The answer is shown open (nothing collapses it); the closed cell passes; the empty one
    # shows nothing when opened.
    assert page.openables == 3, page
    assert page.shown_closed == ["answer: An answer printed open under its question."], page
    assert page.not_opening == ["hidden cell: "], page
    assert page.forbidden == ["/build/clone"], page
    # The fixed-width line widens the page on a phone; the table in its own scroll box does not.
    assert page.phone_overflow > 400, page
    assert page.phone_culprits == ['<div class=""> a line of fixed width, wider than a phone'], page
    assert len(page.problems()) >= 10 and report.failures


PAGE = textwrap.dedent("""\
    ---
    file_format: mystnb
    kernelspec:
      name: python3
      display_name: Python 3
    ---

    # Throwaway

    Inline $a^2 + b^2 = c^2$ and display maths with an AMS environment:

    $$
    \\operatorname{softmax}\\!\\left(\\frac{QK^\\top}{\\sqrt{d_k}}\\right) V
    $$

    ```{code-cell} python
    import matplotlib.pyplot as plt
    from myst_nb import glue

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1, 2], [0, 1, 4])
    ax.set_xlabel("tokens")
    ax.set_ylabel("bytes")
    glue("fig-line", fig, display=False)
    plt.close(fig)
    ```

    ```{glue:figure} fig-line
    :alt: a rising line
    :name: fig-line

    A line.
    ```
    """)


def build_site(src: Path, build: Path) -> Path:
    """Build ``src`` with the Makefile's own html target, as CI does; returns the HTML folder."""
    result = subprocess.run(
        [*make("html"), f"DOCS={src}", f"BUILDDIR={build}"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "CI": "true"})
    assert result.returncode == 0, result.stdout + result.stderr
    return build / "html"


def site_sources(tmp_path: Path) -> Path:
    """A source folder with the site's configuration, extensions and static files, no pages."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "docs" / "conf.py", src / "conf.py")
    for folder in ("_ext", "_static", "_templates", "_ipython"):
        if (ROOT / "docs" / folder).is_dir():
            shutil.copytree(ROOT / "docs" / folder, src / folder)
    return src


@pytest.mark.sphinx
def test_throwaway_site_holds(tmp_path):
    exe = chromium()
    src = site_sources(tmp_path)
    (src / "index.md").write_text(PAGE)
    site = build_site(src, tmp_path / "build")
    # The download button offers the executed notebook, served from the site itself.
    notebook = json.loads((site / "_sources" / "index.ipynb").read_text())
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert len(code) == 1 and "fig-line" in "".join(code[0]["source"])  # this page's cell
    assert not any("execution" in c["metadata"] for c in notebook["cells"])  # no timestamps
    assert 'href="_sources/index.ipynb"' in (site / "index.html").read_text()
    report = browser.check_site(site, exe)
    assert not report.failures, report.failures
    index = next(p for p in report.pages if p.url.endswith("/index.html"))
    assert index.mathjax_loaded and index.maths == 2 and index.maths_unrendered == 0, index
    assert index.images == 1 and not index.images_broken, index
    assert any("/_static/mathjax/" in u for u in index.requests), index.requests  # ours, not a CDN


def test_compare_builds_exempts_timing_pages_only(tmp_path):
    def site(name: str, timing: str, other: str) -> Path:
        root = tmp_path / name
        (root / "part3").mkdir(parents=True)
        (root / "_images").mkdir()
        (root / "index.html").write_text(f"<p>{other}</p>")
        (root / "part3" / "7-savings.html").write_text(
            f'<p>{timing} ms</p><img src="../_images/{timing}.png">')
        (root / "_images" / f"{timing}.png").write_text(timing)
        return root

    a, b = site("a", "1.5", "same"), site("b", "1.7", "same")
    problems, notes = compare_builds.compare(a, b, timing_pages=("part3/7-savings.html",))
    assert problems == [] and notes == ["exempt (shows timings): part3/7-savings.html"]
    _, notes = compare_builds.compare(a, b, timing_pages=("part3/7-savings.html", "gone.html"))
    assert notes[1].startswith("note: exempt page gone.html is not in the build")
    c = site("c", "1.5", "changed")
    problems, _ = compare_builds.compare(a, c, timing_pages=("part3/7-savings.html",))
    assert [p.split(":")[0] for p in problems] == ["index.html"]
    problems, _ = compare_builds.compare(a, b, timing_pages=())  # nothing exempt: both show
    assert sorted(p.split(":")[0] for p in problems) == [
        "_images/1.5.png", "_images/1.7.png", "part3/7-savings.html"]


def test_every_built_page():
    """Every page of the built site; run by ``make site-check`` (part of ``make test``)."""
    site = Path(os.environ.get("KVDOC_SITE", ROOT / "docs" / "_build" / "html"))
    if not (site / "index.html").is_file():
        message = (f"SITE NOT BUILT at {site}: run `make html` first "
                   "(`make test` runs this check after it)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    exe = chromium()
    pages = browser.pages_of(site)
    # a page's source (.md) and its notebook (.ipynb): the book theme sets Sphinx's
    # html_sourcelink_suffix (default .txt) to none
    sources = sorted(p.relative_to(site / "_sources").as_posix().removesuffix(".txt")
                     for p in (site / "_sources").rglob("*") if p.is_file())
    assert sources, f"no page sources in {site / '_sources'}"
    missing = [s for s in sources
               if s.removesuffix(".md").removesuffix(".ipynb") + ".html" not in pages]
    assert not missing, f"pages with a source but no HTML: {missing}"
    # The reading paths beside the pages: their browsers mostly wait (loads, the theme's fades).
    with ThreadPoolExecutor(1) as background:
        paths = background.submit(assert_site_paths, site, exe)
        # The site was built from this checkout: its path (or the environment's) on any page
        # is this machine's, not the reader's.
        report = browser.check_site(site, exe, pages, forbidden=browser.build_paths())
    print("\n" + report.summary())
    assert len(report.pages) == len(pages)
    assert not report.failures, "\n".join(
        f"{url}:\n  " + "\n  ".join(p) for url, p in report.failures.items())
    paths.result()
    assert_versioned_with_sources(site, pages)
    assert_source_pages_link_back(site)
    assert_sidebar_lists_every_page(site, [s for s in sources if not s.startswith("index.")])


def assert_sidebar_lists_every_page(site: Path, sources: list[str]) -> None:
    """The home page's sidebar links every page with a source (docs/conf.py resolves the tree
    to ``max_navbar_depth`` levels: a page one level deeper would drop out of it)."""
    home = (site / "index.html").read_text(encoding="utf-8")
    nav = home[home.index("bd-docs-nav"):]
    links = set(re.findall(r'href="([^"#]+)', nav[:nav.index("</nav>")]))
    missing = [s for s in sources
               if s.removesuffix(".md").removesuffix(".ipynb") + ".html" not in links]
    assert not missing, f"pages not in the sidebar: {missing}"


def test_sidebar_check_can_fail(tmp_path):
    nav = '<nav class="bd-docs-nav"><a href="part1/a.html">A</a></nav>'
    (tmp_path / "index.html").write_text(nav)
    assert_sidebar_lists_every_page(tmp_path, ["part1/a.md"])
    with pytest.raises(AssertionError, match=r"not in the sidebar: \['part1/deep/b.md'\]"):
        assert_sidebar_lists_every_page(tmp_path, ["part1/a.md", "part1/deep/b.md"])


def assert_source_pages_link_back(site: Path) -> None:
    """viewcode writes a source page for kvdoc's modules only, and each of its [docs] links
    lands on an anchor of the page it names (docs/conf.py's _viewcode_module: an instance or
    alias followed to its class's module made that module link under another page's anchors,
    which changed between builds)."""
    modules = site / "_modules"
    others = [p.name for p in modules.iterdir() if p.name not in ("index.html", "kvdoc")]
    assert not others, f"source pages of other packages than kvdoc: {others}"
    broken = []
    for page in modules.rglob("*.html"):
        for href in re.findall(r'class="viewcode-back" href="([^"#]+)#([^"]+)"',
                               page.read_text(encoding="utf-8")):
            target = (page.parent / href[0]).resolve()
            if not target.is_file() or f'id="{href[1]}"' not in target.read_text("utf-8"):
                broken.append(f"{page.relative_to(site)} -> {href[0]}#{href[1]}")
    assert not broken, f"{len(broken)} source links land nowhere: {broken[:5]}"


def test_source_link_check_can_fail(tmp_path):
    (tmp_path / "_modules" / "kvdoc").mkdir(parents=True)
    (tmp_path / "api.html").write_text('<dt id="kvdoc.core.mla.MLAConfig">')
    source = tmp_path / "_modules" / "kvdoc" / "mla.html"
    source.write_text('<a class="viewcode-back" href="../../api.html#kvdoc.core.mla.MLAConfig">')
    assert_source_pages_link_back(tmp_path)
    source.write_text('<a class="viewcode-back" href="../../api.html#kvdoc.proofs.grid.MLAConfig">')
    with pytest.raises(AssertionError, match="1 source links land nowhere"):
        assert_source_pages_link_back(tmp_path)
    source.write_text("")
    (tmp_path / "_modules" / "torch.html").write_text("")
    with pytest.raises(AssertionError):
        assert_source_pages_link_back(tmp_path)


def assert_versioned_with_sources(site: Path, pages: list[str]) -> None:
    """Every content page names the package's version (from its metadata), and each layer's
    API page (reference/api/LAYER.html) has [source] links whose pages (sphinx.ext.viewcode)
    are in the site."""
    stamp = f'<p class="kvdoc-version">kvdoc {importlib.metadata.version("kvdoc")}</p>'
    unversioned = [p for p in pages if p not in browser.SKIP_SCREENSHOT
                   and stamp not in (site / p).read_text(encoding="utf-8")]
    assert not unversioned, f"pages without {stamp!r}: {unversioned}"
    total = 0
    for api in sorted(p for p in pages if re.fullmatch(r"reference/api/\w+\.html", p)):
        links = re.findall(r'<a class="reference internal" href="([^"#]+)[^"]*">'
                           r'<span class="viewcode-link">',
                           (site / api).read_text(encoding="utf-8"))
        assert links, f"no [source] link on {api}"
        missing = sorted({h for h in links if not (site / api).parent.joinpath(h).is_file()})
        assert not missing, f"[source] links to no page on {api}: {missing[:5]}"
        total += len(links)
    if "reference/api.html" in pages:  # a whole site, not a throwaway page
        assert total > 100, f"{total} [source] links on the API pages"


def test_version_and_source_check_can_fail(tmp_path):
    (tmp_path / "reference").mkdir()
    (tmp_path / "index.html").write_text("<p>kvdoc 0.0.0</p>")
    with pytest.raises(AssertionError, match="pages without"):
        assert_versioned_with_sources(tmp_path, ["index.html"])
    stamp = f'<p class="kvdoc-version">kvdoc {importlib.metadata.version("kvdoc")}</p>'
    link = ('<a class="reference internal" href="../../_modules/kvdoc/x.html#f">'
            '<span class="viewcode-link">')
    (tmp_path / "reference" / "api").mkdir()
    (tmp_path / "reference" / "api.html").write_text(stamp)
    (tmp_path / "reference" / "api" / "core.html").write_text(stamp + link * 101)
    pages = ["reference/api.html", "reference/api/core.html"]
    with pytest.raises(AssertionError, match=r"to no page on reference/api/core\.html"):
        assert_versioned_with_sources(tmp_path, pages)
    (tmp_path / "_modules" / "kvdoc").mkdir(parents=True)
    (tmp_path / "_modules" / "kvdoc" / "x.html").write_text(stamp)
    assert_versioned_with_sources(tmp_path, pages)
    (tmp_path / "reference" / "api" / "core.html").write_text(stamp + link * 100)
    with pytest.raises(AssertionError, match=r"100 \[source\] links on the API pages"):
        assert_versioned_with_sources(tmp_path, pages)
    (tmp_path / "reference" / "api" / "teach.html").write_text(stamp)
    with pytest.raises(AssertionError, match=r"no \[source\] link on reference/api/teach\.html"):
        assert_versioned_with_sources(tmp_path, [*pages, "reference/api/teach.html"])


# --- reading paths -------------------------------------------------------------------------------
# Each page of a path (docs/_ext/paths.json) carries the path's own previous/next
# (docs/_ext/kvdoc_paths.py), shown by _static/kvdoc-paths.js for the path in ?path=NAME.
_FOLLOW = """(() => {
  const visible = e => e.getClientRects().length > 0;  // laid out: not hidden by any rule
  const shown = [...document.querySelectorAll("nav.kvdoc-path")].filter(visible);
  const next = shown.map(n => n.querySelector("a.kvdoc-path-next")).filter(a => a);
  const theme = [...document.querySelectorAll(".prev-next-area")];
  return JSON.stringify({paths: [...new Set(shown.map(n => n.dataset.path))],
                         next: next.length ? next[0].href : null,
                         theme_shown: theme.some(visible)});
})()"""


def follow_path(site: Path, exe: str, name: str, first: str) -> list[dict]:
    """Open ``first`` (a docname) with ``?path=name`` and click "next" until the path ends;
    returns what each page showed: ``page`` (docname), ``paths`` (the path blocks shown),
    ``theme_shown`` (whether the theme's book-order previous/next is still visible),
    ``problems`` (requests, console errors, a phone's width, with the path block shown; the
    rest of each page is checked once, without a path, by the site check)."""
    seen: list[dict] = []
    with browser.serve(site) as origin:
        chrome = browser.Chromium(exe, origin)
        try:
            with chrome.tab() as session:
                url: str | None = f"{origin}/{first}.html?path={name}"
                while url and len(seen) < 50:
                    report = chrome.load(session, url, inspect=False)
                    result = chrome.send("Runtime.evaluate", {"expression": _FOLLOW,
                                                              "returnByValue": True}, session)
                    state = json.loads(result["result"]["value"])
                    page = url.removeprefix(origin + "/").split("?")[0].removesuffix(".html")
                    seen.append({"page": page, "paths": state["paths"],
                                 "theme_shown": state["theme_shown"],
                                 "problems": report.problems()})
                    url = state["next"]
        finally:
            chrome.close()
    return seen


def assert_path_followed(site: Path, exe: str, name: str, pages: list[str]) -> None:
    assert_followed(follow_path(site, exe, name, pages[0]), name, pages)


def assert_followed(seen: list[dict], name: str, pages: list[str]) -> None:
    assert [s["page"] for s in seen] == pages
    assert all(s["paths"] == [name] and not s["theme_shown"] for s in seen), seen
    assert not any(s["problems"] for s in seen), [s for s in seen if s["problems"]]


@pytest.mark.sphinx
def test_a_path_is_followed_by_its_own_next_links(tmp_path):
    exe = chromium()
    src = site_sources(tmp_path)
    paths = {"skip": {"title": "Skips b", "pages": ["a", "c"]},
             "back": {"title": "Backwards", "pages": ["c", "b", "a"]}}
    (src / "_ext" / "paths.json").write_text(json.dumps(paths))
    (src / "index.md").write_text("# Home\n\n```{toctree}\na\nb\nc\nd\n```\n")
    for page in "abc":
        (src / f"{page}.md").write_text(f"# Page {page}\n\nText of {page}.\n")
    (src / "d.md").write_text('# Page d\n\n<script>console.error("broken d")</script>\n')
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-W", "-q", str(src),
         str(tmp_path / "html")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    site = tmp_path / "html"
    # The book goes a, b, c; each path goes its own way, and the theme's links are hidden.
    assert_path_followed(site, exe, "skip", ["a", "c"])
    assert_path_followed(site, exe, "back", ["c", "b", "a"])
    # Without a path chosen, a path page shows no path block and keeps the theme's links.
    (plain,) = follow_path(site, exe, "", "b")
    assert plain == {"page": "b", "paths": [], "theme_shown": True, "problems": []}
    # What a page on a path shows is checked too: here a console error.
    (broken,) = follow_path(site, exe, "", "d")
    assert broken["problems"] == ["console error: broken d"], broken


def assert_site_paths(site: Path, exe: str) -> None:
    """Every reading path of the built site, followed from its first page to its last."""
    paths = json.loads((ROOT / "docs" / "_ext" / "paths.json").read_text(encoding="utf-8"))
    # a browser a path, side by side (each thread mostly waits on its browser's pipe)
    with ThreadPoolExecutor(min(os.cpu_count() or 1, 4)) as pool:
        followed = {name: pool.submit(follow_path, site, exe, name, path["pages"][0])
                    for name, path in paths.items()}
    for name, path in paths.items():
        assert_followed(followed[name].result(), name, path["pages"])
