"""``python -m kvdoc <command>``: the equivalence proof, the memory formula, the timings.

Each command is a module that defines ``add_arguments(parser)`` and ``main(args) -> int``,
listed in :data:`COMMANDS`; ``python -m kvdoc --help`` lists them. The parser lives here, in
the lowest layer that can import every command's module (``verify`` is a proof), so that the
catalogue of refusals (:mod:`kvdoc.proofs.refusals`) runs the very parser users get;
``kvdoc/__main__.py`` only calls :func:`main`.

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
from collections.abc import Sequence

COMMANDS = {"verify": "kvdoc.proofs.verify", "memory": "kvdoc.measure.memory",
            "bench": "kvdoc.measure.bench", "parallel": "kvdoc.parallel.cli"}
"""Command name -> the name of the module that implements it."""


def _summary(module: str) -> str:
    """The first line of a module's docstring, read from its source without importing it."""
    spec = importlib.util.find_spec(module)
    with open(spec.origin, encoding="utf-8") as source:
        doc = ast.get_docstring(ast.parse(source.read())) or module
    return doc.strip().splitlines()[0]


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """``python -m kvdoc``'s parser: one subcommand per entry of :data:`COMMANDS`.

    With ``argv``, only the command it names (its first word) gets its options, so only that
    command's module is imported; without, every command does.
    """
    try:  # the package's metadata, as kvdoc.__version__ (a layer may not import the package)
        release = importlib.metadata.version("kvdoc")
    except importlib.metadata.PackageNotFoundError:
        release = "0+unknown"
    parser = argparse.ArgumentParser(prog="python -m kvdoc", description=__doc__.splitlines()[0])
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
    args = build_parser(argv).parse_args(argv)
    return int(args.run(args) or 0)
