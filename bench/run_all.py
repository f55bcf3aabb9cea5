#!/usr/bin/env python3
"""Run every ``bench/bench_*.py`` in name order; print each target with met or missed, and the guards.

Each benchmark is a script that prints its own figures and exits non-zero when it misses its target (design
D9). This runner shows their output as it comes, reads the figures its targets name from it (:data:`TARGETS`),
and ends with a summary: each script's exit status and time, each target's figure with ``met`` or ``MISSED``,
and each guarded figure against a stored baseline (:data:`GUARDS`): no figure may get worse by more than 10%
(``GUARD_SLACK``). Run with the project's venv::

    make bench
    .venv/bin/python bench/run_all.py [NAME_SUBSTRING ...] [--baseline FILE] [--save-baseline FILE]

``--save-baseline`` writes the figures read in this run to FILE (JSON, figure name -> value) for later runs
to be compared with; the default baseline is ``bench/baseline.json`` when it exists. Exit status 1 when a
script failed, a target was missed or a guard was exceeded.
"""

from __future__ import annotations

import argparse
import json
import operator
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: The baseline a run's guarded figures are compared with when ``--baseline`` is not given (if it exists).
DEFAULT_BASELINE = HERE / "baseline.json"

#: How much worse than its baseline a guarded figure may get (design D9: "no target gets worse by > 10%").
GUARD_SLACK = 0.10

_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge}


@dataclass(frozen=True, slots=True)
class Target:
    """One figure a benchmark prints: where to find it, and its bound (``None``: guarded only).

    Attributes:
        script: the benchmark's file name.
        name: the figure, as the summary prints it (also its key in a baseline file).
        pattern: a regular expression whose first group is the figure (commas allowed) in the script's output.
        op: ``"<="`` (less is better) or ``">="`` (more is better).
        bound: the target, or ``None`` for a figure that is only guarded against its baseline.
        guarded: compared with its baseline (:data:`GUARD_SLACK`).
    """

    script: str
    name: str
    pattern: str
    op: str
    bound: float | None
    guarded: bool = False

    def read(self, output: str) -> float | None:
        """The figure in ``output`` (its last occurrence), or ``None`` when the script did not print it."""
        found = re.findall(self.pattern, output)
        if not found:
            return None
        last = found[-1]
        return float((last[0] if isinstance(last, tuple) else last).replace(",", ""))

    def met(self, value: float) -> bool:
        return self.bound is None or _OPS[self.op](value, self.bound)

    def worse(self, value: float, base: float) -> float:
        """How much worse ``value`` is than ``base``, as a share of ``base`` (negative: better)."""
        if base == 0:
            return 0.0
        return (value - base) / base if self.op == "<=" else (base - value) / base


#: Every target and guard the benchmarks print (rule D9; the live ones: D9.live-stack).
TARGETS: tuple[Target, ...] = (
    Target(
        "bench_engine.py",
        "engine cycle p99, steady, ms",
        r"engine cycle ms \(steady\).*?p99 ([\d.]+)",
        "<=",
        50.0,
        True,
    ),
    Target("bench_live.py", "submit-to-StartWorkload p50, ms", r"latency over \d+ jobs: p50 ([\d.]+) ms", "<=", 15.0),
    Target("bench_live.py", "sustained placements/s", r"-> ([\d,.]+) placements/s", ">=", 2500.0, True),
    Target(
        "bench_live.py", "last JobStarted after the first submission, s", r"last JobStarted at ([\d.]+) s", "<=", None
    ),
    Target(
        "bench_live.py",
        "accounting rebuild, % of the raw consume",
        r"events/s \([\d.]+ s\) = (\d+)% of raw \(target",
        ">=",
        50.0,
        True,
    ),
    Target("bench_occupancy.py", "occupancy bulk rebuild, s", r"bulk rebuild:\s+([\d.]+) s", "<=", 10.0, True),
    Target("bench_restart.py", "dispatcher rebuild, full replay, s", r"full replay ([\d.]+) s", "<=", None, True),
    Target(
        "bench_restart.py", "dispatcher restart from a snapshot, speed-up", r"\(([\d.]+)x faster\)", ">=", 3.0, True
    ),
    Target("bench_sim.py", "simulator, 100,000 jobs, wall s", r"wall ([\d.]+) s \(target <= 60\)", "<=", 60.0, True),
)


def summary(
    outputs: dict[str, str], baseline: dict[str, float], targets: Iterable[Target] = TARGETS
) -> tuple[list[str], dict[str, float], bool]:
    """``(lines, figures, ok)``: one line per target of the scripts that ran (figure, bound, met or MISSED, and
    against the baseline when guarded), the figures read, and whether every one was met and within its guard."""
    lines: list[str] = []
    figures: dict[str, float] = {}
    ok = True
    for t in targets:
        if t.script not in outputs:
            continue
        value = t.read(outputs[t.script])
        if value is None:
            lines.append(f"MISSED {t.name}: not printed by {t.script}")
            ok = False
            continue
        figures[t.name] = value
        verdict = "met   " if t.met(value) else "MISSED"
        ok &= t.met(value)
        text = f"{verdict} {t.name}: {value:,.2f}" + (f" (target {t.op} {t.bound:,.0f})" if t.bound is not None else "")
        if t.guarded:
            base = baseline.get(t.name)
            if base is None:
                text += "; no baseline"
            else:
                worse = t.worse(value, base)
                within = worse <= GUARD_SLACK
                ok &= within
                text += f"; baseline {base:,.2f}, {100 * worse:+.0f}% worse" + (
                    "" if within else " (GUARD EXCEEDED: > 10%)"
                )
        lines.append(text)
    return lines, figures, ok


def run(script: Path) -> tuple[int, str]:
    """Run one benchmark, showing its output as it comes; ``(exit status, output)``."""
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=HERE.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        seen.append(line)
    return proc.wait(), "".join(seen)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="run only the scripts whose name holds one of these")
    ap.add_argument("--baseline", type=Path, help=f"figures to guard against (default {DEFAULT_BASELINE.name})")
    ap.add_argument("--save-baseline", type=Path, help="write this run's figures here (JSON)")
    a = ap.parse_args(argv)
    scripts = sorted(HERE.glob("bench_*.py"))
    if a.names:
        scripts = [s for s in scripts if any(n in s.name for n in a.names)]
    if not scripts:
        print("no bench/bench_*.py found")
        return 0
    base_file = a.baseline or (DEFAULT_BASELINE if DEFAULT_BASELINE.is_file() else None)
    baseline = json.loads(base_file.read_text()) if base_file is not None else {}
    results: list[tuple[str, int, float]] = []
    outputs: dict[str, str] = {}
    for script in scripts:
        print(f"=== {script.name}", flush=True)
        t0 = time.monotonic()
        rc, outputs[script.name] = run(script)
        results.append((script.name, rc, time.monotonic() - t0))
    print("\n=== summary")
    for name, rc, secs in results:
        print(f"{'ok  ' if rc == 0 else 'FAIL'} {name} ({secs:.1f}s)")
    lines, figures, targets_ok = summary(outputs, baseline)
    print(f"\n=== targets and guards (baseline: {base_file or 'none'})")
    for line in lines:
        print(line)
    if a.save_baseline is not None:
        a.save_baseline.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
        print(f"figures written to {a.save_baseline}")
    return 0 if targets_ok and all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
