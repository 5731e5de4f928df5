"""Progress lines (kvdoc.teach.sweep_record): on the cell's output and in the build log,
counts only."""

from __future__ import annotations

import re

from kvdoc.teach.sweep_record import chunks, progress


def test_lines_go_to_the_output_and_the_build_log(tmp_path, monkeypatch, capsys):
    log = tmp_path / "build.log"
    monkeypatch.setenv("KVDOC_BUILD_LOG", str(log))
    assert [x for x in progress(chunks(range(5), 2), "sweep")] == [[0, 1], [2, 3], [4]]
    lines = ["sweep: 1/3 done", "sweep: 2/3 done", "sweep: 3/3 done"]
    assert capsys.readouterr().out.splitlines() == lines
    assert log.read_text().splitlines() == lines
    assert not any(re.search(r"\d[.:]\d|\bs\b|sec", line) for line in lines)  # no time


def test_no_build_log_or_one_that_cannot_be_written(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KVDOC_BUILD_LOG", raising=False)
    assert list(progress("ab", "x")) == ["a", "b"]
    monkeypatch.setenv("KVDOC_BUILD_LOG", str(tmp_path / "no" / "such" / "folder" / "log"))
    assert list(progress("ab", "x")) == ["a", "b"]
    assert capsys.readouterr().out.count("done") == 4


def test_a_line_is_printed_only_once_a_step_is_done(capsys):
    steps = progress(range(2), "steps")
    next(steps)
    assert capsys.readouterr().out == ""  # step 0 handed out, not yet done
    next(steps)
    assert capsys.readouterr().out == "steps: 1/2 done\n"
