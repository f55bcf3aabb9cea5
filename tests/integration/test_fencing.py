"""Fencing and agent restarts on real Kafka (and Redis): ``docs/leadership.md``.

* a node agent obeys only the current leader: starts without a token, with
  a stale one or out of range are refused with the exact reason; a stale
  ``NodeLost`` is ignored and the healthy run keeps running;
* after a Redis flush (a restart without persistence) the next leader's
  token, floored by the log, is above every token seen, and agents take it;
* an agent killed with SIGKILL and restarted inside the heartbeat timeout
  loses no run silently: live processes and simulated workloads are
  adopted, a process that died meanwhile is reported ``JobLost``; the
  restarted agent is back in its consumer group within seconds (static
  membership), not after the 45 s session timeout.

Fresh ``APPORTION_TOPIC_PREFIX`` per test; every wait is on log events or
log lines with a bounded deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from apportion.bus.security import redis_auth
from apportion.settings import topic_name
from tests.kit.node_boundary import ALICE, job_accounts, machine_stack_hidden, running, shared_dir, write_script

__all__ = ["job_accounts", "machine_stack_hidden", "shared_dir"]  # fixtures used by name

#: an agent reads no stack of the machine (a running `make up`, or the marker `make down` left)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("machine_stack_hidden")]

DEADLINE_S = 60.0
HUGE_S = 10.0**6  # a simulated workload that outlives the test


def _log(bootstrap: str, names: list[str]) -> list[Any]:
    from apportion.bus.reader import read_log

    return [r.event for r in read_log(bootstrap, names) if r.event is not None]


async def until(bootstrap: str, names: list[str], pred: Callable[[list[Any]], object], what: str) -> list[Any]:
    """Read ``names`` until ``pred(events)`` is truthy (bounded by DEADLINE_S)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while True:
        evs = await asyncio.to_thread(_log, bootstrap, names)
        if pred(evs):
            return evs
        assert loop.time() < end, f"timed out waiting for {what}; saw {[e.type for e in evs][-30:]}"
        await asyncio.sleep(0.2)  # polling interval of a bounded wait on the log, not a synchronisation


def of(evs: list[Any], kind: str, job: str | None = None) -> list[Any]:
    return [e for e in evs if e.type == kind and (job is None or getattr(e, "job_id", None) == job)]


