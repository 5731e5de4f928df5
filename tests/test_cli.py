"""``python -m kvdoc``: its version, its help, and what it imports before it starts.

The start-up checks run a fresh interpreter: in this one torch is already loaded by other tests.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

import pytest

from kvdoc.proofs.cli import COMMANDS, build_parser


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
    bare = [a.option_strings[0] for a in options if not (a.help or "").strip()]
    assert not bare, f"{command} options without help: {bare}"


def test_the_top_level_lists_every_command_without_loading_it() -> None:
    parser = build_parser(["--help"])
    text = parser.format_help()
    assert all(name in text for name in COMMANDS)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    # a command that was not named has its summary but none of its options
    assert [a.dest for a in sub.choices["memory"]._actions] == ["help"]
