"""A dispatcher fed by hand for the forecast tests: nodes, submissions, ticks, starts answered at once.

It plays a history through the dispatcher's own ``step`` (a node agent answering ``StartWorkload`` with
``JobStarted`` at once), so the state a forecast reads is the one the dispatcher would hold. Tree ``lab`` with
``a`` and ``b`` at 0.5 each. ``one_job`` is the shortest such history: one node of 4 GPUs and a1 (lab/a, 4 GPUs,
2 days of work) running on it from ``T0``.
"""

from __future__ import annotations

from typing import Any

from apportion import events as ev
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, step
from apportion.timeutil import from_us
from tests.kit.builders import T0, budget_set, completed, started, submitted

CFG = DispatchConfig(heartbeat_timeout_s=None)


class History:
    """A dispatcher fed by hand: nodes, submissions, ticks; starts answered at once; every event kept."""

    def __init__(self) -> None:
        self.state = DispatchState()
        self.log: list[ev.Event] = []
        for path, share in (("lab", 1.0), ("lab/a", 0.5), ("lab/b", 0.5)):
            self.feed(budget_set(path, share), T0)

    def feed(self, e: ev.Event | Tick, at: int) -> History:
        if not isinstance(e, Tick):
            self.log.append(e)
        out = step(self.state, e, at, CFG)
        self.log.extend(out)
        for o in out:
            if isinstance(o, ev.StartWorkload):
                self.feed(started(o.job_id, attempt=o.attempt, replica=o.replica, node=o.node_id, at=at), at)
        return self

    def node(self, node_id: str, gpus: int) -> History:
        e = ev.NodeRegistered(
            event_id=ev.det_id("t", "node", node_id), ts=from_us(T0), producer="agent", node_id=node_id, gpu_count=gpus
        )
        return self.feed(e, T0)

    def submit(
        self, job_id: str, at: int, *, tick: bool = True, time_limit_s: float | None = None, **kw: Any
    ) -> History:
        self.feed(submitted(job_id, at=at, **kw).model_copy(update={"time_limit_s": time_limit_s}), at)
        return self.feed(Tick(at), at) if tick else self

    def complete(self, job_id: str, at: int) -> History:
        self.feed(completed(job_id, replica=0, node="n0", at=at), at)
        return self.feed(Tick(at), at)


def one_job() -> History:
    return History().node("n0", 4).submit("a1", T0, gpus=4, duration_s=2.0 * 86_400)
