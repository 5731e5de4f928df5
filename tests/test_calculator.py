"""The memory calculator's functions equal kvdoc's formula for every preset (evaluated with
node); the page feeds it the package's presets; in headless Chromium, picking each preset shows
what ``python -m kvdoc memory`` prints for it, field by field."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvdoc.__main__ import main as cli
from kvdoc.measure.kv_bytes import ELEMENT_BYTES, binary_size, kv_bytes
from kvdoc.measure.memory import calculator_data
from kvdoc.measure.model_caches import MODELS, model_cache

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
    presets = calculator_data()["presets"]
    assert len(presets) == len(MODELS) >= 20
    got = _evaluate(
        "data.presets.map(p => data.grid.map(([b, t, d]) => { const s = data.sizes[d]; "
        "return [m.cacheBytes(p, b, t, s), m.bytesPerToken(p, s), m.bytesPerToken(p, s, true), "
        "m.fixedBytes(p, s), m.sequencesThatFit(p, t, s, 80 * 2 ** 30), "
        "m.binarySize(m.cacheBytes(p, b, t, s)), m.partBytes(p, b, t, s), "
        "m.allAttention(p) && m.cacheBytes(m.allAttention(p), b, t, s)]; }))",
        {"presets": presets, "grid": GRID, "sizes": ELEMENT_BYTES})
    assert isinstance(got, list) and len(got) == len(presets)
    for p, rows in zip(presets, got, strict=True):
        m = model_cache(p["name"])
        for (b, t, dtype), (total, per_token, past, fixed, fit, text, parts,
                            full) in zip(GRID, rows, strict=True):
            assert total == m.kv_bytes(t, b, dtype), (m.name, b, t, dtype)
            assert per_token == m.bytes_per_token(dtype) and fixed == m.fixed_bytes(dtype)
            assert past == m.bytes_per_token(dtype, past_windows=True)
            assert fit == m.sequences_that_fit(80 * 2**30, t, dtype)
            assert text == binary_size(m.kv_bytes(t, b, dtype))
            assert parts == [list(item) for item in m.parts(t, b, dtype).items()]
            assert full == (None if m.kind == "plain"
                            else m.all_attention().kv_bytes(t, b, dtype))


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
    assert "calculator_data(" in page
    assert 'id="kvdoc-calculator-data"' in page and "_static/kvdoc-calculator.js" in page
    assert 'getElementById("kvdoc-calculator-data")' in JS.read_text()
    # nothing loaded from another host
    assert not re.search(r"https?://", JS.read_text().split("/* ---")[1])
    toctree = (DOCS / "index.md").read_text()
    assert "reference/cheatsheet\nreference/calculator\n" in toctree


# What a reader sees: every preset picked in headless Chromium, every field read back. The
# memory given is the test's; the weights are the page's (a model's own, or none).
MEMORY_GIB = 1000
PICK_EVERY_PRESET = """(() => {
  const $ = id => document.getElementById("kvc-" + id), pick = $("model");
  const boxes = () => ["layers", "kv-heads", "head-dim", "window", "length", "weights"].map(
    id => $(id).value);
  const rows = () => [...document.querySelectorAll("#kvc-out tr")].map(
    tr => [tr.querySelector("th").textContent, tr.querySelector("td").textContent]);
  const note = () => document.querySelector("#kvc-out p").textContent;
  const set = (id, value) => { $(id).value = value; $(id).dispatchEvent(new Event("input")); };
  const first = pick.options[pick.selectedIndex].text;
  const out = [];
  for (let i = 1; i < pick.options.length; i++) {
    pick.value = pick.options[i].value;
    pick.dispatchEvent(new Event("change"));
    $("dtype").value = "float8_e4m3fn"; set("batch", "3"); set("memory", "MEMORY");
    out.push({name: pick.options[i].text, boxes: boxes(), rows: rows(), note: note(),
              greyed: document.querySelector(".kvc-custom").disabled});
  }
  // Llama-3.1-8B's weights do not fit in 10 GiB; typed weights replace them
  pick.value = [...pick.options].find(o => o.text.startsWith("Llama-3.1-8B ")).value;
  pick.dispatchEvent(new Event("change"));
  set("memory", "10");
  const full = document.querySelector("#kvc-out .kvc-error").textContent;
  set("weights", "2.5");
  const typed = rows().at(-1);
  set("batch", "1");  // one sequence: the batch row would repeat the sequence's
  return JSON.stringify({first: first, out: out, full: full, typed: typed,
                         single: rows().map(r => r[0])});
})()""".replace("MEMORY", str(MEMORY_GIB))


def _memory_command(name: str) -> dict[str, list[str]]:
    """What ``python -m kvdoc memory`` prints for ``name`` at the browser test's settings,
    as its lines' values under their labels."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["memory", "--model", name, "--batch", "3", "--dtype", "float8_e4m3fn",
                    "--memory", str(MEMORY_GIB)]) == 0
    lines: dict[str, list[str]] = {}
    for line in out.getvalue().splitlines():
        lines.setdefault(line[:10].strip(), []).append(line[11:])
    return lines


