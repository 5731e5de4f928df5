"""The memory calculator's functions equal kvdoc's formula for every preset (evaluated with
node); the page feeds it the package's presets; in headless Chromium, picking each preset shows
the Python numbers."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvdoc.measure.kv_bytes import ELEMENT_BYTES, binary_size, kv_bytes
from kvdoc.measure.model_caches import MODELS, calculator_presets, model_cache

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
JS = DOCS / "_static" / "kvdoc-calculator.js"
GRID = [(1, 1, "float16"), (3, 127, "bfloat16"), (2, 4096, "float32"), (8, 5000, "float8_e4m3fn"),
        (1, 131072, "float64"), (16, 32768, "int8")]


def _evaluate(script: str, data: object) -> object:
    node = shutil.which("node")
    if node is None:  # node is part of this project's machine image: never skip
        ci = " (CI is set)" if os.environ.get("CI") else ""
        pytest.fail("node is not on PATH; the calculator test needs it" + ci)
    program = (f"const m = require({json.dumps(str(JS))}); const data = JSON.parse("
               f"require('fs').readFileSync(0, 'utf8')); "
               f"process.stdout.write(JSON.stringify({script}));")
    done = subprocess.run([node, "-e", program], input=json.dumps(data), capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_every_preset_at_every_grid_point_equals_the_python_formula() -> None:
    presets = calculator_presets()
    assert len(presets) == len(MODELS) >= 20
    got = _evaluate(
        "data.presets.map(p => data.grid.map(([b, t, d]) => { const s = data.sizes[d]; "
        "return [m.cacheBytes(p, b, t, s), m.bytesPerToken(p, s), m.fixedBytes(p, s), "
        "m.sequencesThatFit(p, t, s, 80 * 2 ** 30), m.binarySize(m.cacheBytes(p, b, t, s))]; }))",
        {"presets": presets, "grid": GRID, "sizes": ELEMENT_BYTES})
    assert isinstance(got, list) and len(got) == len(presets)
    for p, rows in zip(presets, got, strict=True):
        m = model_cache(p["name"])
        for (b, t, dtype), (total, per_token, fixed, fit, text) in zip(GRID, rows, strict=True):
            assert total == m.kv_bytes(t, b, dtype), (m.name, b, t, dtype)
            assert per_token == m.bytes_per_token(dtype) and fixed == m.fixed_bytes(dtype)
            assert fit == m.sequences_that_fit(80 * 2**30, t, dtype)
            assert text == binary_size(m.kv_bytes(t, b, dtype))


def test_typed_sizes_equal_kv_bytes() -> None:
    cases = [(32, 8, 128, None, 1, 8192, 2), (80, 8, 128, 4096, 4, 10000, 2),
             (1, 1, 1, 1, 1, 0, 1), (126, 8, 128, None, 64, 131072, 4)]
    got = _evaluate("data.map(([L, H, D, W, B, T, s]) => "
                    "m.cacheBytes(m.customModel(L, H, D, W), B, T, s))", cases)
    dtype = {1: "int8", 2: "float16", 4: "float32"}
    assert got == [kv_bytes(B, L, T, H, D, dtype[s], window=W) for L, H, D, W, B, T, s in cases]


def test_binary_units_round_as_python_does() -> None:
    # exact ties (1.0625 GiB is 1062.5 thousandths) round to even, as Python formats them
    counts = [0, 1023, 1024, 1536, 17 * 2**26, 3 * 2**29 + 2**19, 2**50 * 3, 10**15 + 7]
    assert _evaluate("data.map(m.binarySize)", counts) == [binary_size(n) for n in counts]


def test_bad_input_raises_a_range_error() -> None:
    got = _evaluate(
        "data.map(([L, H, D, W, B, T]) => { try { "
        "return m.cacheBytes(m.customModel(L, H, D, W), B, T, 2); } "
        "catch (e) { return e.name; } })",
        [[0, 1, 1, None, 1, 1], [1, 1.5, 1, None, 1, 1], [1, 1, 1, 0, 1, 1],
         [1, 1, 1, None, 0, 1], [1, 1, 1, None, 1, -1], [1000, 1000, 1000, None, 1000, 10**9]])
    assert got == ["RangeError"] * 6


def test_the_page_feeds_the_packages_presets() -> None:
    page = (DOCS / "reference" / "calculator.md").read_text()
    assert "calculator_presets()" in page and "ELEMENT_BYTES" in page
    assert 'id="kvdoc-calculator-data"' in page and "_static/kvdoc-calculator.js" in page
    assert 'getElementById("kvdoc-calculator-data")' in JS.read_text()
    # nothing loaded from another host
    assert not re.search(r"https?://", JS.read_text().split("/* ---")[1])
    toctree = (DOCS / "index.md").read_text()
    assert "reference/cheatsheet\nreference/calculator\n" in toctree


# What a reader sees: every preset picked in headless Chromium, the table's numbers read back.
PICK_EVERY_PRESET = """(() => {
  const pick = document.getElementById("kvc-model"), T = document.getElementById("kvc-length");
  const B = document.getElementById("kvc-batch"), dtype = document.getElementById("kvc-dtype");
  const M = document.getElementById("kvc-memory");
  const rows = () => [...document.querySelectorAll("#kvc-out tr td")].map(td => td.textContent);
  const first = pick.options[pick.selectedIndex].text;
  const out = [];
  for (let i = 1; i < pick.options.length; i++) {
    pick.value = pick.options[i].value;
    pick.dispatchEvent(new Event("change"));
    B.value = "3"; dtype.value = "float8_e4m3fn"; M.value = "24";
    B.dispatchEvent(new Event("input"));
    out.push({name: pick.options[i].text, context: T.value, rows: rows()});
  }
  return JSON.stringify({first: first, out: out});
})()"""


def test_the_page_in_a_browser_shows_the_python_numbers(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("kvdoc_browser", ROOT / "scripts" / "browser.py")
    browser = importlib.util.module_from_spec(spec)
    sys.modules["kvdoc_browser"] = browser
    spec.loader.exec_module(browser)
    exe = browser.find_chromium()
    if exe is None:  # as tests/test_site.py: a loud skip outside CI, a failure under CI
        message = f"BROWSER TEST NOT RUN: Chromium not found; {browser.INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    data = {"presets": calculator_presets(), "element_bytes": ELEMENT_BYTES,
            "initial": "Llama-3.1-8B"}
    shutil.copy(JS, tmp_path / JS.name)
    (tmp_path / "favicon.ico").write_bytes(b"")
    (tmp_path / "index.html").write_text(
        '<!doctype html><html><body><script type="application/json" '
        f'id="kvdoc-calculator-data">{json.dumps(data)}</script>'
        f'<div id="kvdoc-calculator"></div><script src="{JS.name}"></script></body></html>')
    with browser.serve(tmp_path) as origin:
        chrome = browser.Chromium(exe, origin)
        try:
            with chrome.tab() as session:
                report = chrome.load(session, f"{origin}/index.html")
                result = chrome.send("Runtime.evaluate", {"expression": PICK_EVERY_PRESET,
                                                          "returnByValue": True}, session)
        finally:
            chrome.close()
    assert not report.console_errors and not report.external
    seen = json.loads(result["result"]["value"])
    assert seen["first"].startswith("Llama-3.1-8B")
    assert len(seen["out"]) == len(MODELS)
    for shown in seen["out"]:
        m = model_cache(shown["name"].rsplit(" (", 1)[0])
        T, s = m.max_positions, "float8_e4m3fn"
        assert shown["context"] == str(T)  # picking a model sets its context
        one, total = m.kv_bytes(T, 1, s), m.kv_bytes(T, 3, s)
        assert shown["rows"][:4] == [
            f"{m.bytes_per_token(s):,} ({binary_size(m.bytes_per_token(s))})",
            f"{one:,} ({binary_size(one)})", f"{total:,} ({binary_size(total)})",
            f"{m.sequences_that_fit(24 * 2**30, T, s):,}"], m.name
