"""The four services on real Kafka and Redis, in-process, on an accelerated clock.

Each test gets its own topic namespace (``APPORTION_TOPIC_PREFIX``) and Redis
database, runs node agent, dispatcher, accounting and policy as asyncio
tasks sharing one :class:`~apportion.clock.ScaledClock`, talks to them only
through Kafka (submissions in, the log out), and bounds every wait with a
deadline (no sleeps as synchronisation).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pytest

pytestmark = pytest.mark.integration

SCALE = 60.0  # event seconds per wall second
DEADLINE_S = 60.0


@dataclass
class Cluster:
    """Handles on a running in-process cluster."""

    bootstrap: str
    redis_url: str
    clock: Any
    producer: Any
    stop: asyncio.Event

    def publish(self, *evts: Any) -> None:
        for e in evts:
            self.producer.publish(e)

    def log(self) -> list[Any]:
        from apportion import topics
        from apportion.bus.reader import read_log

        names = [t.name for t in topics.ALL_TOPICS]
        return [r.event for r in read_log(self.bootstrap, names) if r.event is not None]

    def submit(self, job_id: str, budget: str, gpus: int, min_runtime_s: float, duration_s: float,
               user: str = "alice") -> Any:
        from apportion import events

        now = self.clock.now()
        ev = events.JobSubmitted(job_id=job_id, budget=budget, user=user, gpus_per_replica=gpus,
                                 min_runtime_s=min_runtime_s, duration_s=duration_s, submitted_at=now,
                                 ts=now, producer="test")
        self.publish(ev)
        return ev

    async def until(self, pred: Callable[[list[Any]], Any], what: str) -> list[Any]:
        """Poll the log until ``pred(log)`` is truthy; fail after the deadline."""
        loop = asyncio.get_running_loop()
        end = loop.time() + DEADLINE_S
        while True:
            evs = await asyncio.to_thread(self.log)
            if pred(evs):
                return evs
            if loop.time() > end:
                kinds = [(type(e).__name__, getattr(e, "job_id", getattr(e, "node_id", ""))) for e in evs[-30:]]
                pytest.fail(f"timed out after {DEADLINE_S}s waiting for {what}; last events: {kinds}")
            await asyncio.sleep(0.1)


def of_job(evs: list[Any], job_id: str) -> list[str]:
    """Type names of the job-topic and submission events of ``job_id``, in log order."""
    from apportion import events

    return [e.type for e in evs if getattr(e, "job_id", None) == job_id
            and events.TOPIC_OF[e.type].base in ("apportion.jobs", "apportion.submissions")]


@pytest.fixture
async def cluster(kafka_bootstrap: str, redis_url: str, monkeypatch: pytest.MonkeyPatch,
                  request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    import redis as redis_lib

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.clock import ScaledClock
    from services.accounting.app import run as run_accounting
    from services.accounting.config import AccountingSettings
    from services.dispatcher.app import run as run_dispatcher
    from services.dispatcher.config import DispatcherSettings
    from services.node_agent.app import run as run_agent
    from services.node_agent.config import NodeAgentSettings
    from services.policy.app import run as run_policy
    from services.policy.config import PolicySettings

    nodes, gpus = getattr(request, "param", (2, 4))
    tag = uuid.uuid4().hex[:8]
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"e2e{tag}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    db_url = redis_url.rsplit("/", 1)[0] + "/12"
    redis_lib.Redis.from_url(db_url).flushdb()

    now = datetime.now(timezone.utc)
    clock = ScaledClock(SCALE, now, now)
    common = {"kafka_bootstrap": kafka_bootstrap, "redis_url": db_url, "log_json": False}
    stop = asyncio.Event()
    ready = [asyncio.Event() for _ in range(4)]
    producer = EventProducer(kafka_bootstrap, client_id="e2e-test")
    t0 = clock.now()
    for path, share in (("lab", 1.0), ("lab/a", 0.5), ("lab/b", 0.5)):
        producer.publish(events.BudgetSet(path=path, share=share, ts=t0, producer="test"))
    tasks = [
        asyncio.create_task(run_agent(NodeAgentSettings(**common, sim_nodes=nodes, gpus_per_node=gpus,
                                                        node_prefix=f"n{tag}-", group_id=f"agent-{tag}",
                                                        heartbeat_interval_s=30.0), stop, clock=clock,
                                      ready=ready[0])),
        asyncio.create_task(run_dispatcher(DispatcherSettings(**common, instance_id=f"d-{tag}", grace_s=5.0,
                                                              heartbeat_timeout_s=600.0), stop, clock=clock,
                                           ready=ready[1])),
        asyncio.create_task(run_accounting(AccountingSettings(**common, snapshot_debounce_wall_s=0.1), stop,
                                           clock=clock, ready=ready[2])),
        asyncio.create_task(run_policy(PolicySettings(**common), stop, clock=clock, ready=ready[3])),
    ]
    try:
        all_ready = asyncio.create_task(asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), DEADLINE_S))
        done, _ = await asyncio.wait([all_ready, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if all_ready not in done:  # a service ended before it was ready: show why
            all_ready.cancel()
            failed = next(t for t in tasks if t in done)
            raise AssertionError("a service stopped during start-up") from failed.exception()
        all_ready.result()
        c = Cluster(kafka_bootstrap, db_url, clock, producer, stop)
        await c.until(lambda evs: sum(isinstance(e, events.NodeRegistered) for e in evs) >= nodes,
                      "node registrations")
        yield c
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        producer.close()
        # the lease must not outlive the test: the next test's dispatcher would wait for it
        redis_lib.Redis.from_url(db_url).flushdb()


async def test_submit_place_start_complete(cluster: Cluster) -> None:
    """A job goes submitted -> queued -> placed -> started -> completed through all services."""
    from apportion import events

    cluster.submit("j1", "lab/a", gpus=2, min_runtime_s=60, duration_s=30)
    evs = await cluster.until(lambda evs: "JobCompleted" in of_job(evs, "j1"), "j1 to complete")
    assert of_job(evs, "j1") == ["JobSubmitted", "JobQueued", "JobPlaced", "JobStarted", "JobCompleted"]
    placed = next(e for e in evs if isinstance(e, events.JobPlaced))
    starts = [e for e in evs if isinstance(e, events.StartWorkload) and e.job_id == "j1"]
    assert len(starts) == 1 and starts[0].gpus == placed.placements[0].gpus
    assert placed.fencing_token is not None and starts[0].fencing_token == placed.fencing_token
    assert placed.decision.victims == ()


async def test_malformed_submission_is_dead_lettered_and_service_keeps_running(cluster: Cluster) -> None:
    from kafka import KafkaProducer

    from apportion import events, topics

    raw = KafkaProducer(bootstrap_servers=cluster.bootstrap)
    raw.send(topics.SUBMISSIONS.name, key=b"bad", value=b'{"type": "JobSubmitted", "schema_version": 9}')
    raw.send(topics.SUBMISSIONS.name, key=b"bad2", value=b"not json")
    raw.flush()
    raw.close()
    cluster.submit("after-bad", "lab/a", gpus=1, min_runtime_s=60, duration_s=10)
    evs = await cluster.until(lambda evs: "JobCompleted" in of_job(evs, "after-bad"), "the next job to complete")
    letters = [e for e in evs if isinstance(e, events.DeadLetter) and e.source_topic == topics.SUBMISSIONS.name]
    reasons = sorted(e.error for e in letters)
    assert {e.source_key for e in letters} == {"bad", "bad2"}
    assert any("schema_version 9 is newer" in r for r in reasons)
    assert any("not valid JSON" in r for r in reasons)


@pytest.mark.parametrize("cluster", [(1, 4)], indirect=True)
async def test_unallocated_job_is_preempted_for_an_allocated_one(cluster: Cluster) -> None:
    """One node, 4 GPUs: an unallocated job holding all of them yields to an allocated job and is requeued."""
    from apportion import events

    cluster.submit("free", "lab/b", gpus=4, min_runtime_s=0, duration_s=36000)
    await cluster.until(lambda evs: "JobStarted" in of_job(evs, "free"), "the unallocated job to start")
    cluster.submit("paid", "lab/a", gpus=4, min_runtime_s=60, duration_s=30)
    evs = await cluster.until(lambda evs: "JobCompleted" in of_job(evs, "paid"), "the allocated job to complete")
    pre = next(e for e in evs if isinstance(e, events.JobPreempted) and e.job_id == "free")
    assert (pre.by_job_id, pre.attempt, pre.victim.rule) == ("paid", 1, "unallocated")
    req = next(e for e in evs if isinstance(e, events.JobRequeued) and e.job_id == "free")
    sub = next(e for e in evs if isinstance(e, events.JobSubmitted) and e.job_id == "free")
    assert req.attempt == 2 and req.submitted_at == sub.submitted_at
    placed = next(e for e in evs if isinstance(e, events.JobPlaced) and e.job_id == "paid")
    assert [(v.job_id, v.rule) for v in placed.decision.victims] == [("free", "unallocated")]
    # the allocated job starts only after the victim stopped (or its grace passed)
    order = [(type(e).__name__, getattr(e, "job_id", "")) for e in evs]
    stop_i = order.index(("StopWorkload", "free"))
    start_i = order.index(("StartWorkload", "paid"))
    assert stop_i < start_i
