"""A benchmark's data folder: made fresh in the system temp directory, removed when the run ends."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def scratch_dir(prefix: str, keep: bool) -> Iterator[Path]:
    """A new folder ``<temp dir>/<prefix>XXXXXXXX`` for one run's data (broker, logs, journals), removed on
    leaving, an exception or a SIGTERM turned into one included; with ``keep`` it stays and its path is printed
    on stderr."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        if keep:
            print(f"data kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
