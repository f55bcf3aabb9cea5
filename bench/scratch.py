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


def state_env(root: Path) -> dict[str, str]:
    """The services' data folders inside a run's folder ``root``: the node agent's journal and job files
    (``root/node_agent``) and the policy's faust data (``root/policy``, made here: the policy makes its own folder
    in it). Without them a node agent and the policy keep their data in the system temp directory, where it
    outlives the run."""
    (root / "policy").mkdir(parents=True, exist_ok=True)
    return {"APPORTION_STATE_DIR": str(root / "node_agent"), "APPORTION_FAUST_DIR": str(root / "policy")}
