"""Node agent on real Kafka, run in-process: register, run a simulated workload, refuse bad commands.

Fresh ``APPORTION_TOPIC_PREFIX`` per test; every wait bounded.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from apportion.settings import topic_name
from tests.checkpoint_workload import WORKLOAD
from tests.node_boundary import ALICE, job_accounts, shared_dir, write_script

__all__ = ["job_accounts", "shared_dir"]  # fixtures used by name

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
            events.StartWorkload(
                ts=now, node_id="itest-1", job_id="j1", attempt=1, gpus=(0, 1), duration_s=500.0, fencing_token=1
            )
        )  # 0.5 s wall
        producer.publish(
            events.StartWorkload(
                ts=now, node_id="itest-7", job_id="j2", attempt=1, gpus=(0,), duration_s=5.0, fencing_token=1
            )
        )  # unknown node
        producer.publish(
            events.StartWorkload(
                ts=now, node_id="itest-0", job_id="j3", attempt=1, gpus=(4,), duration_s=5.0, fencing_token=1
            )
        )  # no GPU 4

        def job_events():
            return [r.event for r in read_log(kafka_bootstrap, [topic_name(JOBS)]) if r.event is not None]

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
        nodes = [r.event for r in read_log(kafka_bootstrap, [topic_name(NODES)]) if r.event is not None]
        assert sorted(e.node_id for e in nodes if isinstance(e, events.NodeRegistered)) == ["itest-0", "itest-1"]
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
        producer.close()


async def test_live_checkpoint_preempt_and_resume(kafka_bootstrap, monkeypatch, job_accounts, shared_dir):
    """A real process checkpoints, is stopped, checkpoints on SIGTERM, and attempt 2 resumes from it, running
    as its user (``apportion-t-alice``) in its cgroup, in a directory that is hers.

    Every step waits for the events it needs in the log (bounded); the
    expected progress values are exactly what the script writes.
    """
    import json
    import os

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.bus.reader import read_log
    from apportion.clock import make_clock
    from apportion.topics import JOBS
    from services.node_agent.app import run
    from services.node_agent.config import NodeAgentSettings

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"t{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    tmp_path = shared_dir  # the job's account must reach its script and its directories
    script = write_script(shared_dir, "workload.py", WORKLOAD)
    settings = NodeAgentSettings(
        kafka_bootstrap=kafka_bootstrap,
        sim_nodes=1,
        gpus_per_node=2,
        node_prefix="ckpt-",
        heartbeat_interval_s=60,
        checkpoint_root=tmp_path / "ckpt",
        job_log_dir=tmp_path / "logs",
        progress_poll_wall_s=0.05,
    )
    clock = make_clock(1.0)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(settings, stop, clock=clock, ready=ready))
    producer = EventProducer(kafka_bootstrap, client_id="test")
    job, node = "ckpt-job", "ckpt-0"
    ckpt = tmp_path / "ckpt" / job
    loop = asyncio.get_running_loop()

    def job_log() -> list:
        recs = [r for r in read_log(kafka_bootstrap, [topic_name(JOBS)]) if r.event is not None and r.key == job]
        return [r.event for r in sorted(recs, key=lambda r: (r.partition, r.offset))]

    async def wait_for(pred, what: str) -> list:
        end = loop.time() + DEADLINE_S
        while True:
            evs = await asyncio.to_thread(job_log)
            if pred(evs):
                return evs
            assert loop.time() < end, f"timed out waiting for {what}; saw {[(e.type, e.attempt) for e in evs]}"
            await asyncio.sleep(0.05)

    def checkpoints(evs: list, attempt: int) -> list[float]:
        return [e.progress_s for e in evs if isinstance(e, events.JobCheckpointed) and e.attempt == attempt]

    def start(attempt: int) -> events.StartWorkload:
        return events.StartWorkload(
            ts=clock.now(),
            node_id=node,
            job_id=job,
            attempt=attempt,
            gpus=(0, 1),
            command=("python3", str(script)),
            fencing_token=1,
            user=ALICE,
        )

    try:
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
        producer.publish(start(1))
        await wait_for(lambda evs: checkpoints(evs, 1) == [10.0], "attempt 1's first checkpoint")
        (ckpt / "go").touch()
        await wait_for(lambda evs: checkpoints(evs, 1) == [10.0, 20.0], "attempt 1's second checkpoint")
        producer.publish(
            events.StopWorkload(ts=clock.now(), node_id=node, job_id=job, attempt=1, grace_s=30.0, reason="preempted")
        )
        await wait_for(lambda evs: any(isinstance(e, events.JobFailed) for e in evs), "attempt 1 to exit")
        producer.publish(start(2))
        evs = await wait_for(lambda evs: any(isinstance(e, events.JobCompleted) for e in evs), "attempt 2 to end")

        kinds = [(e.type, e.attempt, getattr(e, "progress_s", None)) for e in evs]
        assert kinds == [
            ("JobStarted", 1, None),
            ("JobCheckpointed", 1, 10.0),
            ("JobCheckpointed", 1, 20.0),
            ("JobCheckpointed", 1, 25.0),  # written on SIGTERM; in the log before the exit
            ("JobFailed", 1, None),
            ("JobStarted", 2, None),
            ("JobCheckpointed", 2, 35.0),  # 25 resumed + 10
            ("JobCompleted", 2, None),
        ]
        assert all((e.node_id, e.replica) == (node, 0) for e in evs if isinstance(e, events.JobCheckpointed))
        assert len({e.event_id for e in evs}) == len(evs)
        assert evs[4].reason == "stopped"
        seen = [json.loads((ckpt / f"seen-{a}.json").read_text()) for a in (1, 2)]
        assert seen == [
            {"attempt": 1, "resumed_s": 0.0, "cwd": str(ckpt), "job": job},
            {"attempt": 2, "resumed_s": 25.0, "cwd": str(ckpt), "job": job},
        ]
        out = tmp_path / "logs" / job / "attempt-2.replica-0.out"
        assert out.read_text() == "attempt 2 resumed from 25.0\n"
        alice = job_accounts[ALICE]
        assert [(os.stat(d).st_uid, os.stat(d).st_mode & 0o777) for d in (ckpt, out.parent)] == [
            (alice.pw_uid, 0o700)
        ] * 2
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
        producer.close()
