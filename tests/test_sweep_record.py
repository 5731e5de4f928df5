"""The broken-variant record (kvdoc.teach.sweep_record): computed once, keyed, recomputed when
stale. A fake sweep stands in for the real one, counting its calls in a file."""

from __future__ import annotations

import multiprocessing
import shutil
import time

from kvdoc.proofs.case import CheckResult
from kvdoc.proofs.suite import SuiteReport
from kvdoc.proofs.sweep import VariantOutcome
from kvdoc.teach import sweep_record


def fake_sweep(calls: str, wait: float = 0.0) -> list[VariantOutcome]:
    """Two outcomes, one caught (with an inf error, as a shape mismatch gives), one not."""
    with open(calls, "a") as f:
        f.write("call\n")
    time.sleep(wait)
    failed = CheckResult("logits", "mha", "static", "model", "FP32", False, float("inf"),
                         "raised ValueError: no", batch=2, chunk=5)
    passed = CheckResult("kv", "mha", "static", "model", "FP64", True, 1e-17, "")
    return [VariantOutcome("a", "breaks a", "cache storage", SuiteReport("a", [failed, passed],
                                                                         0.5)),
            VariantOutcome("b", "breaks b", "long stream", SuiteReport("b", [passed], 0.25))]


def n_calls(calls) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_stored_once_and_read_back(tmp_path):
    calls = tmp_path / "calls"
    first = sweep_record.stored("r", fake_sweep, folder=str(tmp_path), calls=str(calls))
    again = sweep_record.stored("r", fake_sweep, folder=str(tmp_path), calls=str(calls))
    assert n_calls(calls) == 1
    assert again == first == fake_sweep(str(tmp_path / "other"))  # the same, through JSON
    assert [o.caught for o in again] == [True, False]
    assert again[0].first.chunk == 5 and again[0].first.error == float("inf")


def test_without_a_folder_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("KVDOC_RECORDS", raising=False)
    monkeypatch.chdir(tmp_path)
    calls = tmp_path / "calls"
    for _ in range(2):
        sweep_record.stored("r", fake_sweep, calls=str(calls))
    assert n_calls(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls"]


def test_the_environment_variable_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDOC_RECORDS", str(tmp_path / "records"))
    sweep_record.stored("r", fake_sweep, calls=str(tmp_path / "calls"))
    assert (tmp_path / "records" / "r.json").is_file()


def test_the_key_follows_the_source_the_numbers_and_the_arguments(tmp_path, monkeypatch):
    copy = tmp_path / "kvdoc"
    shutil.copytree(sweep_record.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(sweep_record, "PACKAGE", copy)
    for name in sweep_record.NUMERIC_ENV:
        monkeypatch.delenv(name, raising=False)
    key = sweep_record.record_key(fake_sweep, {"calls": "x"})
    assert sweep_record.record_key(fake_sweep, {"calls": "x"}) == key
    assert sweep_record.record_key(fake_sweep, {"calls": "y"}) != key
    assert sweep_record.record_key(n_calls, {"calls": "x"}) != key
    for name, value in (("ATEN_CPU_CAPABILITY", "default"), ("MKL_CBWR", "COMPATIBLE"),
                        ("KVDOC_THREADS", "2")):
        monkeypatch.setenv(name, value)
        assert sweep_record.record_key(fake_sweep, {"calls": "x"}) != key, name
        monkeypatch.delenv(name)
    assert sweep_record.record_key(fake_sweep, {"calls": "x"}) == key
    module = copy / "proofs" / "variants.py"
    module.write_text(module.read_text() + "\n# a comment\n")
    assert sweep_record.record_key(fake_sweep, {"calls": "x"}) != key


def test_a_stale_record_is_computed_again(tmp_path, monkeypatch):
    calls, folder = tmp_path / "calls", str(tmp_path)
    sweep_record.stored("r", fake_sweep, folder=folder, calls=str(calls))
    monkeypatch.setattr(sweep_record, "source_hash", lambda: "an edited package")
    sweep_record.stored("r", fake_sweep, folder=folder, calls=str(calls))
    assert n_calls(calls) == 2
    sweep_record.stored("r", fake_sweep, folder=folder, calls=str(calls))
    assert n_calls(calls) == 2  # the new record is read
    (tmp_path / "r.json").write_text('{"key": "cut short')  # a damaged record
    sweep_record.stored("r", fake_sweep, folder=folder, calls=str(calls))
    assert n_calls(calls) == 3


def _ask(folder: str, calls: str, results) -> None:
    results.put([o.name for o in sweep_record.stored("r", fake_sweep, folder=folder,
                                                     calls=calls, wait=0.5)])


def test_two_processes_asking_at_once_compute_it_once(tmp_path):
    context = multiprocessing.get_context("fork")  # each opens the lock itself, as kernels do
    calls, results = tmp_path / "calls", context.Queue()
    workers = [context.Process(target=_ask, args=(str(tmp_path), str(calls), results))
               for _ in range(2)]
    for w in workers:
        w.start()
    got = [results.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    assert got == [["a", "b"], ["a", "b"]]
    assert n_calls(calls) == 1  # the second waited for the first, then read its record
