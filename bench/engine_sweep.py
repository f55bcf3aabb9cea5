"""Fair share under one engine knob at a time: the week-44 targets (or any slice's figures) per seed.

Usage (traces from ``$APPORTION_DATA_DIR``, else ``../shared/data`` beside the checkout)::

    .venv/bin/python bench/engine_sweep.py [--trace philly|itp] [--slice week44] [--seeds 1,2,3]
        [--budgets FILE] [--tail-h H] [--fifo-p95-h 104.2] [--out ROWS.jsonl] SPEC [SPEC ...]

Each SPEC is ``base`` (every ``EngineConfig`` default) or ``knob=value[,knob=value...]`` with ``knob`` an
``EngineConfig`` field (``patience_s``, ``checkpoint_wait_s``, ``reservation_after_s``, ``protection_cap_w``,
``protection_doublings``, ``delta``, ``churn_bound``, ``free_las``, ...); a value ``none`` is ``None``, ``true`` /
``false`` booleans, an integer field takes an integer. Each spec runs once per seed (``apportion simulate``'s
defaults: 300 s cycles; week 44 until every job is done, ``--tail-h`` otherwise) and prints one row: mean
share deficit (pp), JCT p95 (h) against ``--fifo-p95-h`` (FIFO's week-44 JCT p95 on seeds 1-3 is 104.2 h),
completed, never placed, allocated wait p95 (h), the most preemptions of one allocated job, protection
violations and GPU-hours idle while a fitting job waits; ``ok`` where both week-44 targets are met (deficit
<= 0.5 pp, JCT p95 <= FIFO's). ``--out`` appends each row as JSON. Not part of ``make bench`` (a study).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = {
    "philly": ("philly/philly.csv", "infra/budgets/philly.yaml"),
    "itp": ("itp/itp.csv", "infra/budgets/itp.yaml"),
}
RUN_ARGS = (
    "patience_s",
    "checkpoint_wait_s",
    "protection_cap_w",
    "protection_doublings",
    "delta",
    "churn_bound",
    "reservation_after_s",
    "gang_rule",
    "free_order",
    "progress_after",
    "at_share_bound",
)
"""Knobs that ``apportion.cli.simulate._run`` takes by name; every other one goes through its ``knobs``."""


def parse_spec(spec: str) -> dict[str, Any]:
    """``knob=value,...`` -> typed ``EngineConfig`` values; ``base`` -> {}."""
    from apportion.domain.engine import EngineConfig

    if spec == "base":
        return {}
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for part in spec.split(","):
        name, _, raw = part.partition("=")
        if name not in fields or not raw:
            raise SystemExit(f"error: {part!r}: expected KNOB=VALUE with KNOB an EngineConfig field")
        default = getattr(EngineConfig(), name)
        if raw.lower() == "none":
            out[name] = None
        elif isinstance(default, bool):
            out[name] = raw.lower() in ("1", "true", "yes")
        elif isinstance(default, int) or "int" in str(fields[name].type):
            out[name] = int(raw)
        else:
            out[name] = float(raw)
    return out


def _opt(argv: list[str], name: str, default: str) -> str:
    if name in argv:
        i = argv.index(name)
        value = argv[i + 1]
        del argv[i : i + 2]
        return value
    return default


def main(argv: list[str]) -> int:
    from apportion.cli.simulate import _run
    from apportion.settings import default_data_dir
    from apportion.sim.traces import load_budget_file, load_trace

    argv = list(argv)
    trace = _opt(argv, "--trace", "philly")
    slice_ = _opt(argv, "--slice", "week44")
    seeds = [int(s) for s in _opt(argv, "--seeds", "1,2,3").split(",")]
    path, budgets = TRACES[trace]
    bf = load_budget_file(ROOT / _opt(argv, "--budgets", budgets))
    tail = _opt(argv, "--tail-h", "")
    fifo_h = float(_opt(argv, "--fifo-p95-h", "104.2"))
    out = _opt(argv, "--out", "")
    if not argv:
        print(__doc__)
        return 2
    specs = [(spec, parse_spec(spec)) for spec in argv]
    print(f"{'spec':<34} seed  deficit  JCT p95 (vs {fifo_h})  completed  never  wait p95  most  viol  idle  ok")
    for seed in seeds:
        jobs = load_trace(default_data_dir() / path, bf, seed, slice_)
        for spec, knobs in specs:
            named = {k: v for k, v in knobs.items() if k in RUN_ARGS}
            rest = {k: v for k, v in knobs.items() if k not in RUN_ARGS}
            t0 = time.perf_counter()
            rep = _run("fairshare", bf, jobs, seed, 300.0, float(tail) if tail else None, knobs=rest, **named)
            d = rep.__dict__
            jct = (d["jct_p95_s"] or 0.0) / 3600
            idle = d["idle_waiting_alloc_gpu_h"] + d["idle_waiting_unalloc_gpu_h"]
            ok = d["mean_deficit_pp"] <= 0.5 and jct <= fifo_h
            print(
                f"{spec:<34} {seed:>4}  {d['mean_deficit_pp']:7.2f}  {jct:8.1f} ({jct - fifo_h:+6.1f})     "
                f"{d['completed']:>9,}  {d['never']:>5,}  {(d['wait_p95_s'] or 0) / 3600:8.1f}  "
                f"{d['max_preemptions_allocated']:>4}  {d['violations']:>4}  {idle:4.0f}  {'ok' if ok else '-'}",
                flush=True,
            )
            if out:
                row = {"spec": spec, "seed": seed, "slice": slice_, "wall_s": time.perf_counter() - t0}
                row |= {k: v for k, v in d.items() if isinstance(v, (int, float, str)) or v is None}
                with open(out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
