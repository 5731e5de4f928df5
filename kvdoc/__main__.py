"""``python -m kvdoc <command>``: the command line of :mod:`kvdoc.cli`, run."""

from __future__ import annotations

import sys

from kvdoc.cli import main

if __name__ == "__main__":
    sys.exit(main())
