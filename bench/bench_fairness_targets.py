"""Fair share against its targets on each slice and seed: a table with met / missed per target.

Usage::

    .venv/bin/python bench/bench_fairness_targets.py KIND=FILE [KIND=FILE ...]

Each FILE is the ``--json`` output of ``apportion simulate`` (one or more policies; several files of one
slice and seed are merged, so a run per policy is fine) and KIND names the targets it is judged on:

* ``weeks`` (Philly weeks 39-45, ``--tail-h 0``): completed >= 99% of Slurm's; JCT p95 <= 1.5 x Slurm's;
  never placed <= 1.5 x Slurm's; mean share deficit <= 0.5 pp; goodput >= Slurm's - 0.5 point; at most 5
  preemptions of any allocated job; 0 protection violations; 0 GPU-hours idle while a fitting job waits;
* ``week44`` (Philly week 44 until done): JCT p95 <= FIFO's; mean share deficit <= 0.5 pp; 0 protection
  violations; idle while waiting 0;
* ``itp`` (ITP week 5, homogeneous or heterogeneous): mean share deficit, plain and attainable, below every
  peer's (Slurm, Kueue, KAI); allocated wait p95 <= the best peer's; idle while waiting 0; 0 protection
  violations.

A target whose reference policy is missing from the files is printed as ``n/a``. Example (seed 2)::

    for p in fairshare slurm kueue kai fifo; do
      .venv/bin/apportion simulate --trace /work/shared/data/philly/philly.csv \\
          --budgets infra/budgets/philly.yaml --policy $p --seed 2 --slice week44 --json > w44_s2_$p.json
    done
    .venv/bin/python bench/bench_fairness_targets.py week44=w44_s2_fairshare.json week44=w44_s2_fifo.json ...

Not part of ``make bench``: the simulations take minutes each, and the figures are the point, not a time.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PEERS = ("slurm", "kueue", "kai")
H = 3600.0

Target = tuple[str, Callable[[dict[str, Any], dict[str, dict[str, Any]]], tuple[str, bool | None]]]


def _h(v: float | None) -> float:
    return (v or 0.0) / H


def _idle(f: dict[str, Any]) -> float:
    return float(f["idle_waiting_alloc_gpu_h"]) + float(f["idle_waiting_unalloc_gpu_h"])


def _vs(
    name: str, ref: str, fig: Callable[[dict[str, Any]], float], ok: Callable[[float, float], bool], fmt: str = "{:.2f}"
) -> Target:
    def judge(f: dict[str, Any], ps: dict[str, dict[str, Any]]) -> tuple[str, bool | None]:
        if ref not in ps:
            return f"{fmt.format(fig(f))} (no {ref})", None
        a, b = fig(f), fig(ps[ref])
        return f"{fmt.format(a)} vs {ref} {fmt.format(b)}", ok(a, b)

    return name, judge


def _abs(name: str, fig: Callable[[dict[str, Any]], float], ok: Callable[[float], bool], fmt: str = "{:.2f}") -> Target:
    def judge(f: dict[str, Any], ps: dict[str, dict[str, Any]]) -> tuple[str, bool | None]:
        return fmt.format(fig(f)), ok(fig(f))

    return name, judge


def _below_peers(name: str, fig: Callable[[dict[str, Any]], float], strict: bool) -> Target:
    def judge(f: dict[str, Any], ps: dict[str, dict[str, Any]]) -> tuple[str, bool | None]:
        have = [p for p in PEERS if p in ps]
        if not have:
            return f"{fig(f):.2f} (no peer)", None
        best = min(have, key=lambda p: fig(ps[p]))
        a, b = fig(f), fig(ps[best])
        missing = "" if len(have) == len(PEERS) else f", {len(PEERS) - len(have)} peer(s) missing"
        return f"{a:.2f} vs best peer {best} {b:.2f}{missing}", (a < b if strict else a <= b) if not missing else None

    return name, judge


COMMON: list[Target] = [
    _abs("protection violations 0", lambda f: f["violations"], lambda v: v == 0, "{:.0f}"),
    _abs("idle while waiting 0 GPU-h", _idle, lambda v: v == 0, "{:.0f}"),
]
TARGETS: dict[str, list[Target]] = {
    "weeks": [
        _vs("completed >= 99% of Slurm's", "slurm", lambda f: f["completed"], lambda a, b: a >= 0.99 * b, "{:,.0f}"),
        _vs("JCT p95 <= 1.5 x Slurm's (h)", "slurm", lambda f: _h(f["jct_p95_s"]), lambda a, b: a <= 1.5 * b, "{:.1f}"),
        _vs("never placed <= 1.5 x Slurm's", "slurm", lambda f: f["never"], lambda a, b: a <= 1.5 * b, "{:,.0f}"),
        _abs("mean share deficit <= 0.5 pp", lambda f: f["mean_deficit_pp"], lambda v: v <= 0.5),
        _vs("goodput >= Slurm's - 0.5 pt (%)", "slurm", lambda f: 100 * f["goodput"], lambda a, b: a >= b - 0.5),
        _abs(
            "<= 5 preemptions of one allocated job",
            lambda f: f["max_preemptions_allocated"],
            lambda v: v <= 5,
            "{:.0f}",
        ),
        *COMMON,
    ],
    "week44": [
        _vs("JCT p95 <= FIFO's (h)", "fifo", lambda f: _h(f["jct_p95_s"]), lambda a, b: a <= b, "{:.1f}"),
        _abs("mean share deficit <= 0.5 pp", lambda f: f["mean_deficit_pp"], lambda v: v <= 0.5),
        *COMMON,
    ],
    "itp": [
        _below_peers("mean share deficit < every peer's (pp)", lambda f: f["mean_deficit_pp"], True),
        _below_peers("attainable deficit < every peer's (pp)", lambda f: f["mean_attainable_deficit_pp"], True),
        _below_peers("allocated wait p95 <= best peer's (h)", lambda f: _h(f["wait_p95_s"]), False),
        *COMMON,
    ],
}


def load(args: list[str]) -> dict[tuple[str, str, int], dict[str, dict[str, Any]]]:
    """(kind, label, seed) -> policy -> its figures, from ``KIND=FILE`` arguments; the label is the files' stem
    up to the first ``_`` (so ``w44s2_fairshare.json`` and ``w44s2_slurm.json`` are one slice)."""
    runs: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for arg in args:
        kind, _, path = arg.partition("=")
        if kind not in TARGETS or not path:
            raise SystemExit(f"error: {arg!r}: expected KIND=FILE with KIND one of {', '.join(TARGETS)}")
        label = Path(path).name.split("_", 1)[0]
        for pol in json.loads(Path(path).read_text())["policies"]:
            runs.setdefault((kind, label, int(pol["seed"])), {})[pol["policy"]] = pol
    return runs


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    missed = 0
    for (kind, label, seed), pols in sorted(load(argv).items()):
        print(f"\n{label} ({kind}), seed {seed}")
        if "fairshare" not in pols:
            print("  no fairshare run")
            continue
        f = pols["fairshare"]
        for name, judge in TARGETS[kind]:
            text, ok = judge(f, pols)
            verdict = "n/a" if ok is None else "met" if ok else "MISSED"
            missed += ok is False
            print(f"  {name:<42} {text:<40} {verdict}")
    print(f"\n{missed} target(s) missed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