def _number(text: str) -> int:
    return int(re.match(r"[\d,]+", text)[0].replace(",", ""))


def _expected(name: str) -> tuple[list[str], list[list[object]]]:
    """The boxes and table rows the page should show for ``name``, read off the command's
    lines: sizes from its ``layers`` lines, counts from the rest."""
    printed = _memory_command(name)
    layers = printed["layers"]
    heads = [re.search(r"= 2 x (\d+) x (\d+)\)", line) for line in layers]
    heads = [h.groups() for h in heads if h] or [("", "")]
    window = [re.search(r"the last ([\d,]*\d) positions", line) for line in layers]
    window = [w[1].replace(",", "") for w in window if w] or [""]
    T = re.search(r"T = ([\d,]*\d)", printed["length"][0])[1]
    fit = re.fullmatch(r"([\d,]+) sequences .* GiB(?:, after (.+) of weights \((.+)\)|"
                       r" \(weights not counted.*)", printed["fits"][0])
    weights = "" if fit[2] is None else fit[2]
    boxes = [str(sum(_number(line) for line in layers)), *heads[0], window[0],
             T.replace(",", ""), weights]
    rows: list[list[object]] = [["layers", line] for line in layers]
    if "past W" in printed:
        rows.append(["bytes per token, inside every window", _number(printed["per token"][0])])
        past = re.search(r"T > ([\d,]*\d)", printed["past W"][0])[1]
        rows.append([f"bytes per token past every window (T > {past})",
                     _number(printed["past W"][0])])
    else:
        rows.append(["bytes per token", _number(printed["per token"][0])])
    rows += [[f"per sequence of {T}", _number(printed["sequence"][0])],
             ["batch of 3", _number(printed["bytes"][0])]]
    for line in printed.get("part", []):  # each term apart, past a plain model
        name, value = line.split(": ", 1)
        rows.append([f"part: {name}" + (" (constant in T)" if "constant" in value else ""),
                     _number(value)])
    if "all attn" in printed:
        rows.append([f"all attention, the same {boxes[0]} layers",
                     _number(printed["all attn"][0])])
    if "fixed" in printed:
        rows.append(["fixed state per sequence (constant in T)", _number(printed["fixed"][0])])
    rows.append([f"sequences that fit in {MEMORY_GIB} GiB"
                 + (f", after {weights} of weights" if weights else " (weights not counted)"),
                 fit[1]])
    return boxes, rows, fit[3]


def test_the_page_in_a_browser_shows_what_the_memory_command_prints(tmp_path: Path) -> None:
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
    data = calculator_data()
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
        name = shown["name"].rsplit(" (", 1)[0]
        boxes, rows, weights_from = _expected(name)
        assert shown["greyed"]
        # the page shows weights as GiB to 3 places, the command as binary_size does
        got_weights, want_weights = shown["boxes"][5], boxes[5].removesuffix(" GiB")
        assert (got_weights == want_weights == "") or float(got_weights) == float(want_weights)
        assert shown["boxes"][:5] == boxes[:5], name
        got = [[th, td if th == "layers" or th.startswith("sequences") else _number(td)]
               for th, td in shown["rows"]]
        assert got == rows, name
        for th, td in shown["rows"]:
            if th != "layers" and not th.startswith("sequences"):
                assert td == f"{_number(td):,} ({binary_size(_number(td))})"
        if weights_from and weights_from != "--weights":
            assert weights_from.split(" parameters")[0] in shown["note"]
    llama = model_cache("Llama-3.1-8B")
    assert seen["full"] == (f"the weights ({binary_size(2 * llama.parameters)}) leave nothing "
                            "of the 10 GiB")
    fit = llama.sequences_that_fit(int(7.5 * 2**30), llama.max_positions, "float8_e4m3fn")
    assert seen["typed"] == ["sequences that fit in 10 GiB, after 2.5 GiB of weights", f"{fit:,}"]
    assert "per sequence of 131,072" in seen["single"]
    assert not any(label.startswith("batch") for label in seen["single"])
