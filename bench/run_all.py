#!/usr/bin/env python3
"""Run every ``bench/bench_*.py`` in name order and report which passed.

Each benchmark is a script that prints its own figures and exits non-zero
when it misses its target (design D9). Run with the project's venv:
``make bench`` or ``.venv/bin/python bench/run_all.py [NAME_SUBSTRING ...]``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    if argv:
        scripts = [s for s in scripts if any(a in s.name for a in argv)]
    if not scripts:
        print("no bench/bench_*.py found")
        return 0
    results: list[tuple[str, int, float]] = []
    for script in scripts:
        print(f"=== {script.name}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        results.append((script.name, rc, time.monotonic() - t0))
    print("\n=== summary")
    for name, rc, secs in results:
        print(f"{'ok  ' if rc == 0 else 'FAIL'} {name} ({secs:.1f}s)")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
