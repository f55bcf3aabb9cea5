"""Node agent on real Kafka, run in-process: register, run a simulated workload, refuse bad commands.

Fresh ``APPORTION_TOPIC_PREFIX`` per test; every wait bounded.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0


async def test_node_agent_runs_commands_from_kafka(kafka_bootstrap, monkeypatch):
    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.bus.reader import read_log
    from apportion.clock import make_clock
    from apportion.topics import JOBS, NODES
    from services.node_agent.app import run
    from services.node_agent.config import NodeAgentSettings

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"t{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    clock = make_clock(1000.0)  # 1000 event seconds per wall second
    settings = NodeAgentSettings(
        kafka_bootstrap=kafka_bootstrap,
        sim_nodes=2,
        gpus_per_node=4,
        node_prefix="itest-",
        heartbeat_interval_s=60,
        heartbeat_min_wall_s=0.2,
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(settings, stop, clock=clock, ready=ready))
    producer = EventProducer(kafka_bootstrap, client_id="test")
    try:
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
        now = clock.now()
        producer.publish(
            events.StartWorkload(ts=now, node_id="itest-1", job_id="j1", attempt=1, gpus=(0, 1), duration_s=500.0)
        )  # 0.5 s wall
        producer.publish(
            events.StartWorkload(ts=now, node_id="itest-7", job_id="j2", attempt=1, gpus=(0,), duration_s=5.0)
        )  # unknown node
        producer.publish(
            events.StartWorkload(ts=now, node_id="itest-0", job_id="j3", attempt=1, gpus=(4,), duration_s=5.0)
        )  # no GPU 4

        def job_events():
            return [r.event for r in read_log(kafka_bootstrap, [JOBS.name]) if r.event is not None]

        loop = asyncio.get_running_loop()
        end = loop.time() + DEADLINE_S
        while True:
            evs = await asyncio.to_thread(job_events)
            if any(isinstance(e, events.JobCompleted) for e in evs):
                break
            assert loop.time() < end, f"no JobCompleted; saw {[e.type for e in evs]}"
            await asyncio.sleep(0.1)
        started = [e for e in evs if isinstance(e, events.JobStarted)]
        assert [(e.job_id, e.node_id, e.gpus) for e in started] == [("j1", "itest-1", (0, 1))]
        refused = sorted((e.job_id, e.reason.split(":")[0]) for e in evs if isinstance(e, events.WorkloadRefused))
        assert refused == [("j2", "unknown_node"), ("j3", "unknown_gpus")]
        nodes = [r.event for r in read_log(kafka_bootstrap, [NODES.name]) if r.event is not None]
        assert sorted(e.node_id for e in nodes if isinstance(e, events.NodeRegistered)) == ["itest-0", "itest-1"]
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
        producer.close()