class LogLines(logging.Handler):
    """Collects the agent's log lines, so a test waits on "disregarded ..." instead of sleeping."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def wait_line(lines: LogLines, text: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not any(text in x for x in lines.lines):
        assert loop.time() < end, f"no log line {text!r}"
        await asyncio.sleep(0.05)


async def _agent(kafka_bootstrap: str, prefix: str, tmp_path):
    from services.node_agent.app import run
    from services.node_agent.config import NodeAgentSettings

    settings = NodeAgentSettings(
        kafka_bootstrap=kafka_bootstrap,
        sim_nodes=2,
        gpus_per_node=4,
        node_prefix=prefix,
        heartbeat_interval_s=0.5,
        heartbeat_min_wall_s=0.2,
        state_dir=tmp_path / "agent",
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(settings, stop, ready=ready))
    await asyncio.wait_for(ready.wait(), DEADLINE_S)
    return stop, task


async def test_agent_refuses_tokenless_stale_and_out_of_range_starts_and_ignores_a_stale_loss(
    kafka_bootstrap, monkeypatch, tmp_path
):
    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.clock import WallClock
    from apportion.topics import JOBS, NODES

    tag = uuid.uuid4().hex[:6]
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"fence{tag}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    lines = LogLines()
    logging.getLogger("apportion.node_agent").addHandler(lines)
    n0, n1 = f"f{tag}-0", f"f{tag}-1"
    stop, task = await _agent(kafka_bootstrap, f"f{tag}-", tmp_path)
    producer = EventProducer(kafka_bootstrap, client_id="test")
    clock = WallClock()

    def start(job: str, node: str, token: int | None) -> Any:
        return events.StartWorkload(
            ts=clock.now(), node_id=node, job_id=job, attempt=1, gpus=(0,), duration_s=HUGE_S, fencing_token=token
        )

    try:
        producer.publish(start("healthy", n0, 7))  # the current leader: 7
        await until(kafka_bootstrap, [topic_name(JOBS)], lambda e: of(e, "JobStarted", "healthy"), "healthy to start")
        producer.publish(start("none", n1, None))
        producer.publish(start("stale", n1, 6))
        producer.publish(start("huge", n1, 2**62))
        producer.publish(start("zero", n1, 0))
        evs = await until(
            kafka_bootstrap, [topic_name(JOBS)], lambda e: len(of(e, "WorkloadRefused")) >= 4, "four refusals"
        )
        refused = {e.job_id: e.reason for e in of(evs, "WorkloadRefused")}
        assert refused == {
            "none": "missing_fencing_token: a command without a leader's token",
            "stale": "stale_fencing_token: token 6 < 7",
            "huge": f"fencing_token_out_of_range: token {2**62} not in [1, 2**53]",
            "zero": "fencing_token_out_of_range: token 0 not in [1, 2**53]",
        }
        assert [e.job_id for e in of(evs, "JobStarted")] == ["healthy"]

        # a resumed ex-leader (token 6) declares n0 lost: ignored, the healthy run keeps running
        producer.publish(
            events.NodeLost(ts=clock.now(), node_id=n0, last_heartbeat=clock.now(), fencing_token=6, producer="old")
        )
        await wait_line(lines, f"disregarded NodeLost: loss of {n0}: token 6 < 7")
        mark = clock.now()
        evs = await until(
            kafka_bootstrap,
            [topic_name(NODES)],
            lambda e: any(h.type == "NodeHeartbeat" and h.node_id == n0 and h.ts > mark for h in e),
            "a heartbeat of n0 after the stale loss",
        )
        hb = [h for h in evs if h.type == "NodeHeartbeat" and h.node_id == n0 and h.ts > mark][0]
        assert [r.job_id for r in hb.running] == ["healthy"]
        assert len([e for e in evs if e.type == "NodeRegistered" and e.node_id == n0]) == 1  # no rejoin
        jobs = await asyncio.to_thread(_log, kafka_bootstrap, [topic_name(JOBS)])
        assert not of(jobs, "JobFailed") and not of(jobs, "JobLost")

        # a stale stop is ignored too; the current leader's loss is obeyed
        producer.publish(events.StopWorkload(ts=clock.now(), node_id=n0, job_id="healthy", attempt=1, fencing_token=6))
        await wait_line(lines, "disregarded stop of healthy attempt 1: token 6 < 7")
        producer.publish(
            events.NodeLost(ts=clock.now(), node_id=n0, last_heartbeat=clock.now(), fencing_token=7, producer="lead")
        )
        evs = await until(
            kafka_bootstrap,
            [topic_name(JOBS), topic_name(NODES)],
            lambda e: len([x for x in e if x.type == "NodeRegistered" and x.node_id == n0]) == 2,
            "n0 to be fenced and to register again",
        )
        (failed,) = of(evs, "JobFailed", "healthy")
        assert failed.reason == "stopped"
    finally:
        logging.getLogger("apportion.node_agent").removeHandler(lines)
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
        producer.close()


async def test_redis_flush_then_log_floor_gives_a_token_the_agents_accept(
    kafka_bootstrap, redis_url, monkeypatch, tmp_path
):
    """Leaders 1..4 publish; Redis loses everything; the next leader floors on the log and gets 5, which agents run."""
    import redis as redis_lib

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.clock import WallClock
    from apportion.topics import COMMANDS, JOBS, NODES
    from services.dispatcher.lease import Lease, highest_token_in_log

    tag = uuid.uuid4().hex[:6]
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"floor{tag}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    base = redis_url.rstrip("/").rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url.rstrip("/")
    r = redis_lib.Redis.from_url(f"{base}/10", **redis_auth())
    r.flushdb()
    node = f"r{tag}-0"
    stop, task = await _agent(kafka_bootstrap, f"r{tag}-", tmp_path)
    producer = EventProducer(kafka_bootstrap, client_id="test")
    clock = WallClock()
    try:
        seen = []
        for i in range(4):  # four leaders in turn, each starting one replica with its token
            lease = Lease(r, f"d{i}", ttl_s=60)
            tok = lease.try_acquire(
                floor=await asyncio.to_thread(highest_token_in_log, kafka_bootstrap, [topic_name(COMMANDS)])
            )
            seen.append(tok)
            producer.publish(
                events.StartWorkload(
                    ts=clock.now(),
                    node_id=node,
                    job_id=f"j{i}",
                    attempt=1,
                    gpus=(i,),
                    duration_s=HUGE_S,
                    fencing_token=tok,
                )
            )
            lease.release()
        assert seen == [1, 2, 3, 4]
        await until(kafka_bootstrap, [topic_name(JOBS)], lambda e: len(of(e, "JobStarted")) == 4, "four starts")
        r.flushdb()  # Redis restarted without persistence
        assert (
            await asyncio.to_thread(
                highest_token_in_log, kafka_bootstrap, [topic_name(COMMANDS), topic_name(JOBS), topic_name(NODES)]
            )
            == 4
        )
        naive = Lease(r, "naive", ttl_s=60)
        assert naive.try_acquire() == 1  # without a floor: a token every agent refuses
        naive.release()
        r.flushdb()
        lease = Lease(r, "new-leader", ttl_s=60)
        token = lease.try_acquire(
            floor=await asyncio.to_thread(highest_token_in_log, kafka_bootstrap, [topic_name(COMMANDS)])
        )
        assert token == 5 and token > max(seen)
        producer.publish(
            events.StopWorkload(ts=clock.now(), node_id=node, job_id="j3", attempt=1, grace_s=0, fencing_token=1)
        )
        producer.publish(
            events.StopWorkload(ts=clock.now(), node_id=node, job_id="j0", attempt=1, grace_s=0, fencing_token=token)
        )
        evs = await until(kafka_bootstrap, [topic_name(JOBS)], lambda e: of(e, "JobFailed", "j0"), "j0 to be stopped")
        assert [e.job_id for e in of(evs, "JobFailed")] == ["j0"]  # the token-1 stop of j3 was disregarded
        lease.release()
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
        producer.close()
        r.flushdb()
        r.close()


def test_the_log_floor_counts_only_tokens_the_dispatchers_registered_key_signed(kafka_bootstrap, monkeypatch) -> None:
    """A forged decision with token 2**62 (and in range, 2**40) on the real log must not raise the floor (issue 14)."""
    from datetime import UTC, datetime

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.topics import COMMANDS, JOBS, NODES
    from services.dispatcher.lease import highest_token_in_log
    from tests.kit.signing import dispatcher_identity, dispatcher_signer, node_identity, registered

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"forged{uuid.uuid4().hex[:6]}.")
    provision(kafka_bootstrap)
    t0 = datetime.now(UTC)

    def start(token: int, tag: str) -> events.StartWorkload:
        return events.StartWorkload(ts=t0, node_id="n0", job_id=tag, attempt=1, gpus=(0,), fencing_token=token)

    topics = [topic_name(COMMANDS), topic_name(JOBS), topic_name(NODES)]
    with EventProducer(kafka_bootstrap, client_id="test") as producer:
        real = start(6, "real")
        producer.send(real, dispatcher_signer().values([events.encode(real)])[0])
        for forged, value in (
            (start(2**62, "huge"), None),  # unsigned, and out of range
            (start(2**40, "big"), None),  # unsigned, in range
            (start(2**41, "node"), node_identity("n0").signed_value(start(2**41, "node"))),  # a node's key
        ):
            producer.send(forged, value)
        producer.flush()
        assert highest_token_in_log(kafka_bootstrap, topics) == 2**41  # no key registered yet: an unsigned log
        producer.publish(registered(dispatcher_identity(), t0))
        producer.publish(registered(node_identity("n0"), t0))
    assert highest_token_in_log(kafka_bootstrap, topics) == 6


#: A process that runs until the file named by its first argument exists.
WAITER = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\n"


async def test_agent_killed_and_restarted_inside_the_heartbeat_timeout_loses_no_run(
    kafka_bootstrap, monkeypatch, tmp_path, job_accounts, shared_dir
):
    """kill -9 the agent with three runs; one process dies meanwhile; restart: adopted, adopted, JobLost.

    The processes run as they do on a node, as their user in cgroups of their own: the adopted one is
    stopped through its cgroup after the restart."""
    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.clock import WallClock
    from apportion.topics import JOBS, NODES

    tag = uuid.uuid4().hex[:6]
    ns = f"restart{tag}."
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", ns)
    await asyncio.to_thread(provision, kafka_bootstrap)
    node = f"real{tag}"
    script = write_script(shared_dir, "waiter.py", WAITER)
    env = dict(
        os.environ,
        APPORTION_TOPIC_PREFIX=ns,
        APPORTION_KAFKA_BOOTSTRAP=kafka_bootstrap,
        APPORTION_LOG_JSON="false",
        APPORTION_METRICS_PORT="0",
    )
    argv = [
        sys.executable, "-m", "services.node_agent", "--node-id", node, "--force-simulated", "--gpus-per-node", "4",
        "--heartbeat-interval-s", "1", "--state-dir", str(shared_dir / "state"),
    ]  # fmt: skip
    logf = open(tmp_path / "agent.log", "ab")

    def spawn() -> subprocess.Popen:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)

    def regs(evs: list[Any]) -> list[Any]:
        return [e for e in evs if e.type == "NodeRegistered" and e.node_id == node]

    producer = EventProducer(kafka_bootstrap, client_id="test")
    clock = WallClock()
    agent = spawn()
    again = None
    try:
        await until(kafka_bootstrap, [topic_name(NODES)], lambda e: regs(e), "the agent to register")
        for job, gpus, cmd, dur in [
            ("keep", (0,), ("python3", str(script), str(shared_dir / "keep.go")), None),
            ("dies", (1,), ("python3", str(script), str(shared_dir / "never")), None),
            ("sim", (2,), None, HUGE_S),
        ]:
            producer.publish(
                events.StartWorkload(
                    ts=clock.now(),
                    node_id=node,
                    job_id=job,
                    attempt=1,
                    gpus=gpus,
                    command=cmd,
                    duration_s=dur,
                    fencing_token=3,
                    user=ALICE,
                )
            )
        evs = await until(kafka_bootstrap, [topic_name(JOBS)], lambda e: len(of(e, "JobStarted")) == 3, "three starts")
        first = {e.job_id: e for e in of(evs, "JobStarted")}
        keep_pid, dies_pid = first["keep"].pid, first["dies"].pid
        assert keep_pid and dies_pid

        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        os.killpg(dies_pid, signal.SIGKILL)  # this one dies while its agent is down
        end = time.monotonic() + DEADLINE_S
        while running(dies_pid):
            assert time.monotonic() < end, "the process did not die"
            await asyncio.sleep(0.05)
        assert running(keep_pid)

        restarted_at = time.monotonic()
        again = spawn()
        evs = await until(
            kafka_bootstrap, [topic_name(JOBS), topic_name(NODES)], lambda e: len(regs(e)) == 2, "registration again"
        )
        rejoin_s = time.monotonic() - restarted_at
        evs = await until(
            kafka_bootstrap, [topic_name(JOBS)], lambda e: of(e, "JobLost", "dies"), "the dead run's JobLost"
        )
        print(f"restarted agent registered again after {rejoin_s:.1f} s")
        assert rejoin_s < 30.0, f"the restarted agent took {rejoin_s:.1f} s to register (session timeout?)"
        lost = of(evs, "JobLost", "dies")
        assert [(e.node_id, e.attempt, e.producer) for e in lost] == [(node, 1, "node-agent")]
        # adopted: their JobStarted again, the same event (readers de-duplicate it)
        starts = of(evs, "JobStarted")
        assert sorted(e.job_id for e in starts) == ["dies", "keep", "keep", "sim", "sim"]
        for job in ("keep", "sim"):
            a, b = of(evs, "JobStarted", job)
            assert a == b
        assert not of(evs, "JobFailed"), "the agent's restart was reported as a workload failure"
        mark = clock.now()
        evs = await until(
            kafka_bootstrap,
            [topic_name(NODES)],
            lambda e: any(h.type == "NodeHeartbeat" and h.node_id == node and h.ts > mark for h in e),
            "a heartbeat after the restart",
        )
        hb = [h for h in evs if h.type == "NodeHeartbeat" and h.node_id == node and h.ts > mark][0]
        assert sorted(r.job_id for r in hb.running) == ["keep", "sim"]
        # the adopted process is still the agent's to stop; a start sent before the restart is never run late
        producer.publish(
            events.StopWorkload(ts=clock.now(), node_id=node, job_id="keep", attempt=1, grace_s=5, fencing_token=3)
        )
        evs = await until(
            kafka_bootstrap, [topic_name(JOBS)], lambda e: of(e, "JobFailed", "keep"), "keep to be stopped"
        )
        assert of(evs, "JobFailed", "keep")[0].reason == "stopped"
        end = time.monotonic() + DEADLINE_S
        while running(keep_pid):
            assert time.monotonic() < end, "the adopted process was not stopped"
            await asyncio.sleep(0.05)
        reg2 = regs(await asyncio.to_thread(_log, kafka_bootstrap, [topic_name(NODES)]))[1]
        producer.publish(
            events.StartWorkload(
                ts=reg2.ts - (reg2.ts - first["keep"].ts) / 2,
                node_id=node,
                job_id="late",
                attempt=1,
                gpus=(3,),
                duration_s=5.0,
                fencing_token=3,
            )
        )
        evs = await until(
            kafka_bootstrap, [topic_name(JOBS)], lambda e: of(e, "WorkloadRefused", "late"), "late refused"
        )
        assert of(evs, "WorkloadRefused", "late")[0].reason.startswith("before_registration: sent ")
    finally:
        for p in (agent, again):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)
        for pid in (locals().get("keep_pid"), locals().get("dies_pid")):
            if pid and running(pid):
                os.killpg(pid, signal.SIGKILL)
        producer.close()
        logf.close()
