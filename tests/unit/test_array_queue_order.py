"""The queue's positions of a job array's elements against the order they start in (found on a local stack:
`submit --array 0-19%4`, then `apportion queue`): the elements past the throttle start lowest index first, as
their pending reason says, but the queue numbers them in the order of their ids as text, so `sweep_10` stands
at position 0 while `sweep_4` is the next to start. Rule D3.scheduling-cycle: the position is the order the
cycle walks."""

from __future__ import annotations

import pytest

from apportion import events as ev
from apportion.domain.dispatch import DispatchState, Tick, step
from services.dispatcher.logic import read_model
from tests.kit.builders import T0, completed, m
from tests.unit.test_job_arrays import CFG, TREE, array_sub, reg


@pytest.mark.xfail(
    strict=True,
    reason="domain.engine.inputs.pending_order sorts equal submission times by job id as text (s_10 < s_2)",
)
def test_the_next_element_to_start_stands_first_in_the_queue() -> None:
    state = DispatchState(TREE)
    step(state, reg(), T0, CFG)
    step(state, array_sub("s", "0-11%2"), T0, CFG)
    step(state, Tick(T0), T0, CFG)  # s_0 and s_1 start
    rows, _ = read_model(state, T0, CFG)
    first = min((r for r in rows.values() if r["state"] == "pending"), key=lambda r: r["position"])
    step(state, completed("s_0", at=m(10), node="n0"), m(10), CFG)
    started = [e.job_id for e in step(state, Tick(m(10)), m(10), CFG) if isinstance(e, ev.JobPlaced)]
    assert started == ["s_2"]
    assert first["job_id"] == "s_2"
