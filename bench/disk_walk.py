"""What one measurement of a job's directories costs the node agent (``docs/security.md``, "Disk").

Makes ``--dirs`` directories of ``--files`` one-byte files each under ``--base`` (default ``/var/tmp``: a disk, not
the tmpfs a ``/tmp`` may be), walks them ``--runs`` times with :func:`services.node_agent.sandbox.disk_use` (no
limit reached: the whole tree), and prints one line per walk: inodes, bytes charged, wall and CPU seconds, the
load average. Removes what it made.

Run::

    .venv/bin/python bench/disk_walk.py [--dirs 100] [--files 1000] [--runs 3] [--base /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.node_agent.sandbox import disk_use


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dirs", type=int, default=100)
    ap.add_argument("--files", type=int, default=1000, help="files per directory")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--base", default="/var/tmp")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="apportion-disk-walk-", dir=args.base)
    try:
        for d in range(args.dirs):
            os.mkdir(f"{root}/d{d}")
            for i in range(args.files):
                with open(f"{root}/d{d}/f{i}", "wb") as f:
                    f.write(b"x")
        for _ in range(args.runs):
            wall, cpu = time.perf_counter(), time.process_time()
            use = disk_use([root], 1 << 62)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(
                f"{use.entries:,} inodes, {use.used_bytes:,} bytes charged: wall {wall:.3f} s, CPU {cpu:.3f} s, "
                f"load {os.getloadavg()[0]:.1f}"
            )
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
