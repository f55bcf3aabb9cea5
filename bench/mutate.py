"""Mutation testing of the rule modules (``make mutate``): fair share, occupancy, the preemption rule.

Each target module is mutated by mutmut (2.x: the 3.x line needs a click that
faust-streaming refuses) in a scratch copy of the checkout, so the work tree is
never touched, and judged by the table tests that name its rules. Bytecode
caching is off in the runner: a mutant of the same length written within one
second of the original would otherwise run the stale ``.pyc`` and "survive";
and any failing exit (a mutant that breaks the import exits 2) counts as a kill.
Hypothesis runs its ``mutate`` profile (fewer, fixed examples; tests/conftest.py).

Prints one line per module (killed, survived, timeout, score) and the ids of
the survivors (``mutmut show ID`` in the scratch dir shows each); exits 1 when
a module scores below ``--min-score`` (default 90%).

Usage: ``.venv/bin/python bench/mutate.py [--only fairshare] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent

#: module -> the tests that must kill its mutants
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fairshare": ("shared/apportion/domain/fairshare.py", ("tests/unit/test_fairshare.py",)),
    "occupancy": ("shared/apportion/domain/occupancy.py", ("tests/unit/test_occupancy.py",)),
    "preemption": (
        "shared/apportion/domain/preemption.py",
        ("tests/unit/test_preemption_rules.py", "tests/unit/test_engine.py"),
    ),
}


def _statuses(scratch: Path) -> dict[str, list[int]]:
    """Mutant ids by mutmut status (``ok_killed``, ``bad_survived``, ``bad_timeout``, ``ok_suspicious``,
    ``untested``, ``skipped``), read from mutmut's cache (its ``results`` command lists no killed mutants)."""
    import sqlite3

    db = sqlite3.connect(scratch / ".mutmut-cache")
    try:
        out: dict[str, list[int]] = {}
        for mid, status in db.execute("select id, status from Mutant order by id"):
            out.setdefault(status, []).append(mid)
        return out
    finally:
        db.close()


def run(name: str, module: str, tests: tuple[str, ...], base: Path) -> tuple[int, int, int, list[int]]:
    """Mutate ``module`` in a fresh copy under ``base``; ``(total, survived, timeout, survivor ids)``."""
    scratch = base / name
    shutil.copytree(
        ROOT,
        scratch,
        ignore=shutil.ignore_patterns(".venv*", ".run", ".git", "__pycache__", "infra/kafka/lib", ".mutmut-cache"),
    )
    env = dict(os.environ, HYPOTHESIS_PROFILE="mutate", PYTHONDONTWRITEBYTECODE="1")
    # mutmut 2 counts only exit code 1 as a kill; a mutant that breaks the import makes pytest exit 2
    # ("interrupted"), which it would count as a survivor: any failure is mapped to 1
    runner = (
        f"sh -c 'env PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=shared:. HYPOTHESIS_PROFILE=mutate {VENV / 'python'} "
        f"-m pytest -x -q -p no:cacheprovider {' '.join(tests)} || exit 1'"
    )
    subprocess.run(
        [str(VENV / "mutmut"), "run", "--paths-to-mutate", module, "--runner", runner, "--no-progress"],
        cwd=scratch,
        env=env,
        check=False,
        stdout=subprocess.DEVNULL,
    )
    got = _statuses(scratch)
    survived = sorted(got.get("bad_survived", []) + got.get("ok_suspicious", []))  # suspicious: slow but passed
    timeout = len(got.get("bad_timeout", []))  # a mutant that makes the tests hang is caught: a kill
    total = sum(len(v) for k, v in got.items() if k not in ("untested", "skipped"))
    return total, len(survived), timeout, survived


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(TARGETS), action="append", help="mutate only this module (repeat)")
    ap.add_argument("--min-score", type=float, default=90.0, help="fail below this %% of mutants killed")
    ap.add_argument("--keep", type=Path, help="keep the scratch copies here (to `mutmut show` survivors)")
    args = ap.parse_args(argv)
    if shutil.which("mutmut", path=str(VENV)) is None:
        print("mutate: mutmut is not installed; run `make mutate` (installs the [mutate] extra)", file=sys.stderr)
        return 2
    base = args.keep or Path(tempfile.mkdtemp(prefix="apportion-mutate-"))
    base.mkdir(parents=True, exist_ok=True)
    worst = 100.0
    for name in args.only or sorted(TARGETS):
        module, tests = TARGETS[name]
        if not (ROOT / module).exists():
            print(f"mutate: {name}: {module} does not exist", file=sys.stderr)
            return 2
        total, survived, timeout, ids = run(name, module, tests, base)
        killed = total - survived
        score = 100.0 * killed / total if total else 100.0
        worst = min(worst, score)
        print(
            f"mutate: {name} ({module}): {total} mutants, {killed} killed ({timeout} by timeout), "
            f"{survived} survived: score {score:.1f}%"
        )
        if ids:
            print(f"  survivors (mutmut show ID in {base / name}): {', '.join(map(str, ids))}")
    if args.keep is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if worst >= args.min_score else 1


if __name__ == "__main__":
    sys.exit(main())
