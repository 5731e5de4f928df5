"""``python -m kvdoc <command>``: the equivalence proof, the memory formula, the timings,
the parallel checks, the prefix-cache hit rate of a file of prompts.

Each command is a module that defines ``add_arguments(parser)`` and ``main(args) -> int``,
listed in :data:`COMMANDS`; ``python -m kvdoc --help`` lists them. The parser lives at the
package's top, above every layer whose commands it runs; ``kvdoc/__main__.py`` only calls
:func:`main`, and the catalogue of refusals (:mod:`kvdoc.teach.refusals`) runs
``python -m kvdoc`` itself.

A command's module is imported only when that command runs (or its ``--help`` is asked for):
``verify`` and ``bench`` import torch, which takes seconds to load, and ``memory`` and the
top-level ``--help`` need none of it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import re
from collections.abc import Sequence

COMMANDS = {"verify": "kvdoc.proofs.verify", "memory": "kvdoc.measure.memory",
            "bench": "kvdoc.measure.bench", "parallel": "kvdoc.parallel.command",
            "prefix-report": "kvdoc.measure.prefix_report"}
"""Command name -> the name of the module that implements it."""


FORK_SERVED = ("verify",)
"""Commands whose workers and ranks are forked from multiprocessing's fork server, which
:func:`main` starts before it imports the command's module: the server imports the module too,
at the same time on another core, so no process forked from it imports torch again."""


_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")


def plain(text: str) -> str:
    """Docstring text as a terminal shows it: no reST literals or roles, one line.

    >>> plain("``python -m kvdoc memory``: calls :func:`~kvdoc.measure.kv_bytes.kv_bytes`,\\n"
    ...       "see :mod:`kvdoc.measure`.")
    'python -m kvdoc memory: calls kv_bytes, see kvdoc.measure.'
    """
    def role(match: re.Match[str]) -> str:  # ``~a.b.c`` renders as ``c`` in Sphinx too
        target = match.group(1)
        return target.rsplit(".", 1)[-1] if match.group(0).count("~") else target

    return " ".join(_ROLE.sub(role, text).replace("``", "").split())


def _summary(module: str) -> str:
    """A module's first paragraph, plain, less its ``python -m kvdoc NAME:`` prefix; read from
    its source without importing it."""
    spec = importlib.util.find_spec(module)
    with open(spec.origin, encoding="utf-8") as source:
        doc = ast.get_docstring(ast.parse(source.read())) or module
    first = plain(doc.strip().split("\n\n")[0])
    first = re.sub(r"^python -m kvdoc \S+: ", "", first)
    return first[:1].upper() + first[1:]


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """``python -m kvdoc``'s parser: one subcommand per entry of :data:`COMMANDS`.

    With ``argv``, only the command it names (its first word) gets its options, so only that
    command's module is imported; without, every command does.
    """
    try:  # the package's metadata, as kvdoc.__version__ (a layer may not import the package)
        release = importlib.metadata.version("kvdoc")
    except importlib.metadata.PackageNotFoundError:
        release = "0+unknown"
    parser = argparse.ArgumentParser(prog="python -m kvdoc", description=_summary(__name__))
    parser.add_argument("--version", action="version", version=f"kvdoc {release}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = set(COMMANDS) if argv is None else set(argv[:1]) & set(COMMANDS)
    for name, module_name in COMMANDS.items():
        doc = _summary(module_name)
        command = sub.add_parser(name, help=doc, description=doc)
        if name in chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            command.set_defaults(run=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; its exit status."""
    if argv is None:
        import sys

        argv = sys.argv[1:]
    _start_fork_server(argv)
    args = build_parser(argv).parse_args(argv)
    return int(args.run(args) or 0)


def _start_fork_server(argv: Sequence[str]) -> None:
    if argv[:1] and argv[0] in FORK_SERVED and not {"-h", "--help", "--list"} & set(argv):
        import multiprocessing
        from multiprocessing import forkserver

        if "forkserver" in multiprocessing.get_all_start_methods():
            multiprocessing.set_forkserver_preload([COMMANDS[argv[0]]])
            forkserver.ensure_running()  # returns at once; the server imports on its own
