"""The four services on real Kafka and Redis, in-process, on an accelerated clock.

Each test gets its own topic namespace (``APPORTION_TOPIC_PREFIX``) and Redis
database, runs node agent, dispatcher, accounting and policy as asyncio
tasks sharing one :class:`~apportion.clock.ScaledClock`, talks to them only
through Kafka (submissions in, the log out), and bounds every wait with a
deadline (no sleeps as synchronisation).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from apportion.bus.security import redis_auth
from apportion.settings import topic_name
from tests.kit.live_cluster import DEADLINE_S, Cluster, cluster, of_job  # noqa: F401 - a fixture
from tests.kit.narrowing import narrow

pytestmark = pytest.mark.integration


async def test_submit_place_start_complete(cluster: Cluster) -> None:
    """`apportion submit` waits for JobQueued/JobRejected: a rejection is one clear line and exit 1; an accepted
    job is reported queued and goes submitted -> queued -> placed -> started -> completed through all services."""
    from typer.testing import CliRunner

    from apportion import events
    from apportion.cli.main import app

    env = {"APPORTION_KAFKA_BOOTSTRAP": cluster.bootstrap}
    runner = CliRunner()
    bad = await asyncio.to_thread(
        runner.invoke,
        app,
        ["submit", "-b", "lab/nosuch", "-g", "1", "-m", "1h", "--duration", "60", "--user", "alice"],
        env=env,
    )
    assert bad.exit_code == 1, bad.output
    assert "rejected: unknown_budget" in bad.output
    good = await asyncio.to_thread(
        runner.invoke,
        app,
        ["submit", "-b", "lab/a", "-g", "2", "-m", "60s", "--duration", "30s", "--user", "alice", "--job-id", "j1"],
        env=env,
    )
    assert good.exit_code == 0, good.output
    assert "queued by the dispatcher" in good.output
    evs = await cluster.until(lambda evs: "JobCompleted" in of_job(evs, "j1"), "j1 to complete")
    assert of_job(evs, "j1") == ["JobSubmitted", "JobQueued", "JobPlaced", "JobStarted", "JobCompleted"]
    placed = next(e for e in evs if isinstance(e, events.JobPlaced))
    starts = [e for e in evs if isinstance(e, events.StartWorkload) and e.job_id == "j1"]
    assert len(starts) == 1 and starts[0].gpus == placed.placements[0].gpus
    assert placed.fencing_token is not None and starts[0].fencing_token == placed.fencing_token
    assert placed.decision.victims == ()


@pytest.mark.parametrize("cluster", [{"nodes": 1, "gpus": 4}], indirect=True)
async def test_a_job_array_runs_throttled_and_cancels_as_one(cluster: Cluster) -> None:
    """`submit --array 0-3%2`: one record, four jobs, never more than two running though the node has room for
    four, each start carrying its index; `hold` and `release` of a second array's id hold and release its pending
    elements, `cancel` cancels all, each saying how many."""
    from typer.testing import CliRunner

    from apportion import events
    from apportion.cli.main import app

    env = {"APPORTION_KAFKA_BOOTSTRAP": cluster.bootstrap}
    runner = CliRunner()
    base = ["submit", "-b", "lab/a", "-g", "1", "-m", "60s", "--user", "alice"]
    res = await asyncio.to_thread(
        runner.invoke, app, [*base, "--duration", "30s", "--job-id", "sw", "--array", "0-3%2"], env=env
    )
    assert res.exit_code == 0 and "queued by the dispatcher" in res.output, res.output
    ids = [f"sw_{i}" for i in range(4)]
    evs = await cluster.until(lambda evs: all("JobCompleted" in of_job(evs, j) for j in ids), "the array to end")
    assert sum(isinstance(e, events.JobSubmitted) for e in evs) == 1
    running, most = set(), 0
    for e in evs:  # the log's order: each start after its placement, each completion after its start
        if isinstance(e, events.JobPlaced):
            running.add(e.job_id)
            most = max(most, len(running))
        elif isinstance(e, events.JobCompleted):
            running.discard(e.job_id)
    assert most == 2
    starts = {e.job_id: e.env for e in evs if isinstance(e, events.StartWorkload)}
    assert starts == {j: {"APPORTION_ARRAY_ID": "sw", "APPORTION_ARRAY_INDEX": j[3:]} for j in ids}
    res = await asyncio.to_thread(
        runner.invoke, app, [*base, "--duration", "1h", "--job-id", "long", "--array", "0-5"], env=env
    )
    assert res.exit_code == 0, res.output
    await cluster.until(lambda evs: sum("JobStarted" in of_job(evs, f"long_{i}") for i in range(6)) == 4, "4 starts")
    for verb, said in (("hold", "held"), ("release", "released")):  # the 2 pending elements, each way
        res = await asyncio.to_thread(runner.invoke, app, [verb, "long", "--user", "alice"], env=env)
        assert res.exit_code == 0 and res.output.strip() == f"{said} long (array: 2 elements)", res.output
    res = await asyncio.to_thread(runner.invoke, app, ["hold", "long", "--user", "alice", "--json"], env=env)
    doc = json.loads(res.output)
    assert (res.exit_code, doc["verdict"], doc["array_elements"], doc["event"]["reason"]) == (
        0, "held", 2, "no reason given"
    ), res.output  # fmt: skip
    res = await asyncio.to_thread(runner.invoke, app, ["release", "long", "--user", "alice", "--json"], env=env)
    assert json.loads(res.output)["array_elements"] == 2, res.output
    res = await asyncio.to_thread(runner.invoke, app, ["cancel", "long", "--user", "alice"], env=env)
    assert res.exit_code == 0 and res.output.strip() == "cancelled long (array: 6 elements)", res.output
    evs = await cluster.until(
        lambda evs: all("JobCancelled" in of_job(evs, f"long_{i}") for i in range(6)), "every element cancelled"
    )
    assert sum(isinstance(e, events.StopWorkload) and e.job_id.startswith("long_") for e in evs) == 4


@pytest.mark.parametrize("cluster", [{"nodes": 1, "gpus": 4}], indirect=True)
async def test_unallocated_job_is_preempted_for_an_allocated_one(cluster: Cluster) -> None:
    """One node, 4 GPUs: an unallocated job holding all of them yields to an allocated job and is requeued."""
    from apportion import events

    cluster.submit("free", "lab/b", gpus=4, min_runtime_s=0, duration_s=36000)
    await cluster.until(lambda evs: "JobStarted" in of_job(evs, "free"), "the unallocated job to start")
    cluster.submit("paid", "lab/a", gpus=4, min_runtime_s=60, duration_s=30)
    evs = await cluster.until(lambda evs: "JobCompleted" in of_job(evs, "paid"), "the allocated job to complete")
    pre = next(e for e in evs if isinstance(e, events.JobPreempted) and e.job_id == "free")
    assert pre.victim is not None
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


def _first(evs: list[Any], cls_name: str, job_id: str, **match: Any) -> Any:
    for e in evs:
        if (
            e.type == cls_name
            and getattr(e, "job_id", None) == job_id
            and all(getattr(e, k) == v for k, v in match.items())
        ):
            return e
    raise AssertionError(f"no {cls_name} for {job_id} {match or ''}")


@pytest.mark.parametrize("cluster", [{"nodes": 1, "gpus": 4}], indirect=True)
async def test_protected_job_is_preempted_only_after_its_minimum_runtime(cluster: Cluster) -> None:
    """b1 (lab/b) holds the only node with a 120 s minimum runtime; a1 (lab/a, r = 0) waits.

    After b1's protection expires, lab/b is behind lab/a at their LCA (r_b > 0 = r_a, by more than
    delta = 0.05), so a1 preempts it (rule expired_behind), never earlier.
    """
    from apportion.timeutil import s_to_us, to_us

    cluster.submit("b1", "lab/b", gpus=4, min_runtime_s=120, duration_s=36000)
    evs = await cluster.until(lambda evs: "JobStarted" in of_job(evs, "b1"), "b1 to start")
    cluster.submit("a1", "lab/a", gpus=4, min_runtime_s=60, duration_s=30)
    evs = await cluster.until(lambda evs: "JobStarted" in of_job(evs, "a1"), "a1 to start")
    started = _first(evs, "JobStarted", "b1")
    pre = _first(evs, "JobPreempted", "b1")
    assert to_us(pre.ts) >= to_us(started.ts) + s_to_us(120)
    assert (pre.victim.rule, pre.by_job_id, pre.victim.lca) == ("expired_behind", "a1", "lab")
    assert pre.victim.victim_ratio >= pre.victim.preemptor_ratio + 0.05
    placed = _first(evs, "JobPlaced", "a1")
    assert to_us(placed.ts) == to_us(pre.ts)  # the freed GPUs go to a1 in the same decision
    assert _first(evs, "JobRequeued", "b1").attempt == 2


@pytest.mark.parametrize("cluster", [{"nodes": 1, "gpus": 4}], indirect=True)
async def test_drain_waits_for_protection_then_drains(cluster: Cluster) -> None:
    from apportion import events
    from apportion.timeutil import s_to_us, to_us

    cluster.submit("p1", "lab/a", gpus=2, min_runtime_s=120, duration_s=36000)
    evs = await cluster.until(lambda evs: "JobStarted" in of_job(evs, "p1"), "p1 to start")
    node_id = _first(evs, "JobStarted", "p1").node_id
    from apportion.client import ops_identity

    ops = ops_identity(bootstrap=cluster.bootstrap)  # only an ops key may drain (rule D10.authentication)
    now = cluster.clock.now()
    cluster.publish(
        ops.sign(events.NodeDrainRequested(node_id=node_id, reason="test", by=ops.user, ts=now, producer="test"))
    )
    evs = await cluster.until(lambda evs: any(isinstance(e, events.NodeDrained) for e in evs), "the node to drain")
    started = _first(evs, "JobStarted", "p1")
    pre = _first(evs, "JobPreempted", "p1")
    drained = next(e for e in evs if isinstance(e, events.NodeDrained))
    assert to_us(pre.ts) >= to_us(started.ts) + s_to_us(120), "drain broke the protection window"
    assert to_us(drained.ts) >= to_us(pre.ts)
    assert _first(evs, "JobRequeued", "p1").attempt == 2


@pytest.mark.parametrize("cluster", [{"agent": False, "heartbeat_timeout_s": 120.0}], indirect=True)
async def test_killed_node_agent_is_lost_and_its_job_requeued(cluster: Cluster) -> None:
    """kill -9 the agent process: after the heartbeat timeout its node is lost, the job requeued."""
    from apportion import events

    agent = cluster.spawn(
        "services.node_agent",
        "--sim-nodes",
        "1",
        "--gpus-per-node",
        "4",
        "--node-prefix",
        f"k{cluster.tag}-",
        env={"APPORTION_GROUP_ID": f"agent-{cluster.tag}"},
    )
    try:
        await cluster.until(lambda evs: any(isinstance(e, events.NodeRegistered) for e in evs), "registration")
        cluster.submit("l1", "lab/a", gpus=2, min_runtime_s=60, duration_s=36000)
        await cluster.until(lambda evs: "JobStarted" in of_job(evs, "l1"), "l1 to start")
        agent.kill()
        agent.wait(10)
        evs = await cluster.until(lambda evs: "JobRequeued" in of_job(evs, "l1"), "l1 to be requeued")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
    lost = next(e for e in evs if isinstance(e, events.NodeLost))
    jl = _first(evs, "JobLost", "l1")
    assert jl.charged_until == lost.last_heartbeat
    assert of_job(evs, "l1")[-3:] == ["JobStarted", "JobLost", "JobRequeued"]


@pytest.mark.parametrize("cluster", [{"agent": False, "heartbeat_timeout_s": 240.0}], indirect=True)
async def test_stalled_node_is_lost_fenced_and_rejoins(cluster: Cluster) -> None:
    """SIGSTOP the agent past the heartbeat timeout, SIGCONT it: its stale run is stopped, then the node rejoins.

    The dispatcher declares the node lost and requeues its job; the woken
    agent sees the NodeLost, stops the old attempt (a second copy must not
    keep running) and only then registers again, so the requeued attempt 2
    lands on a node whose GPUs are really free.
    """
    import signal

    from apportion import events

    node = f"s{cluster.tag}-0"
    agent = cluster.spawn(
        "services.node_agent",
        "--sim-nodes",
        "1",
        "--gpus-per-node",
        "4",
        "--node-prefix",
        f"s{cluster.tag}-",
        env={"APPORTION_GROUP_ID": f"agent-{cluster.tag}"},
    )

    def registrations(evs: list[Any]) -> list[Any]:
        return [e for e in evs if isinstance(e, events.NodeRegistered) and e.node_id == node]

    try:
        await cluster.until(lambda evs: registrations(evs), "registration")
        cluster.submit("p1", "lab/a", gpus=2, min_runtime_s=60, duration_s=36000)
        await cluster.until(lambda evs: "JobStarted" in of_job(evs, "p1"), "p1 to start")
        agent.send_signal(signal.SIGSTOP)
        try:
            await cluster.until(lambda evs: "JobRequeued" in of_job(evs, "p1"), "p1 to be requeued")
        finally:
            agent.send_signal(signal.SIGCONT)
        evs = await cluster.until(
            lambda evs: any(isinstance(e, events.JobStarted) and e.job_id == "p1" and e.attempt == 2 for e in evs),
            "attempt 2 of p1 to start on the rejoined node",
        )
    finally:
        agent.terminate()
        agent.wait(20)
    lost = next(e for e in evs if isinstance(e, events.NodeLost) and e.node_id == node)
    stale = next(e for e in evs if isinstance(e, events.JobFailed) and e.job_id == "p1" and e.attempt == 1)
    first, again = registrations(evs)[0], registrations(evs)[-1]
    placed2 = next(e for e in evs if isinstance(e, events.JobPlaced) and e.job_id == "p1" and e.attempt == 2)
    assert (stale.node_id, stale.reason, stale.exit_code) == (node, "stopped", -15)
    assert first.ts < lost.ts <= stale.ts <= again.ts <= placed2.ts
    assert [p.node_id for p in placed2.placements] == [node]


@pytest.mark.parametrize("cluster", [{"agent": False}], indirect=True)
async def test_agent_restarted_without_its_journal_has_its_runs_requeued_by_reconciliation(cluster: Cluster) -> None:
    """kill -9 an agent that keeps no journal, restart it inside the heartbeat timeout (600 event-s).

    Its heartbeats list no replica any more; after two of them the dispatcher declares the run lost
    (``JobLost`` by the dispatcher, charged to a heartbeat) and requeues it; attempt 2 starts on the
    restarted agent. No ``NodeLost``, no ``JobFailed``.
    """
    import signal

    from apportion import events

    node = f"r{cluster.tag}-0"
    args = ("--sim-nodes", "1", "--gpus-per-node", "4", "--node-prefix", f"r{cluster.tag}-")
    env = {"APPORTION_GROUP_ID": f"agent-{cluster.tag}", "APPORTION_MEMORY_JOURNAL": "true"}
    agent = cluster.spawn("services.node_agent", *args, env=env)
    again = None

    def registrations(evs: list[Any]) -> list[Any]:
        return [e for e in evs if isinstance(e, events.NodeRegistered) and e.node_id == node]

    try:
        await cluster.until(lambda evs: registrations(evs), "registration")
        cluster.submit("z1", "lab/a", gpus=2, min_runtime_s=60, duration_s=36000)
        await cluster.until(lambda evs: "JobStarted" in of_job(evs, "z1"), "z1 to start")
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        again = cluster.spawn("services.node_agent", *args, env=env)
        evs = await cluster.until(
            lambda evs: any(isinstance(e, events.JobStarted) and e.job_id == "z1" and e.attempt == 2 for e in evs),
            "attempt 2 of z1 to start on the restarted agent",
        )
    finally:
        for p in (agent, again):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)
    lost = [e for e in evs if isinstance(e, events.JobLost) and e.job_id == "z1"]
    assert [(e.attempt, e.node_id, e.producer) for e in lost] == [(1, node, "dispatcher")]
    req = next(e for e in evs if isinstance(e, events.JobRequeued) and e.job_id == "z1")
    assert (req.attempt, req.reason) == (2, "not running on its node")
    beats = [e for e in evs if isinstance(e, events.NodeHeartbeat) and e.node_id == node]
    after = [e for e in beats if registrations(evs)[-1].ts <= e.ts <= lost[0].ts]
    # charged to the heartbeat that decided: the second or a later one without the replica (a heartbeat sent
    # before the decision's instant but read after it, while the decision was being committed, may follow it)
    assert len(after) >= 2 and lost[0].charged_until in [e.ts for e in after[1:]]
    assert not [e for e in evs if isinstance(e, (events.NodeLost, events.JobFailed))]


def _dispatchers(cluster: Cluster, names: tuple[str, ...], *, heartbeat_timeout_s: int) -> dict[str, Any]:
    """A dispatcher process per name (lease TTL 2 wall s, grace 5 event-s), leader and standbys."""
    return {
        name: cluster.spawn(
            "services.dispatcher",
            "--instance-id",
            name,
            "--lease-ttl-wall-s",
            "2",
            "--grace-s",
            "5",
            "--heartbeat-timeout-s",
            str(heartbeat_timeout_s),
        )
        for name in names
    }


@pytest.mark.parametrize("cluster", [{"dispatcher": False}], indirect=True)
async def test_dispatcher_failover_places_nothing_twice(cluster: Cluster) -> None:
    """Two dispatcher processes; kill -9 the leader mid-run; the standby takes over with no double placement."""
    import redis as redis_lib

    from apportion import events
    from services.dispatcher.lease import lease_key

    # heartbeats come every 30 event-s (0.5 wall-s at scale 60): a 600 s timeout never fires by accident
    procs = _dispatchers(cluster, ("da", "db"), heartbeat_timeout_s=600)
    r = redis_lib.Redis.from_url(cluster.redis_url, **redis_auth())
    try:
        for i in range(4):
            cluster.submit(f"f{i}", "lab/a" if i % 2 else "lab/b", gpus=1, min_runtime_s=60, duration_s=60)
        await cluster.until(
            lambda evs: sum("JobPlaced" in of_job(evs, f"f{i}") for i in range(4)) == 4, "the first jobs to be placed"
        )
        leader = narrow(bytes, r.get(lease_key())).decode().rsplit(":", 1)[0]
        procs[leader].kill()
        procs[leader].wait(10)
        for i in range(4, 8):
            cluster.submit(f"f{i}", "lab/a" if i % 2 else "lab/b", gpus=1, min_runtime_s=60, duration_s=60)
        evs = await cluster.until(
            lambda evs: all("JobCompleted" in of_job(evs, f"f{i}") for i in range(8)), "all eight jobs to complete"
        )
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(20)
    placed = [(e.job_id, e.attempt) for e in evs if isinstance(e, events.JobPlaced)]
    assert sorted(placed) == sorted(set(placed)) == [(f"f{i}", 1) for i in range(8)]
    tokens = {narrow(int, e.fencing_token) for e in evs if isinstance(e, events.JobPlaced)}
    assert len(tokens) == 2 and min(tokens) < max(tokens)
    starts = [(e.job_id, e.attempt, e.replica) for e in evs if isinstance(e, events.StartWorkload)]
    assert sorted(starts) == sorted(set(starts))


@pytest.mark.parametrize("cluster", [{"dispatcher": False}], indirect=True)
async def test_leader_paused_past_its_lease_and_the_heartbeat_timeout_changes_nothing_when_it_wakes(
    cluster: Cluster,
) -> None:
    """SIGSTOP the leading dispatcher for 8 wall s (lease TTL 2 s, heartbeat timeout 120 event-s = 2 wall s);
    the standby takes over and places the jobs submitted meanwhile; SIGCONT. The woken leader would declare
    every node lost on its stale view (no heartbeat read for 480 event-s) and decide again; it publishes
    nothing that any reader sees: no ``NodeLost``, no replica started twice, every job completes once."""
    import signal
    from datetime import timedelta

    import redis as redis_lib

    from apportion import events
    from services.dispatcher.lease import lease_key

    procs = _dispatchers(cluster, ("pa", "pb"), heartbeat_timeout_s=120)
    r = redis_lib.Redis.from_url(cluster.redis_url, **redis_auth())
    paused = None
    try:
        for i in range(2):
            cluster.submit(f"p{i}", "lab/a" if i % 2 else "lab/b", gpus=1, min_runtime_s=60, duration_s=600)
        await cluster.until(
            lambda evs: sum("JobPlaced" in of_job(evs, f"p{i}") for i in range(2)) == 2, "the first jobs placed"
        )
        leader = narrow(bytes, r.get(lease_key())).decode().rsplit(":", 1)[0]
        paused = procs[leader]
        paused.send_signal(signal.SIGSTOP)
        woken_at = cluster.clock.now() + timedelta(seconds=480)  # 8 wall s at scale 60
        for i in range(2, 4):
            cluster.submit(f"p{i}", "lab/a" if i % 2 else "lab/b", gpus=1, min_runtime_s=60, duration_s=60)
        await cluster.until(
            lambda evs: all("JobPlaced" in of_job(evs, f"p{i}") for i in range(2, 4)), "the standby to place two"
        )
        await cluster.until(  # the pause is counted by the agents' heartbeats (event time), not by a sleep
            lambda evs: any(isinstance(e, events.NodeHeartbeat) and e.ts >= woken_at for e in evs),
            "eight wall seconds of heartbeats",
        )
        paused.send_signal(signal.SIGCONT)
        paused = None
        for i in range(4, 6):
            cluster.submit(f"p{i}", "lab/a" if i % 2 else "lab/b", gpus=1, min_runtime_s=60, duration_s=60)
        evs = await cluster.until(
            lambda evs: all("JobCompleted" in of_job(evs, f"p{i}") for i in range(2, 6)), "p2-p5 to complete"
        )
    finally:
        if paused is not None:
            paused.send_signal(signal.SIGCONT)
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(20)
    assert [e for e in evs if isinstance(e, events.NodeLost)] == []
    starts = [(e.job_id, e.attempt, e.replica) for e in evs if isinstance(e, events.StartWorkload)]
    assert sorted(starts) == sorted(set(starts))
    placed = [(e.job_id, e.attempt) for e in evs if isinstance(e, events.JobPlaced)]
    assert sorted(placed) == sorted(set(placed)) == [(f"p{i}", 1) for i in range(6)]
    assert len({e.fencing_token for e in evs if isinstance(e, events.JobPlaced)}) == 2


async def test_cli_shows_each_state(cluster: Cluster) -> None:
    """queue, nodes and share read the services' Redis read models; cancel goes through Kafka."""
    import json

    from typer.testing import CliRunner

    from apportion.cli.main import app

    env = {"APPORTION_REDIS_URL": cluster.redis_url, "APPORTION_KAFKA_BOOTSTRAP": cluster.bootstrap}
    runner = CliRunner()

    async def cli(*args: str) -> Any:  # in a thread: the services run on this event loop
        res = await asyncio.to_thread(runner.invoke, app, list(args), env=env)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    cluster.submit("c1", "lab/a", gpus=2, min_runtime_s=60, duration_s=36000)
    await cluster.until(lambda evs: "JobStarted" in of_job(evs, "c1"), "c1 to start")

    async def shows(cmd: tuple[str, ...], pred: Callable[[Any], bool], what: str) -> Any:
        loop = asyncio.get_running_loop()
        end = loop.time() + DEADLINE_S
        while not pred(got := await cli(*cmd)):
            if loop.time() > end:
                pytest.fail(f"`apportion {' '.join(cmd)}` never showed {what}: {got}")
            await asyncio.sleep(0.1)
        return got

    rows = await shows(
        ("queue", "--json"),
        lambda rows: any(r["job_id"] == "c1" and r["state"] == "running" for r in rows),
        "c1 running",
    )
    assert next(r for r in rows if r["job_id"] == "c1")["budget"] == "lab/a"
    nodes = await shows(("nodes", "--json"), lambda rows: len(rows) == 2, "two nodes")
    assert sorted(n["free_gpus"] for n in nodes) == [2, 4]
    share = await shows(
        ("share", "--json"),
        lambda d: any(b["path"] == "lab/a" and b["occupancy_gpu_s"] > 0 for b in d["budgets"]),
        "lab/a occupancy",
    )
    assert {b["path"] for b in share["budgets"]} == {"lab", "lab/a", "lab/b"}
    res = await asyncio.to_thread(
        runner.invoke,
        app,
        ["cancel", "c1", "--user", "alice", "--reason", "done early", "--no-wait", "--json"],
        env=env,
    )
    assert res.exit_code == 0, res.output
    [sent] = json.loads(res.stdout)["published"]
    assert (sent["type"], sent["job_id"], sent["user"], sent["reason"]) == (
        "JobCancelRequested",
        "c1",
        "alice",
        "done early",
    )
    await cluster.until(lambda evs: "JobCancelled" in of_job(evs, "c1"), "c1 to be cancelled")
    await shows(("queue", "--json"), lambda rows: not any(r["job_id"] == "c1" for r in rows), "c1 gone")
    node = sorted(n["node_id"] for n in nodes)[0]
    [sent] = (await cli("cordon", node, "--reason", "fan swap", "--no-wait", "--json"))["published"]
    assert (sent["type"], sent["node_id"], sent["reason"], sent["by"]) == ("NodeCordoned", node, "fan swap", "ops")
    await shows(
        ("nodes", "--json"),
        lambda rows: {n["node_id"]: n["state"] for n in rows}[node] == "cordoned",
        f"{node} cordoned",
    )
    [sent] = (await cli("undrain", node, "--no-wait", "--json"))["published"]
    assert (sent["type"], sent["node_id"]) == ("NodeUncordoned", node)
    await shows(
        ("nodes", "--json"), lambda rows: {n["node_id"]: n["state"] for n in rows}[node] == "ready", f"{node} back up"
    )


