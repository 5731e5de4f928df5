"""``python -m kvdoc``: its version, its help, and what it imports before it starts.

The start-up checks run a fresh interpreter: in this one torch is already loaded by other tests.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvdoc import cli
from kvdoc.cli import COMMANDS, build_parser, plain

SAMPLE = str(Path(__file__).resolve().parent.parent / "docs" / "_static" / "chat-prompts.txt")


def run(*code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *code], capture_output=True, text=True, timeout=120)


def test_version() -> None:
    result = run("-m", "kvdoc", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvdoc {importlib.metadata.version('kvdoc')}"


# After running the command, the interpreter says whether torch was ever imported.
TORCH_AFTER = """
import sys
from kvdoc.__main__ import main
try:
    main({argv!r})
except SystemExit:
    pass
print("TORCH" if "torch" in sys.modules else "NO-TORCH", file=sys.stderr)
"""


@pytest.mark.parametrize(("argv", "torch"), [
    (["memory", "--model", "Llama-3-8B"], False),
    (["memory", "--help"], False),
    (["memory", "--layers", "2", "--kv-heads", "1", "--head-dim", "4", "--seq-len", "8",
      "--dtype", "bf16"], False),
    (["--help"], False),
    (["--version"], False),
    (["bench", "--help"], True),  # the check can tell: bench's module needs torch
    (["prefix-report", SAMPLE, "--summary"], False),
])
def test_what_a_command_imports(argv: list[str], torch: bool) -> None:
    result = run("-c", TORCH_AFTER.format(argv=argv))
    assert result.stderr.strip().splitlines()[-1] == ("TORCH" if torch else "NO-TORCH"), (
        result.stderr)


def _options(command: str) -> list[argparse.Action]:
    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_has_help(command: str) -> None:
    options = _options(command)
    assert options, f"{command} has no options: the check would pass on nothing"
    bare = [(a.option_strings or [a.dest])[0] for a in options if not (a.help or "").strip()]
    assert not bare, f"{command} options without help: {bare}"


def test_the_top_level_lists_every_command_without_loading_it() -> None:
    parser = build_parser(["--help"])
    text = parser.format_help()
    assert all(name in text for name in COMMANDS)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    # a command that was not named has its summary but none of its options
    assert [a.dest for a in sub.choices["memory"]._actions] == ["help"]


def _help_texts(command: str) -> dict[str, str]:
    """Every text ``command --help`` prints: its usage, description and each option's help."""
    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    texts = {"--help": sub.choices[command].format_help()}
    texts.update({(a.option_strings or [a.dest])[0]: a.help or "" for a in _options(command)})
    return texts


MARKUP = re.compile(r"``|:(?:func|mod|data|class|meth|attr|term|doc|ref):`")


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_has_no_markup(command: str | None) -> None:
    texts = ({"--help": build_parser(["--help"]).format_help()} if command is None
             else _help_texts(command))
    leaks = {where: MARKUP.findall(text) for where, text in texts.items() if MARKUP.search(text)}
    assert not leaks, f"reST markup in {command or 'the top-level'} help: {leaks}"


def test_the_markup_check_sees_markup() -> None:
    assert MARKUP.search("see :func:`~kvdoc.measure.kv_bytes.kv_bytes`")
    assert MARKUP.search("``python -m kvdoc``")
    assert not MARKUP.search(plain("``python -m kvdoc``: :func:`~a.b` and :data:`c.d`"))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_usage_is_short(command: str) -> None:
    # a usage line that spells out a long list of choices runs past a few terminal lines
    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    usage = sub.choices[command].format_usage()
    spelled = [c.split(",") for c in re.findall(r"\{([^}]*)\}", usage)]
    assert len(usage.splitlines()) <= 6 and all(len(c) <= 5 for c in spelled), usage


