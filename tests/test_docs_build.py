"""The site's build is strict: each failure mode below must make the build (so `make test`) fail.

Each test writes a throwaway Sphinx project with the site's own conf.py, extensions and static
files (a landing page and a page holding the failure, ``broken-page``; the failures that need no
setting of their own are five pages of one build) and runs it through the Makefile's own targets
(`make html` / `make doctest` with DOCS pointing at it), so the flags under test are the ones
`make test` uses. Each failure must name its page: a warning or error line of the log says it.
A good page is built first as a control.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRONT = textwrap.dedent("""\
    ---
    file_format: mystnb
    kernelspec:
      name: python3
      display_name: Python 3
    ---

    # Throwaway

    """)
PAGE = "broken-page"  # the page that holds the failure; every failure message must name it

pytestmark = pytest.mark.sphinx


def make(target: str) -> list[str]:
    """`make TARGET` in the repository with the environment running these tests.

    VENV is this interpreter's environment and ``-o`` marks its set-up stamp as done, so a test
    never creates or reinstalls a venv (the venv of `make test` is this one anyway).
    """
    venv = Path(sys.prefix)
    return ["make", "--no-print-directory", "-C", str(ROOT), target, f"VENV={venv}",
            "-o", str(venv / ".installed")]


def build(tmp_path: Path, body: str | dict[str, str], target: str = "html",
          timeout_s: int = 60) -> subprocess.CompletedProcess:
    """Build ``body`` as the page :data:`PAGE`, or each ``{page: body}`` as its own page."""
    pages = body if isinstance(body, dict) else {PAGE: body}
    src = tmp_path / "src"
    src.mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "conf.py", src / "conf.py")
    for folder in ("_ext", "_static", "_templates", "_ipython"):
        if (ROOT / "docs" / folder).is_dir():
            shutil.copytree(ROOT / "docs" / folder, src / folder)
    (src / "index.md").write_text(FRONT + "```{toctree}\n" + "\n".join(pages) + "\n```\n")
    for page, text in pages.items():
        (src / f"{page}.md").write_text(FRONT + textwrap.dedent(text))
    env = {**os.environ, "KVDOC_CELL_TIMEOUT": str(timeout_s), "CI": "true"}
    return subprocess.run(
        [*make(target), f"DOCS={src}", f"BUILDDIR={tmp_path / 'build'}"],
        capture_output=True, text=True, env=env, timeout=600)


def assert_fails_naming_page(result: subprocess.CompletedProcess, *needles: str,
                             page: str = PAGE) -> None:
    log = result.stdout + result.stderr
    assert result.returncode != 0, log
    # a Sphinx warning/error line, or the doctest builder's 'File "broken-page.md", line N'
    naming = [line for line in log.splitlines()
              if page in line
              and ("WARNING" in line or "ERROR" in line or f'File "{page}.md", line' in line)]
    assert naming, f"no warning or error line names {page}:\n{log}"
    print(*naming, sep="\n")
    for needle in needles:
        assert needle in log, log


def test_good_page_builds(tmp_path):
    result = build(tmp_path, """
        ```{code-cell} python
        from myst_nb import glue
        glue("answer", 6 * 7, display=False)
        ```

        The answer is {glue:text}`answer`.

        ```{doctest}
        >>> 6 * 7
        42
        ```
        """)
    assert result.returncode == 0, result.stdout + result.stderr
    html = (tmp_path / "build" / "html" / f"{PAGE}.html").read_text()
    assert 'The answer is <span class="pasted-text">42</span>' in html


def test_cell_past_the_timeout_fails_the_build(tmp_path):
    result = build(tmp_path, """
        ```{code-cell} python
        import time
        time.sleep(60)
        ```
        """, timeout_s=3)
    assert_fails_naming_page(result)
    assert "timed out" in (result.stdout + result.stderr).lower()


def test_failing_doctest_fails_the_doctest_build(tmp_path):
    """A page whose doctest fails, beside one whose doctest passes (the control): both ran, one
    failed, and only the failing page is named."""
    result = build(tmp_path, {"good-doctest": "```{doctest}\n>>> 6 * 7\n42\n```\n",
                              PAGE: "```{doctest}\n>>> 1 + 1\n3\n```\n"}, target="doctest")
    assert_fails_naming_page(result, "2 tests", "1 failure in tests")
    log = result.stdout + result.stderr
    assert not [line for line in log.splitlines() if "good-doctest" in line
                and ("WARNING" in line or "ERROR" in line or 'File "good-doctest.md"' in line)]


FIGURE_CELL = textwrap.dedent("""
    ```{code-cell} python
    import matplotlib.pyplot as plt
    from myst_nb import glue

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, 1])
    glue("fig-line", fig, display=False)
    plt.close(fig)
    ```
    """)


def figure_page(alt: str, name: str, agg: bool = False) -> str:
    cell = FIGURE_CELL.replace("fig-line", name)
    if agg:
        cell = cell.replace("import matplotlib.pyplot",
                            "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot")
    return cell + f"\n```{{glue:figure}} {name}\n{alt}:name: {name}\n\nA figure.\n```\n"


BROKEN = {
    "cell-raises": ('```{code-cell} python\nraise RuntimeError("boom from a cell")\n```\n',
                    "boom from a cell"),
    "glue-missing": ("```{code-cell} python\nfrom myst_nb import glue\n"
                     'glue("present", 1, display=False)\n```\n\nHere is {glue:text}`absent`.\n',
                     "absent"),
    "dead-link": ("See {doc}`a-page-that-does-not-exist`.\n", "a-page-that-does-not-exist"),
    "figure-no-alt": (figure_page("", "fig-no-alt"), "image without alt text"),
    # the Agg backend glues a figure as text only
    "figure-as-text": (figure_page(":alt: a line\n", "fig-as-text", agg=True),
                       "figure without an image"),
}
"""Page -> (its body, what the log must say): one failure each, built together."""


def test_each_failure_fails_the_build_and_names_its_page(tmp_path):
    """A cell that raises, a missing glue key, any warning (a dead link), a figure without alt
    text, a figure glued as text: one build of five pages (``--keep-going`` builds every page),
    each page named by a warning or error line and its failure in the log."""
    result = build(tmp_path, {page: body for page, (body, _) in BROKEN.items()})
    for page, (_, needle) in BROKEN.items():
        assert_fails_naming_page(result, needle, page=page)


def test_only_a_build_that_reads_pages_clears_the_records(tmp_path):
    """A forced build (CI) clears the broken-variant sweep's records (kvdoc.teach.sweep_record)
    as it starts reading pages; make test's doctest build reuses html's environment and reads
    none, so the records it finds must still be there for make repro-check to read."""
    result = build(tmp_path, """
        ```{code-cell} python
        import os
        from pathlib import Path

        records = Path(os.environ["KVDOC_RECORDS"])
        records.mkdir(parents=True, exist_ok=True)
        (records / "record.json").write_text("{}")
        with open(records.parent / "executed.txt", "a") as log:
            log.write("x")
        ```
        """)
    assert result.returncode == 0, result.stdout + result.stderr
    records = tmp_path / "build" / "records"
    executed = tmp_path / "build" / "executed.txt"
    assert (records / "record.json").is_file() and executed.read_text() == "x"
    again = [f"DOCS={tmp_path / 'src'}", f"BUILDDIR={tmp_path / 'build'}"]
    env = {**os.environ, "KVDOC_CELL_TIMEOUT": "60", "CI": "true"}  # as build() ran html
    doctest = subprocess.run([*make("doctest"), *again], capture_output=True, text=True,
                             env=env, timeout=600)
    assert doctest.returncode == 0, doctest.stdout + doctest.stderr
    assert executed.read_text() == "x"  # no page read again, none executed
    assert (records / "record.json").is_file()
    (records / "stale.json").write_text("{}")
    html = subprocess.run([*make("html"), *again], capture_output=True, text=True, env=env,
                          timeout=600)
    assert html.returncode == 0, html.stdout + html.stderr
    assert executed.read_text() == "xx"
    assert sorted(p.name for p in records.iterdir()) == ["record.json"]
