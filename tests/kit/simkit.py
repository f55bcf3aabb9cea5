"""Helpers for seeded simulator scenarios: fixed origin, compact event lines.

A scenario is stated as history (nodes, budgets, jobs, operator actions)
and the expected dispatcher decisions, one compact line per event::

    "01:00:00 JobPreempted a1#1 unallocated by=b1"

Times are offsets from ``T0`` (2024-01-01T00:00:00Z).
"""

from __future__ import annotations

from datetime import UTC, datetime

from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import EngineConfig
from apportion.events import Event, JobLost, JobPlaced, JobPreempted, NodeDrained, NodeLost, StartWorkload, StopWorkload
from apportion.sim.core import SimConfig, SimJob, SimNode, SimResult, simulate
from apportion.timeutil import US_PER_S, to_us

T0: int = to_us(datetime(2024, 1, 1, tzinfo=UTC))


def at(hh: float = 0, mm: float = 0, ss: float = 0) -> int:
    """T0 + hh:mm:ss in µs."""
    return T0 + round((hh * 3600 + mm * 60 + ss) * US_PER_S)


def job(
    job_id: str,
    budget: str,
    *,
    gpus: int = 1,
    replicas: int = 1,
    submit: int = T0,
    min_runtime_s: float = 3600.0,
    duration_s: float = 3600.0,
    user: str = "u",
) -> SimJob:
    """A trace job (``min_runtime_s=0`` is unallocated)."""
    return SimJob(job_id, budget, user, submit, gpus, replicas, min_runtime_s, duration_s)


def nodes(*spec: tuple[str, int]) -> list[SimNode]:
    """``nodes(("n0", 4), ("n1", 4))``."""
    return [SimNode(n, g) for n, g in spec]


def run(
    tree: dict,
    cluster: list[SimNode],
    jobs: list[SimJob],
    *,
    seed: int = 1,
    delta: float = 0.05,
    reservation_after_s: float = 3600.0,
    stop_delay_s: float | None = 5.0,
    **kw,
) -> SimResult:
    """Simulate with the fair-share engine (fixed stop delay unless ``None``)."""
    eng = EngineConfig(delta=delta, reservation_after_s=reservation_after_s, **kw.pop("engine", {}))
    hb = kw.pop("heartbeat_s", None)
    dcfg = DispatchConfig(engine=eng, heartbeat_timeout_s=30.0 if hb else None)
    cfg = SimConfig(seed=seed, dispatch=dcfg, stop_delay_s=stop_delay_s, heartbeat_s=hb, sample_s=0, **kw)
    return simulate(BudgetTree.from_mapping(tree), cluster, jobs, cfg)


def _off(t: int) -> str:
    d = t - T0
    s, us = divmod(d, US_PER_S)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    out = f"{h:02d}:{m:02d}:{s:02d}"
    return out + (f".{us:06d}" if us else "")


def line(e: Event) -> str:
    """One compact line for a dispatcher event."""
    t = _off(to_us(e.ts))
    name = e.type
    if isinstance(e, (NodeDrained, NodeLost)):
        return f"{t} {name} {e.node_id}"
    job_id = getattr(e, "job_id", None)
    assert job_id is not None, e  # the dispatcher's other outputs are all of one job
    head = f"{t} {name} {job_id}#{getattr(e, 'attempt', None)}"
    if isinstance(e, JobPlaced):
        where = " ".join(f"{p.node_id}{list(p.gpus)}" for p in e.placements)
        vic = ",".join(f"{v.job_id}#{v.attempt}" for v in e.decision.victims)
        res = " reserved" if e.decision.reservation else ""
        return f"{head} {where}" + (f" victims={vic}" if vic else "") + res
    if isinstance(e, JobPreempted):
        rule = e.victim.rule if e.victim else e.reason
        return f"{head} {rule}" + (f" by={e.by_job_id}" if e.by_job_id else "")
    if isinstance(e, (StartWorkload, StopWorkload, JobLost)):
        return f"{head} {e.node_id}"
    return head


def decisions(result: SimResult, *, skip: tuple[str, ...] = ("JobQueued",)) -> list[str]:
    """The dispatcher's outputs as compact lines (JobQueued left out by default)."""
    return [line(e) for e in result.log if e.producer == "dispatcher" and e.type not in skip]
