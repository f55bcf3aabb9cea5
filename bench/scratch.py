"""A benchmark's data folder: made fresh in the system temp directory, removed when the run ends; and the one
folder of the generated inputs benchmarks reuse across runs, ``<temp dir>/apportion-bench-cache``."""

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


#: The folder, in the system temp directory (``$TMPDIR``, else ``/tmp``), of the inputs benchmarks generate and
#: reuse across runs; removing it clears them.
CACHE_DIR = "apportion-bench-cache"


def cache_file(name: str, *, fresh: bool) -> Path:
    """``<temp dir>/apportion-bench-cache/name`` (the folder made if missing): an input a benchmark generates once
    and reuses, ``name`` holding its parameters. ``fresh`` (a benchmark's ``--no-cache``): the file is removed
    first, so the benchmark generates it again. A benchmark writes it through a temporary file it then renames, so an interrupted run leaves none to reuse."""
    folder = Path(tempfile.gettempdir()) / CACHE_DIR
    folder.mkdir(exist_ok=True)
    path = folder / name
    if fresh:
        path.unlink(missing_ok=True)
    return path


#: What a benchmark that caches its input says in its ``--help``.
CACHE_HELP = (
    f"The generated input is cached in $TMPDIR/{CACHE_DIR}/ (default /tmp; its name holds the parameters) and "
    f"reused by later runs: --no-cache generates it again, and removing the folder clears every benchmark's."
)


def state_env(root: Path) -> dict[str, str]:
    """The services' data folders inside a run's folder ``root``: the node agent's journal and job files
    (``root/node_agent``) and the policy's faust data (``root/policy``, made here: the policy makes its own folder
    in it). Without them a node agent and the policy keep their data in the system temp directory, where it
    outlives the run."""
    (root / "policy").mkdir(parents=True, exist_ok=True)
    return {"APPORTION_STATE_DIR": str(root / "node_agent"), "APPORTION_FAUST_DIR": str(root / "policy")}
