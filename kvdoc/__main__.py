"""``python -m kvdoc <command>``: the command line of :mod:`kvdoc.proofs.cli`, run."""

from __future__ import annotations

import sys

from kvdoc.proofs.cli import main

if __name__ == "__main__":
    sys.exit(main())
