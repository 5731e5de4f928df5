"""``python -m kvdoc <command>``: the equivalence proof, the memory formula, the timings.

Each command is a module that defines ``add_arguments(parser)`` and ``main(args) -> int``,
listed in :data:`COMMANDS`; ``python -m kvdoc --help`` lists them. The parser lives here, in
the lowest layer that can import every command's module (``verify`` is a proof), so that the
catalogue of refusals (:mod:`kvdoc.proofs.refusals`) runs the very parser users get;
``kvdoc/__main__.py`` only calls :func:`main`.
"""

from __future__ import annotations

import argparse

from kvdoc.measure import bench, memory

from . import verify

COMMANDS = {"verify": verify, "memory": memory, "bench": bench}
"""Command name -> the module that implements it."""


def build_parser() -> argparse.ArgumentParser:
    """``python -m kvdoc``'s parser: one subcommand per entry of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog="python -m kvdoc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        doc = (module.__doc__ or name).strip().splitlines()[0]
        command = sub.add_parser(name, help=doc, description=doc)
        module.add_arguments(command)
        command.set_defaults(run=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; its exit status."""
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)
