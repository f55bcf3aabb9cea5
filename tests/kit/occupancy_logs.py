"""Random but plausible occupancy logs for property tests (rule D2.occupancy): ``event_logs`` draws placements,
ends, preemptions, cancels, losses and node changes over ``BUDGETS`` and ``NODES``, mostly forward in time with
some skew, duplicates and losses; ``PROP_W`` is the window they are folded over."""

from __future__ import annotations

from hypothesis import strategies as st

from apportion import events as ev
from tests.kit.builders import (
    T0,
    cancelled,
    completed,
    cordoned,
    drain,
    drained,
    failed,
    job_lost,
    node,
    node_lost,
    placed,
    preempted,
    uncordoned,
)

BUDGETS = ("a", "a/x", "a/x/p", "a/y", "b/q")
NODES = ("n0", "n1", "n2")
PROP_W = 100  # seconds


@st.composite
def event_logs(draw):
    """Random but plausible logs: mostly forward time, some skew, duplicates and losses."""
    n = draw(st.integers(1, 60))
    now = T0
    out: list[ev.Event] = []
    for i in range(n):
        step = draw(st.sampled_from([0, 1, 7, 13_000, 500_000, 3_000_000, 40_000_000]))
        now += step
        at = now - draw(st.sampled_from([0, 0, 0, 0, 2_000_000]))  # occasional skew
        kind = draw(
            st.sampled_from(
                [
                    "place",
                    "place",
                    "place",
                    "end",
                    "end",
                    "replica",
                    "preempt",
                    "cancel",
                    "lost",
                    "node",
                    "cordon",
                    "drain",
                    "drained",
                    "uncordon",
                    "nodelost",
                    "dup",
                ]
            )
        )
        job = f"j{draw(st.integers(0, 5))}"
        attempt = draw(st.integers(1, 2))
        eid = ev.det_id("prop", i)
        if kind == "place":
            out.append(
                placed(
                    job,
                    attempt=attempt,
                    budget=draw(st.sampled_from(BUDGETS)),
                    gpus=draw(st.integers(1, 4)),
                    replicas=draw(st.integers(1, 3)),
                    allocated=draw(st.booleans()),
                    at=at,
                    event_id=eid,
                )
            )
        elif kind == "end":
            maker = draw(st.sampled_from([completed, failed]))
            out.append(maker(job, attempt=attempt, at=at, event_id=eid))
        elif kind == "replica":
            out.append(completed(job, attempt=attempt, replica=draw(st.integers(0, 3)), at=at, event_id=eid))
        elif kind == "preempt":
            out.append(preempted(job, attempt=attempt, at=at, event_id=eid))
        elif kind == "cancel":
            out.append(cancelled(job, attempt=draw(st.sampled_from([None, attempt])), at=at, event_id=eid))
        elif kind == "lost":
            back = draw(st.sampled_from([0, 1_000_000, 30_000_000, 10**9]))
            out.append(job_lost(job, attempt=attempt, charged_until=at - back, at=at, event_id=eid))
        elif kind == "dup" and out:
            out.append(out[draw(st.integers(0, len(out) - 1))])
        else:
            nid = draw(st.sampled_from(NODES))
            if kind == "node":
                out.append(node(nid, draw(st.integers(0, 8)), at=at, event_id=eid))
            elif kind == "nodelost":
                back = draw(st.sampled_from([0, 1_000_000, 30_000_000, 10**9]))
                out.append(node_lost(nid, last_heartbeat=at - back, at=at, event_id=eid))
            elif kind != "dup":
                maker = {"cordon": cordoned, "drain": drain, "drained": drained, "uncordon": uncordoned}[kind]
                out.append(maker(nid, at=at, event_id=eid))
    return out
