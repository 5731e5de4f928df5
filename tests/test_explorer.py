"""The in-browser explorer's masks and stepper match kvdoc's, evaluated with node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvdoc import offset_causal_mask
from kvdoc.proofs.broken.decoders import top_left_causal_mask
from kvdoc.teach.worked import WORKED_INPUTS, worked_example

JS = Path(__file__).resolve().parents[1] / "docs" / "_static" / "kvdoc-explorer.js"
GRID = [(p, c) for p in range(0, 13) for c in range(1, 7)]  # the page's slider ranges


def _node(script: str) -> object:
    node = shutil.which("node")
    if node is None:  # node is part of this project's machine image: never skip
        ci = " (CI is set)" if os.environ.get("CI") else ""
        pytest.fail("node is not on PATH; the explorer test needs it" + ci)
    done = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _evaluate(expr: str) -> object:
    return _node(f"const m = require({json.dumps(str(JS))}); "
                 f"process.stdout.write(JSON.stringify({expr}));")


def test_js_masks_match_kvdoc_masks():
    got = _evaluate(f"{json.dumps(GRID)}.map(([p, c]) => "
                    "[m.offsetMask(p, c), m.topLeftMask(p, c)])")
    assert len(got) == len(GRID)
    for (p, c), (off, tl) in zip(GRID, got, strict=True):
        assert off == offset_causal_mask(p, c).tolist(), (p, c)
        assert tl == top_left_causal_mask(p, c).tolist(), (p, c)
    # The grid does exercise a difference between the two (else the comparison would be weak).
    assert any(off != tl for off, tl in got)


def test_js_masks_reject_bad_lengths():
    got = _evaluate("[[-1, 1], [2, 0], [1.5, 1]].map(([p, c]) => "
                    "{ try { m.offsetMask(p, c); return 'ok'; } "
                    "catch (e) { return e.name; } })")
    assert got == ["RangeError"] * 3


def test_js_stepper_matches_worked_example():
    got = _evaluate(f"m.cachedSteps({json.dumps([list(x) for x in WORKED_INPUTS])})")
    steps = worked_example()
    assert len(got) == len(steps)
    for js, py in zip(got, steps, strict=True):
        assert js["step"] == py.step
        K = torch.tensor(js["K"], dtype=torch.float64)
        assert torch.allclose(K, py.cached.K_full, atol=0, rtol=0)
        refs = (("scores", py.cached.scores[0]), ("weights", py.cached.weights[0]),
                ("output", py.cached.output))
        for key, ref in refs:
            diff = (torch.tensor(js[key], dtype=torch.float64) - ref).abs().max().item()
            assert diff < 1e-12, (py.step, key, diff)


def test_page_reference_cell_uses_the_sliders_initial_values():
    import re

    page = (JS.parents[1] / "part1" / "4-explorer.md").read_text()
    js = JS.read_text()
    p0 = re.search(r'max: "12", value: "(\d+)", id: "kvx-p"', js)
    c0 = re.search(r'max: "6", value: "(\d+)", id: "kvx-c"', js)
    cell = re.search(r"P, C = (\d+), (\d+)  # the explorer's initial slider values", page)
    assert p0 and c0 and cell
    assert (int(p0.group(1)), int(c0.group(1))) == (int(cell.group(1)), int(cell.group(2)))
    # The sliders' ranges are the grid the mask test covers.
    assert 'min: "0", max: "12"' in js and 'min: "1", max: "6"' in js
    assert max(p for p, _ in GRID) == 12 and max(c for _, c in GRID) == 6
