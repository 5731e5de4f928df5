"""The site's build is strict: each failure mode below must make the build (so `make test`) fail.

Each test writes a one-page throwaway Sphinx project with the site's own conf.py and runs it
through the Makefile's own targets (`make html` / `make doctest` with DOCS pointing at it), so
the flags under test are the ones `make test` uses. A good page is built first as a control.
"""

from __future__ import annotations

import os
import shutil
import subprocess
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

pytestmark = pytest.mark.sphinx


def build(tmp_path: Path, body: str, target: str = "html", timeout_s: int = 60) -> subprocess.CompletedProcess:
    src = tmp_path / "src"
    (src / "_static").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "conf.py", src / "conf.py")
    (src / "index.md").write_text(FRONT + textwrap.dedent(body))
    env = {**os.environ, "KVDOC_CELL_TIMEOUT": str(timeout_s), "CI": "true"}
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), target, f"DOCS={src}", f"BUILDDIR={tmp_path / 'build'}"],
        capture_output=True, text=True, env=env, timeout=600)


def assert_fails_naming_page(result: subprocess.CompletedProcess, *needles: str) -> None:
    log = result.stdout + result.stderr
    assert result.returncode != 0, log
    assert "index" in log, log  # the message names the page
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
    assert 'The answer is <span class="pasted-text">42</span>' in (tmp_path / "build" / "html" / "index.html").read_text()
    assert build(tmp_path / "again", "```{doctest}\n>>> 6 * 7\n42\n```\n", "doctest").returncode == 0


def test_cell_that_raises_fails_the_build(tmp_path):
    result = build(tmp_path, """
        ```{code-cell} python
        raise RuntimeError("boom from a cell")
        ```
        """)
    assert_fails_naming_page(result, "boom from a cell")


def test_cell_past_the_timeout_fails_the_build(tmp_path):
    result = build(tmp_path, """
        ```{code-cell} python
        import time
        time.sleep(60)
        ```
        """, timeout_s=3)
    assert_fails_naming_page(result)
    assert "timed out" in (result.stdout + result.stderr).lower()


def test_missing_glue_key_fails_the_build(tmp_path):
    result = build(tmp_path, """
        ```{code-cell} python
        from myst_nb import glue
        glue("present", 1, display=False)
        ```

        Here is {glue:text}`absent`.
        """)
    assert_fails_naming_page(result, "absent")


def test_failing_doctest_fails_the_doctest_build(tmp_path):
    result = build(tmp_path, """
        ```{doctest}
        >>> 1 + 1
        3
        ```
        """, target="doctest")
    assert_fails_naming_page(result, "1 failure")


def test_any_warning_fails_the_build(tmp_path):
    result = build(tmp_path, """
        See {doc}`a-page-that-does-not-exist`.
        """)
    assert_fails_naming_page(result, "a-page-that-does-not-exist")
