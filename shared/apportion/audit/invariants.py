"""Detectors of the invariants of rule D3.invariants, as pure functions over events or a cycle's state.

Each detector names every breach it finds (never just a count), so a test can
feed it a log with one injected fault and check that it names exactly that
fault (``tests/unit/test_invariants.py``):

* :func:`double_bookings`: a ``JobPlaced`` on a GPU that a running (not
  stopping) run still holds, or on a GPU the node does not have. GPUs of a
  preempted (stopping) run are handed to its preemptor, which is allowed.
  The holding of GPUs is the domain's own fold (:class:`ClusterState`), so
  the detector and the dispatcher cannot disagree on what "held" means.
* :func:`partial_gangs`: a ``JobPlaced`` whose placements are not exactly
  ``replicas`` distinct nodes with ``gpus_per_replica`` distinct GPUs each
  (gang placement is all or nothing).
* :func:`idle_while_waiting`: after a cycle, a waiting job that fits the free
  GPUs of ``ready`` nodes outside the cycle's reservation (no GPU may idle
  while a placeable job waits).

Protection violations (a preemption inside a run's protection) are detected by
:func:`apportion.audit.replay.preemption_report` on logs and by the simulator.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from apportion.domain.cluster import ClusterState, Node
from apportion.events import Event, JobPlaced
from apportion.timeutil import to_us

__all__ = ["Breach", "double_bookings", "partial_gangs", "idle_while_waiting", "Waiting"]


@dataclass(frozen=True, slots=True)
class Breach:
    """One broken invariant.

    Attributes:
        check: ``"double_booking"``, ``"partial_gang"`` or ``"idle_while_waiting"``.
        subject: what broke it (``"job#attempt"``, or a job id).
        at_us: event time, µs UTC (``None`` for a state check).
        detail: one line for people.
    """

    check: str
    subject: str
    at_us: int | None
    detail: str


def double_bookings(evts: Iterable[Event]) -> list[Breach]:
    """Placements on GPUs that another running run holds, in log order.

    Args:
        evts: events in log order (any types; the cluster fold ignores the rest).

    Returns:
        One :class:`Breach` per (placement, GPU) held by a non-stopping run of
        another job, or outside the node's GPU indices.
    """
    cs = ClusterState()
    out: list[Breach] = []
    for ev in evts:
        if isinstance(ev, JobPlaced) and (ev.job_id, ev.attempt) not in cs.runs:
            subject = f"{ev.job_id}#{ev.attempt}"
            for p in ev.placements:
                node = cs.nodes.get(p.node_id)
                if node is None:
                    continue
                holders = {
                    (n, g): run
                    for key in cs.node_runs.get(p.node_id, ())
                    if (run := cs.runs.get(key)) is not None and not run.stopping
                    for r in run.open_replicas
                    if (n := run.placements[r].node_id) == p.node_id
                    for g in run.placements[r].gpus
                }
                for g in p.gpus:
                    if not 0 <= g < node.gpu_count:
                        out.append(
                            Breach(
                                "double_booking",
                                subject,
                                to_us(ev.ts),
                                f"GPU {p.node_id}/{g} does not exist ({node.gpu_count} GPUs)",
                            )
                        )
                        continue
                    other = holders.get((p.node_id, g))
                    if other is not None and other.job_id != ev.job_id:
                        out.append(
                            Breach(
                                "double_booking",
                                subject,
                                to_us(ev.ts),
                                f"GPU {p.node_id}/{g} is held by running {other.job_id}#{other.attempt}",
                            )
                        )
        cs.apply(ev)
    return out


def partial_gangs(evts: Iterable[Event]) -> list[Breach]:
    """``JobPlaced`` events that do not place a whole gang.

    A gang of k replicas of g GPUs is placed whole: k placements, on k
    distinct nodes, each with g distinct GPUs (rule D3.placement).
    """
    out: list[Breach] = []
    for ev in evts:
        if not isinstance(ev, JobPlaced):
            continue
        subject = f"{ev.job_id}#{ev.attempt}"
        nodes = [p.node_id for p in ev.placements]
        problems = []
        if len(nodes) != ev.replicas:
            problems.append(f"{len(nodes)} of {ev.replicas} replicas placed")
        if len(set(nodes)) != len(nodes):
            problems.append(f"replicas share a node ({', '.join(sorted(nodes))})")
        short = [p.node_id for p in ev.placements if len(set(p.gpus)) != ev.gpus_per_replica]
        if short:
            problems.append(f"not {ev.gpus_per_replica} distinct GPUs on {', '.join(short)}")
        if problems:
            out.append(Breach("partial_gang", subject, to_us(ev.ts), "; ".join(problems)))
    return out


@dataclass(frozen=True, slots=True)
class Waiting:
    """A waiting job as the idle check needs it: id, shape g x k and model (``None``: any)."""

    job_id: str
    gpus_per_replica: int
    replicas: int
    gpu_model: str | None = None


def idle_while_waiting(
    nodes: Mapping[str, Node], waiting: Iterable[Waiting], reserved: Collection[str] = ()
) -> list[Breach]:
    """Jobs left waiting after a cycle although free GPUs could run them.

    Args:
        nodes: the cluster's nodes after the cycle's decisions.
        waiting: jobs still pending after the cycle.
        reserved: nodes held by the cycle's reservation (their free GPUs are
            kept for its holder; rule D3.scheduling-cycle).

    Returns:
        One :class:`Breach` per waiting job whose gang fits on distinct
        ``ready`` nodes outside ``reserved`` (model matching, g free GPUs each),
        in the order given.
    """
    free = sorted(
        ((n.gpu_model, len(n.free)) for nid, n in nodes.items() if n.state == "ready" and nid not in reserved),
        key=lambda x: (x[0] or "", x[1]),
    )
    out: list[Breach] = []
    for job in waiting:
        fits = [c for m, c in free if c >= job.gpus_per_replica and (job.gpu_model is None or m == job.gpu_model)]
        if len(fits) >= job.replicas:
            out.append(
                Breach(
                    "idle_while_waiting",
                    job.job_id,
                    None,
                    f"{job.replicas} x {job.gpus_per_replica} GPUs"
                    f"{' of ' + job.gpu_model if job.gpu_model else ''} fit on free GPUs of {len(fits)} ready nodes",
                )
            )
    return out
