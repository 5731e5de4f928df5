"""``python -m kvdoc <command>``: the equivalence proof, the memory formula, the timings.

Each command is a module that defines ``add_arguments(parser)`` and ``main(args) -> int``,
listed in ``COMMANDS``; ``python -m kvdoc --help`` lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {"verify": "proofs.suite", "memory": "measure.memory", "bench": "measure.bench"}
"""Command name -> the module ``kvdoc.<module>`` that implements it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvdoc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"kvdoc.{module_name}")
        doc = (module.__doc__ or name).strip().splitlines()[0]
        command = sub.add_parser(name, help=doc, description=doc)
        module.add_arguments(command)
        command.set_defaults(run=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