# (argv, words the error must contain): lengths and counts no command can run
NONSENSE = [
    (["verify", "--workers", "0"], "--workers"),
    (["verify", "--workers", "x"], "--workers"),
    (["verify", "--variant", "nope"], "no broken variant 'nope'"),
    (["bench", "--new-tokens", "0"], "new_tokens"),
    (["bench", "--new-tokens", "-3"], "new_tokens"),
    (["bench", "--samples", "0"], "samples"),
    (["bench", "--warmup", "-1"], "warmup"),
    (["bench", "--threads", "0"], "threads"),
    (["bench", "--roofline-samples", "0"], "roofline_samples"),
    (["bench", "--prefix-lens", "0"], "prefix length 0"),
    (["bench", "--prefix-lens", "10" * 10], "prefix length"),
    (["bench", "--prefix-lens", ""], "--prefix-lens"),
    (["bench", "--growth-lengths", ","], "--growth-lengths"),
    (["bench", "--growth-lengths", "1"], "growth length 1"),
    (["memory", "--model", "Llama-3-8B", "--seq-len", "0"], "--seq-len"),
    (["memory", "--model", "Llama-3-8B", "--seq-len", "1" + "0" * 20], "--seq-len"),
    (["memory", "--model", "Llama-3-8B", "--batch", "-1"], "--batch"),
    (["memory", "--model", "Llama-3-8B", "--window", "0"], "--window"),
    (["memory", "--model", "Llama-3-8B", "--memory", "nan"], "--memory"),
    (["memory", "--layers", "0", "--kv-heads", "1", "--head-dim", "4", "--seq-len", "8"],
     "--layers"),
    (["memory", "--layers", "2", "--kv-heads", "1", "--head-dim", "2.5", "--seq-len", "8"],
     "--head-dim"),
    (["parallel", "--tp", "0"], "--tp"),
    (["parallel", "--cp", "-2"], "--cp"),
    (["parallel", "--tp", "64"], "at most"),
    (["parallel", "--prompt-len", "0"], "--prompt-len"),
    (["parallel", "--models", "gpt2", "--prompt-len", "9" * 15], "positions; the model has"),
    (["parallel", "--models", "gpt2", "--new-tokens", "100000"], "positions; the model has"),
    (["parallel", "--handover", "push", "--block-size", "0"], "--block-size"),
    (["parallel", "--handover", "push", "--have", "1"], "--have needs --handover pull"),
    (["parallel", "--models", "gpt2", "--handover", "pull", "--have", "-1"], "not have=-1"),
    (["prefix-report", "/no/such/prompts.txt"], "/no/such/prompts.txt"),
    (["prefix-report", SAMPLE, "--block-size", "0"], "block_size"),
    (["prefix-report", SAMPLE, "--replicas", "2", "--route", "random"], "route"),
    (["prefix-report", SAMPLE, "--tokenizer", "/no/such/tokenizer"], "/no/such/tokenizer"),
]


@pytest.mark.parametrize(("argv", "words"), NONSENSE, ids=[" ".join(a) for a, _ in NONSENSE])
def test_nonsense_lengths_exit_2_and_say_why(argv: list[str], words: str, capsys, monkeypatch):
    """In this process, as ``python -m kvdoc`` runs them (each command's module imported once,
    not an interpreter a case); verify's fork server is not started here (a process-wide
    setting), and the torch threads are put back in case a command set them before failing.
    An exception that is not a refusal fails the test with its traceback."""
    monkeypatch.setattr(cli, "_start_fork_server", lambda argv: None)
    threads = torch.get_num_threads()
    try:
        code = cli.main(list(argv))
    except SystemExit as done:
        code = done.code
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert code == 2, (code, err[-2000:])
    assert words in err, err[-2000:]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_refusal_exits_2_from_its_own_process(command: str) -> None:
    """One nonsense case a command as a process of its own: the exit status and the message
    the shell sees, and no traceback."""
    argv, words = next(case for case in NONSENSE if case[0][0] == command)
    result = run("-m", "kvdoc", *argv)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert words in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
