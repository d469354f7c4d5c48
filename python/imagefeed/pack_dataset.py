"""The ``pack-dataset`` command line, shipped in the wheel: the console script ``pack-dataset``
and ``python -m imagefeed.pack_dataset`` (or ``python -m imagefeed``) run the same Rust code as
the ``pack-dataset`` binary built from the repository.

(The module is not named ``imagefeed.pack``: that name is the packing function.)
"""

from __future__ import annotations

import sys
from typing import List, Optional

from . import _native

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Runs ``pack-dataset`` with ``argv`` (default: this process's arguments after the program
    name) and returns its exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    return _native.pack_dataset_main(["pack-dataset", *args])


if __name__ == "__main__":
    sys.exit(main())
