#!/usr/bin/env python3
"""Run a service module under :mod:`tracemalloc`, writing a snapshot every few seconds (``bench_rss --trace``).

``python bench/tracemalloc_run.py OUT_DIR EVERY_S MODULE [ARGS ...]`` starts tracing (one frame per
allocation), then runs ``python -m MODULE ARGS`` in this process; a daemon thread dumps
``OUT_DIR/snap-<n>.pickle`` every ``EVERY_S`` wall seconds. :func:`growth` compares two of them: the lines
whose allocations grew most, which is how a structure that is not bounded by the window is found.
"""

from __future__ import annotations

import runpy
import sys
import threading
import time
import tracemalloc
from pathlib import Path


def growth(first: Path, last: Path, top: int = 15) -> list[str]:
    """The ``top`` source lines whose live allocations grew most from snapshot ``first`` to ``last``
    (one line each: growth in KiB, blocks, ``file:line``)."""
    a = tracemalloc.Snapshot.load(str(first))
    b = tracemalloc.Snapshot.load(str(last))
    stats = b.compare_to(a, "lineno")
    return [
        f"{s.size_diff / 1024:+9.1f} KiB {s.count_diff:+8d} blocks  {s.traceback[0].filename}:{s.traceback[0].lineno}"
        for s in stats[:top]
    ]


def main() -> None:
    out, every_s, module, *args = sys.argv[1:]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(1)

    def dump() -> None:
        n = 0
        while True:
            time.sleep(float(every_s))  # the sampling period of a benchmark tool, not a synchronisation
            tracemalloc.take_snapshot().dump(str(out_dir / f"snap-{n:04d}.pickle"))
            n += 1

    threading.Thread(target=dump, daemon=True).start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
