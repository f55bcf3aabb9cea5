"""Idle GPUs (Beaker's IDLE): the heartbeat says how long each running replica's GPUs have been idle, and
calls it ``idle`` once that reaches the node's ``idle_after_s`` (default 2 h). The rule is
:func:`services.node_agent.logic.idle_since` (a table here); the agent samples through a
:class:`FakeGpuProbe` on a :class:`ManualClock`.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from apportion.clock import ManualClock
from apportion.events import GpuStatus, NodeHeartbeat, StartWorkload
from apportion.gpu import FakeGpuProbe
from services.node_agent import logic
from services.node_agent.logic import NodeSpec, Workload
from services.node_agent.service import NodeAgent
from tests.kit.node_agent import Sink

T0 = datetime(2026, 1, 5, tzinfo=UTC)
EARLIER = T0 - timedelta(hours=1)
KEY = ("n1", "j", 1, 0)


def _state() -> logic.AgentState:
    node = NodeSpec("n1", FakeGpuProbe.with_gpus(4).inventory.gpus, "sim", False)
    w = Workload("n1", "j", 1, 0, (0, 1), None, 100.0)
    return logic.with_launched(logic.initial_state([node]), w)


def _sample(u0: float | None, u1: float | None) -> tuple[GpuStatus, ...]:
    return (GpuStatus(index=0, utilization_pct=u0), GpuStatus(index=1, utilization_pct=u1), GpuStatus(index=2))


IDLE_SINCE = [
    # id, utilisation of GPUs 0 and 1, idle since before, idle since after the sample at T0
    ("both idle, first sample: since now", 0.0, 0.5, {}, {KEY: T0}),
    ("both idle, already idle: since then", 0.0, 0.0, {KEY: EARLIER}, {KEY: EARLIER}),
    ("one GPU in use: not idle", 0.0, 1.0, {KEY: EARLIER}, {}),
    ("one GPU unknown: no evidence, not idle", 0.0, None, {KEY: EARLIER}, {}),
]


@pytest.mark.parametrize("case_id,u0,u1,before,after", IDLE_SINCE, ids=[c[0] for c in IDLE_SINCE])
def test_idle_since(case_id, u0, u1, before, after):
    assert logic.idle_since(_state(), "n1", _sample(u0, u1), T0, before) == after


async def test_a_run_whose_gpus_stay_idle_past_the_setting_is_reported_idle_in_its_heartbeat():
    probe = FakeGpuProbe.with_gpus(4)
    probe.utilization.update({0: 0.0, 1: 0.0, 2: 80.0})
    clock, sink = ManualClock(T0), Sink()
    node = NodeSpec("n1", probe.inventory.gpus, "sim", False)
    agent = NodeAgent([(node, probe)], sink, clock, idle_after_s=7200.0)
    await agent.start(heartbeats=False, poll_progress=False)
    await agent.on_event(
        StartWorkload(ts=T0, node_id="n1", job_id="j", attempt=1, gpus=(0, 1), duration_s=1e6, fencing_token=1)
    )

    async def beat(after_s: float) -> tuple[float | None, float | None, bool]:
        clock.advance(after_s)
        await agent.heartbeat()
        (r,) = sink.of(NodeHeartbeat)[-1].running
        return r.utilization_pct, r.idle_s, r.idle

    assert await beat(0) == (0.0, 0.0, False)  # idle since this first sample
    assert await beat(7199) == (0.0, 7199.0, False)
    assert await beat(1) == (0.0, 7200.0, True)  # 2 h: idle
    probe.utilization[1] = 50.0
    assert await beat(10) == (25.0, 0.0, False)  # one GPU at work: the count starts again
    probe.utilization[1] = 0.0
    assert await beat(10) == (0.0, 0.0, False)
    assert await beat(7200) == (0.0, 7200.0, True)
    await agent.shutdown(grace_s=0.0)
