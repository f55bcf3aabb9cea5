"""A short simulated log for the audit tests (budgets, the dispatcher's decisions, accounting snapshots) and
``export``, which writes a log as an export file under a topic namespace.

History (tree drawn below; two 1-GPU nodes, delta 0.01)::

    lab (1.0)
    ├── a  0.5     a1, a2 at 0:00 (1 h protection, run 10 h): a holds both GPUs
    └── b  0.5     b1 at 0:01 -> at 1:00 b1 preempts a1 (r_a 2.0 vs r_b 0; after the
                   move r_b = 3600 / 3600 = 1.0 <= 2.0); b2 at 2:00 -> preempts a2
                   (r_a = 2 * 10800 / 7200 = 3.0, r_b = 1.0, after 2.0)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from apportion import events
from apportion.audit.replay import occupancy_at
from apportion.audit.source import write_export
from apportion.audit.verify import records_from_events
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import EngineConfig
from apportion.timeutil import from_us
from tests.kit.simkit import T0, at, job, nodes, run

AB = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}
CFG = DispatchConfig(engine=EngineConfig(delta=0.01), heartbeat_timeout_s=None)


def history(snapshot_times: tuple[int, ...] = ()) -> list[events.Event]:
    """Budgets, the simulated scenario, and accounting snapshots at the given times."""
    jobs = [
        job("a1", "lab/a", min_runtime_s=3600, duration_s=10 * 3600),
        job("a2", "lab/a", min_runtime_s=3600, duration_s=10 * 3600),
        job("b1", "lab/b", submit=at(0, 1), min_runtime_s=3600, duration_s=10 * 3600),
        job("b2", "lab/b", submit=at(2), min_runtime_s=3600, duration_s=3600),
    ]
    r = run(AB, nodes(("n0", 1), ("n1", 1)), jobs, until_us=at(3), delta=0.01)
    log: list[events.Event] = [
        events.BudgetSet(path=p, share=s, ts=from_us(T0 - 1), producer="ops") for p, s in AB.items()
    ]
    log += r.log
    base = records_from_events(log)
    for t in snapshot_times:
        snap, _ = occupancy_at(base, t)
        log.append(snap.model_copy(update={"producer": "accounting"}))
    return log


def export(path: Path, evts: list[events.Event], prefix: str, topic_names: list[str] | None = None) -> str:
    recs = [dataclasses.replace(r, topic=prefix + r.topic) for r in records_from_events(evts)]
    names = topic_names if topic_names is not None else sorted({r.topic for r in recs})
    write_export(recs, path, topic_names=names, exported_at="now")
    return str(path)
