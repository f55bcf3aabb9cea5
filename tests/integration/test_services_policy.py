"""The policy service (faust) on real Kafka, run in-process in this event loop.

Checks the start-up catch-up, live rejections, rankings and dead letters,
that a stop commits the group's offsets and a restart resumes from them
with the full tree and repeats nothing but de-duplicable events, and that
an event the fold raises on is dead-lettered while the agent goes on. Topics live under a fresh
``APPORTION_TOPIC_PREFIX``; every wait is bounded (no sleeps).
"""

from __future__ import annotations

import asyncio
import sys
import uuid

import pytest

from apportion.bus.security import kafka_auth
from apportion.settings import topic_name, topic_prefix
from tests.kit.builders import budget_set, h, node, placed

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0
VALID = [budget_set("lab", 1.0, at=h(0)), budget_set("lab/a", 0.75, at=h(0)), budget_set("lab/b", 0.25, at=h(0))]
OVER = budget_set("lab/c", 0.5, at=h(1))  # 0.75 + 0.25 + 0.5 > 1
ORPHAN = budget_set("nope/x", 0.5, at=h(2))


async def _until(pred, what: str):
    """Await ``pred()`` (sync, in a thread) returning a truthy value, or fail after the deadline."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while True:
        got = await asyncio.to_thread(pred)
        if got:
            return got
        if loop.time() > end:
            pytest.fail(f"timed out after {DEADLINE_S}s waiting for {what}")
        await asyncio.sleep(0.05)


def _of(bootstrap: str, topic, kind) -> list:
    """Events of type ``kind`` on ``topic`` in log (partition, offset) order, not event-time order."""
    from apportion.bus.reader import read_log

    recs = sorted(read_log(bootstrap, [topic_name(topic)]), key=lambda r: (r.partition, r.offset))
    return [r.event for r in recs if isinstance(r.event, kind)]


async def _start(settings, clock):
    from services.policy.app import run

    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(settings, stop, clock=clock, ready=ready))
    done, _ = await asyncio.wait(
        [task, asyncio.create_task(ready.wait())], timeout=DEADLINE_S, return_when=asyncio.FIRST_COMPLETED
    )
    if task in done:
        task.result()
        pytest.fail("policy stopped during start-up")
    assert ready.is_set(), "policy not ready in time"
    return stop, task


async def _stop(stop: asyncio.Event, task: asyncio.Task) -> None:
    stop.set()
    await asyncio.wait_for(task, DEADLINE_S)


def _committed(bootstrap: str, group: str, topics: list) -> dict[str, int | None]:
    """``"topic:partition"`` -> offset committed by ``group`` (``None`` when none)."""
    from kafka import KafkaConsumer, TopicPartition

    kc = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False, **kafka_auth())
    try:
        tps = [TopicPartition(topic_name(t), p) for t in topics for p in sorted(kc.partitions_for_topic(topic_name(t)))]
        return {f"{tp.topic}:{tp.partition}": kc.committed(tp) for tp in tps}
    finally:
        kc.close()


def _describe_group(bootstrap: str, group: str) -> dict:
    """The broker's description of ``group`` (kafka-python's ``describe_groups``)."""
    from apportion.bus.clients import kafka_admin

    admin = kafka_admin(bootstrap_servers=bootstrap, **kafka_auth())
    try:
        return admin.describe_groups([group])[group]
    finally:
        admin.close()


def _ends(bootstrap: str, topics: list) -> dict[str, int]:
    from kafka import KafkaConsumer, TopicPartition

    kc = KafkaConsumer(bootstrap_servers=bootstrap, **kafka_auth())
    try:
        tps = [TopicPartition(topic_name(t), p) for t in topics for p in sorted(kc.partitions_for_topic(topic_name(t)))]
        return {f"{tp.topic}:{tp.partition}": off for tp, off in kc.end_offsets(tps).items()}
    finally:
        kc.close()


async def test_policy_rejects_ranks_dead_letters_and_resumes_after_restart(kafka_bootstrap, monkeypatch, tmp_path):
    from kafka import KafkaProducer

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.clock import ManualClock
    from apportion.domain.budgets import fold_budget_log
    from apportion.domain.occupancy import rebuild
    from apportion.domain.usage import ranking_of, usage_snapshot
    from apportion.timeutil import from_us
    from apportion.topics import BUDGETS, DEADLETTER, RANKING, USAGE
    from services.policy import logic
    from services.policy.config import PolicySettings

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"pol{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    clock = ManualClock(from_us(h(3)))
    settings = PolicySettings(kafka_bootstrap=kafka_bootstrap, faust_dir=str(tmp_path), log_json=False)
    tree = fold_budget_log(VALID)
    producer = EventProducer(kafka_bootstrap, client_id="test")
    try:
        for e in VALID + [OVER]:
            producer.publish(e)
        # ---- start: the change already in the log is rejected once, the tree ranked without a snapshot
        stop, task = await _start(settings, clock)
        assert len(list(tmp_path.glob("apportion-policy-*"))) == 1  # this instance's faust data dir
        # the broker lists its member with the client id that names this process and machine
        from services.policy.service import member_client_id

        group = await asyncio.to_thread(_describe_group, kafka_bootstrap, topic_prefix() + settings.group_id)
        assert [(m["group_instance_id"], m["client_id"]) for m in group["members"]] == [
            (settings.instance_id, member_client_id())
        ]
        assert _of(kafka_bootstrap, BUDGETS, events.BudgetRejected) == [
            logic.rejected_event(logic.Rejection(OVER, "over_allocated", _message(tree, OVER)), clock.now())
        ]
        first_rank = logic.ranking(tree, None, clock.now())
        assert _of(kafka_bootstrap, RANKING, events.FairShareRanking) == [first_rank]

        # ---- live: an orphan change, a malformed record and a snapshot
        producer.publish(ORPHAN)
        with KafkaProducer(bootstrap_servers=kafka_bootstrap, **kafka_auth()) as raw:
            bad = raw.send(topic_name(BUDGETS), key=b"bad", value=b"not json").get(timeout=DEADLINE_S)
        snap = usage_snapshot(
            tree,
            rebuild(VALID + [node("n0", 8, at=h(0)), placed("j1", budget="lab/a", gpus=8, at=h(1))], 24 * 3600.0),
            h(2),
            producer="accounting",
        )
        producer.publish(snap)
        expected_rank = ranking_of(tree, snap, producer="policy", policy_version=logic.POLICY_VERSION)

        def live_done():
            rej = _of(kafka_bootstrap, BUDGETS, events.BudgetRejected)
            ranks = _of(kafka_bootstrap, RANKING, events.FairShareRanking)
            letters = _of(kafka_bootstrap, DEADLETTER, events.DeadLetter)
            return (rej, ranks, letters) if len(rej) == 2 and ranks[-1] == expected_rank and letters else None

        rej, ranks, letters = await _until(live_done, "the orphan's rejection, the dead letter and the ranking")
        assert [(r.path, r.reason, r.rejected_event_id) for r in rej] == [
            ("lab/c", "over_allocated", OVER.event_id),
            ("nope/x", "no_parent", ORPHAN.event_id),
        ]
        assert ranks == [first_rank, expected_rank]
        assert [
            (d.event_id, d.source_topic, d.source_offset, d.source_key, d.original_bytes(), d.producer) for d in letters
        ] == [
            (
                events.det_id("DeadLetter", topic_name(BUDGETS), 0, bad.offset),
                topic_name(BUDGETS),
                bad.offset,
                "bad",
                b"not json",
                "policy",
            )
        ]
        await _stop(stop, task)
        assert list(tmp_path.glob("apportion-policy-*")) == []

        # ---- the stop committed the group's offsets up to the end of every partition holding records
        ends = _ends(kafka_bootstrap, [BUDGETS, USAGE])
        committed = _committed(kafka_bootstrap, topic_prefix() + "policy", [BUDGETS, USAGE])
        assert {tp: off for tp, off in committed.items() if off is not None} == {
            tp: off for tp, off in ends.items() if off > 0
        }
        # budgets: 3 valid, OVER, ORPHAN, the bad record, 2 rejections; usage: one snapshot
        assert ends[f"{topic_name(BUDGETS)}:0"] == 8
        assert sorted(v for k, v in ends.items() if k.startswith(topic_name(USAGE))) == [0, 0, 1]

        # ---- restart: full tree again, nothing new but the same ranking (same id: readers drop it)
        clock.advance(3600.0)
        stop, task = await _start(settings, clock)
        await _stop(stop, task)
        rej2 = _of(kafka_bootstrap, BUDGETS, events.BudgetRejected)
        ranks2 = _of(kafka_bootstrap, RANKING, events.FairShareRanking)
        assert rej2 == rej
        assert ranks2 == [first_rank, expected_rank, expected_rank]
        # the catch-up meets the bad record again and writes the same dead letter id (readers keep one)
        assert [d.event_id for d in _of(kafka_bootstrap, DEADLETTER, events.DeadLetter)] == [letters[0].event_id] * 2
    finally:
        producer.close()


def _message(tree, change) -> str:
    """The message ``BudgetTree.apply`` gives when it refuses ``change``."""
    from apportion.domain.budgets import BudgetError

    try:
        tree.apply(change)
    except BudgetError as exc:
        return exc.message
    raise AssertionError("change was accepted")


async def test_an_event_the_fold_raises_on_is_dead_lettered_and_the_policy_goes_on(
    kafka_bootstrap, monkeypatch, tmp_path
):
    """A decode or apply error can never stop a service (issue 17): the agent dead-letters and carries on."""
    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.clock import ManualClock
    from apportion.timeutil import from_us
    from apportion.topics import BUDGETS, DEADLETTER
    from services.policy import service as policy_app
    from services.policy.config import PolicySettings

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"polf{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    real_evolve = policy_app.logic.evolve

    def evolve(state, event):
        if getattr(event, "path", None) == "boom":
            raise RuntimeError("evolve failed on boom")
        return real_evolve(state, event)

    monkeypatch.setattr(policy_app.logic, "evolve", evolve)
    settings = PolicySettings(kafka_bootstrap=kafka_bootstrap, faust_dir=str(tmp_path), log_json=False)
    stop, task = await _start(settings, ManualClock(from_us(h(1))))
    with EventProducer(kafka_bootstrap, client_id="test") as producer:
        producer.publish(budget_set("boom", 1.0, at=h(0)))
        producer.publish(OVER)  # folded after the failure: the agent still decides
    try:
        letters = await _until(lambda: _of(kafka_bootstrap, DEADLETTER, events.DeadLetter), "the dead letter")
        assert [(d.source_topic, d.source_key, d.error, d.producer) for d in letters] == [
            (topic_name(BUDGETS), "boom", "apply failed: RuntimeError: evolve failed on boom", "policy")
        ]
        await _until(lambda: _of(kafka_bootstrap, BUDGETS, events.BudgetRejected), "the next change to be decided")
        assert not task.done()
    finally:
        await _stop(stop, task)
    assert list(tmp_path.glob("apportion-policy-*")) == []


async def test_policy_killed_with_sigkill_restarts_without_waiting_for_its_old_session(
    kafka_bootstrap, monkeypatch, tmp_path
):
    """kill -9 the policy process; the restart (same static member id) answers a change within 30 s.

    faust's group session timeout is 60 s: without static membership the
    restarted member would wait for the dead one's session to expire before
    it is assigned partitions, and only then publish.
    """
    import os
    import subprocess

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.topics import BUDGETS, RANKING

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"polk{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    env = dict(
        os.environ,
        APPORTION_KAFKA_BOOTSTRAP=kafka_bootstrap,
        APPORTION_LOG_JSON="false",
        APPORTION_FAUST_DIR=str(tmp_path),
    )

    def spawn(n: int) -> subprocess.Popen:
        logf = open(tmp_path / f"policy-{n}.log", "wb")  # kept open by the child
        return subprocess.Popen(
            [sys.executable, "-m", "services.policy"], env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf
        )

    producer = EventProducer(kafka_bootstrap, client_id="test")
    proc = spawn(1)
    try:
        for e in VALID:
            producer.publish(e)
        await _until(
            lambda: [
                r
                for r in _of(kafka_bootstrap, RANKING, events.FairShareRanking)
                if [b.path for b in r.budgets] == ["lab/a", "lab/b"]
            ],
            "the first ranking",
        )
        proc.kill()
        proc.wait(timeout=DEADLINE_S)
        left = list(tmp_path.glob("apportion-policy-*"))  # kill -9 leaves its (empty) data dir behind
        assert len(left) == 1
        producer.publish(OVER)
        proc = spawn(2)
        loop = asyncio.get_running_loop()
        end = loop.time() + 30.0
        while not (rej := _of(kafka_bootstrap, BUDGETS, events.BudgetRejected)):
            assert proc.poll() is None, (tmp_path / "policy-2.log").read_text()
            assert loop.time() < end, "no rejection 30 s after the restart"
            await asyncio.sleep(0.1)
        assert [(r.path, r.reason, r.rejected_event_id) for r in rej] == [("lab/c", "over_allocated", OVER.event_id)]
    finally:
        proc.terminate()
        proc.wait(timeout=DEADLINE_S)
        producer.close()
    assert proc.returncode == 0, (tmp_path / "policy-2.log").read_text()
    assert list(tmp_path.glob("apportion-policy-*")) == left  # a SIGTERM stop removes its own data dir


def _static_member(bootstrap: str, group: str, instance: str, client_id: str):
    """A kafka-python consumer joined to ``group`` as static member ``instance`` with ``client_id`` (polled until
    the group assigned it the budgets partition)."""
    import time

    from kafka import KafkaConsumer

    from apportion.topics import BUDGETS

    kc = KafkaConsumer(
        topic_name(BUDGETS),
        bootstrap_servers=bootstrap,
        group_id=group,
        group_instance_id=instance,
        client_id=client_id,
        enable_auto_commit=False,
        **kafka_auth(),
    )
    end = time.monotonic() + DEADLINE_S
    while not kc.assignment():
        assert time.monotonic() < end, f"{client_id} not assigned in {group} within {DEADLINE_S} s"
        kc.poll(timeout_ms=100)
    return kc


async def test_a_policy_refuses_to_start_as_a_member_the_broker_lists_elsewhere_or_alive_here(
    kafka_bootstrap, monkeypatch
):
    """The broker's description of the policy's group, without any stack file: a member with the same instance id
    from another machine, or of a live policy process on this one, refuses the start (exit 2's one line); one of a
    process that ended (a static member listed until its session ends: a restart) or another instance id, not."""
    import os
    import socket
    import subprocess

    from apportion.bus.provision import provision
    from services.policy.__main__ import group_member_in_the_way
    from services.policy.config import PolicySettings
    from services.policy.service import member_client_id

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"pold{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    here = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "services.policy"], stdin=-1)
    ended = subprocess.Popen([sys.executable, "-c", "pass", "services.policy"])
    ended.wait(timeout=DEADLINE_S)
    members = {  # group -> the client id its member policy-0 joined with
        "remote": "policy-4242-on-elsewhere.example",
        "alive": member_client_id(live.pid, here),
        "ended": member_client_id(ended.pid, here),
    }
    joined = []
    try:
        for group, client in members.items():
            joined.append(
                await asyncio.to_thread(_static_member, kafka_bootstrap, topic_prefix() + group, "policy-0", client)
            )

        def check(group: str, instance: str = "policy-0") -> str | None:
            return group_member_in_the_way(
                PolicySettings(kafka_bootstrap=kafka_bootstrap, group_id=group, instance_id=instance)
            )

        prefix = topic_prefix()
        assert await asyncio.to_thread(check, "remote") == (
            f"instance policy-0 of group {prefix}remote is a member from 127.0.0.1 (client "
            "policy-4242-on-elsewhere.example): a second one with those ids would take its place and fence it out. "
            "If that one stopped, its membership lapses 60 s after; else give this one its own, e.g. "
            "APPORTION_GROUP_ID=policy-2 python -m services.policy --instance-id policy-2"
        )
        assert await asyncio.to_thread(check, "alive") == (
            f"a policy (pid {live.pid}) runs on this machine as instance policy-0 of group {prefix}alive: a second "
            "one with those ids would take its place and fence it out; give this one its own, e.g. "
            "APPORTION_GROUP_ID=policy-2 python -m services.policy --instance-id policy-2"
        )
        assert await asyncio.to_thread(check, "ended") is None
        assert await asyncio.to_thread(check, "remote", "policy-1") is None  # ids of its own
        assert await asyncio.to_thread(check, "nobody") is None  # a group nobody joined
        assert os.getpid() not in (live.pid, ended.pid)
    finally:
        for kc in joined:
            await asyncio.to_thread(kc.close)
        live.kill()
        live.wait(timeout=DEADLINE_S)