@pytest.mark.parametrize("cluster", [{"accounting": False}], indirect=True)
async def test_killed_accounting_resumes_to_the_bulk_rebuild(cluster: Cluster) -> None:
    """kill -9 accounting mid-run, restart it: it resumes from its checkpoint, and its read model
    equals a bulk rebuild of the whole log (nothing lost, nothing counted twice)."""
    import re

    import redis as redis_lib

    from apportion import events
    from apportion.domain.budgets import fold_budget_log
    from apportion.domain.occupancy import rebuild
    from apportion.domain.usage import usage_snapshot
    from apportion.timeutil import to_us
    from services.accounting import checkpoint
    from services.accounting import logic as acc_logic
    from services.accounting.store import ReadModelStore

    def snapshots(evs: list[Any]) -> list[Any]:
        return [e for e in evs if isinstance(e, events.OccupancySnapshot)]

    store = ReadModelStore(redis_lib.Redis.from_url(cluster.redis_url, **redis_auth()))

    def stored_header() -> dict | None:
        try:
            return checkpoint.read_header(store.read_checkpoint())
        except checkpoint.CheckpointError:
            return None

    async def header_until(pred: Callable[[dict], bool], what: str) -> dict:
        loop = asyncio.get_running_loop()
        end = loop.time() + DEADLINE_S
        while not ((hd := await asyncio.to_thread(stored_header)) and pred(hd)):
            assert loop.time() < end, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)
        return hd

    args = ("--snapshot-debounce-wall-s", "0.1", "--checkpoint-interval-wall-s", "0")
    acc = cluster.spawn("services.accounting", *args)
    try:
        first = await header_until(lambda hd: True, "the start-up checkpoint")
        cluster.submit("k1", "lab/a", gpus=2, min_runtime_s=60, duration_s=30)
        cluster.submit("k2", "lab/b", gpus=1, min_runtime_s=0, duration_s=20)
        evs = await cluster.until(
            lambda evs: "JobCompleted" in of_job(evs, "k1") and snapshots(evs), "k1 and a snapshot"
        )
        k1_done = to_us(_first(evs, "JobCompleted", "k1").ts)
        # a checkpoint of the state folded live (k1 and k2 came after the start-up rebuild)
        cut = await header_until(lambda hd: (hd["clock_us"] or 0) >= k1_done, "a checkpoint holding k1's completion")
        assert sum(cut["offsets"].values()) > sum(first["offsets"].values())
        acc.kill()  # SIGKILL: no final checkpoint, no commit
        acc.wait(10)
        stored = await asyncio.to_thread(stored_header)  # what the restart will find
        assert stored is not None
        cut = stored
        cluster.submit("k3", "lab/b", gpus=4, min_runtime_s=60, duration_s=30)
        await cluster.until(lambda evs: "JobCompleted" in of_job(evs, "k3"), "k3 to complete while accounting is down")
        n_before = len(snapshots(cluster.log()))
        acc = cluster.spawn("services.accounting", *args)
        evs = await cluster.until(lambda evs: len(snapshots(evs)) > n_before, "a snapshot after the restart")
    finally:
        if acc.poll() is None:
            acc.terminate()
            acc.wait(20)
    # the restart resumed from the checkpoint: it read the records after the checkpoint's offsets only
    from apportion.bus.reader import read_log
    from apportion.topics import BUDGETS, JOBS, NODES

    log_text = cluster.log_path("services.accounting", args).read_text()
    starts = re.findall(r"started by (\w+) from .*?: (\d+) records read", log_text)
    assert [m for m, _ in starts] == ["rebuild", "resume"], log_text[-2000:]
    logged = await asyncio.to_thread(
        read_log, cluster.bootstrap, [topic_name(JOBS), topic_name(NODES), topic_name(BUDGETS)]
    )
    # counted by record, not by offset: the dispatcher's transaction markers take offsets too
    after_cut = sum(1 for rec in logged if rec.offset >= cut["offsets"].get(f"{rec.topic}:{rec.partition}", 0))
    assert int(starts[1][1]) <= after_cut < len(logged) and sum(cut["offsets"].values()) > 0
    # the read model names the snapshot it shows; the log (read after it) must hold that snapshot
    meta, rows = ReadModelStore(redis_lib.Redis.from_url(cluster.redis_url, **redis_auth())).read()
    assert meta is not None
    evs = await asyncio.to_thread(cluster.log)
    snap = next(e for e in snapshots(evs) if str(e.event_id) == meta["snapshot_id"])
    at = to_us(snap.at)
    upto = [e for e in evs if to_us(e.ts) <= at and not isinstance(e, events.OccupancySnapshot)]
    ref = usage_snapshot(fold_budget_log(upto), rebuild(upto), at)
    assert [(u.path, u.occupancy_gpu_s, u.unallocated_gpu_s, u.entitlement_gpu_s) for u in snap.budgets] == [
        (u.path, u.occupancy_gpu_s, u.unallocated_gpu_s, u.entitlement_gpu_s) for u in ref.budgets
    ]
    assert snap.capacity_gpu_s == ref.capacity_gpu_s
    _, expect_rows = acc_logic.read_model(ref, fold_budget_log(upto), {})
    assert rows == expect_rows
    # lab/a's only job k1 held 2 GPUs from JobPlaced to JobCompleted (30 s run + start-up latency)
    held = to_us(_first(evs, "JobCompleted", "k1").ts) - to_us(_first(evs, "JobPlaced", "k1").ts)
    a = next(u for u in snap.budgets if u.path == "lab/a")
    assert a.occupancy_gpu_s == pytest.approx(2 * held / 1e6, abs=1e-6) and held >= 30_000_000
