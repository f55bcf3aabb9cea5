"""Accounting and policy on real Kafka and Redis, run in-process.

Publishes budget, node and job events, runs ``services.accounting.app.run``
and ``services.policy.app.run`` in this event loop, and checks that the
Redis read model, the published ``OccupancySnapshot`` and the
``FairShareRanking`` equal a bulk rebuild of the same log, both after the
start-up rebuild and after live events; and that a restart resumes from the
checkpoint kept with the read model, reading only the records logged since,
to the read model a ``--rebuild`` start writes. Topics live under a fresh
``APPORTION_TOPIC_PREFIX`` and the read model in its own Redis database, so
the test shares the broker and server with others. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from apportion.bus.security import kafka_auth, redis_auth
from apportion.settings import topic_name
from tests.kit.builders import budget_set, completed, cordoned, h, node, placed
from tests.kit.signing import node_value, with_node_keys

pytestmark = pytest.mark.integration

WINDOW_S = 24 * 3600.0
DEADLINE_S = 60.0

_NODES: set[str] = set()  # node reports are signed by their node's key, registered before its first report
PHASE1 = with_node_keys(
    [
        budget_set("lab", 1.0, at=h(0)),
        budget_set("lab/a", 0.75, at=h(0)),
        budget_set("lab/b", 0.25, at=h(0)),
        node("n0", 8, at=h(0)),
        node("n1", 8, at=h(0)),
        placed("j1", budget="lab/a", gpus=8, at=h(1)),
        placed("j2", budget="lab/b", gpus=4, at=h(2)),
        placed("u1", budget="lab/b", gpus=4, allocated=False, at=h(2)),
        completed("j1", at=h(5)),
    ],
    _NODES,
)
PHASE2 = with_node_keys(
    [
        completed("u1", at=h(6)),
        placed("j3", budget="lab/a", gpus=8, nodes=["n1"], at=h(7)),
        cordoned("n0", at=h(8)),
    ],
    _NODES,
)


def _publish(producer, e) -> None:
    """Publish ``e`` as its writer would (a node report signed by its node's key) and wait for the ack."""
    producer.send(e, node_value(e)).get(timeout=30)


def _bulk(evs, at_us):
    from apportion.domain.budgets import fold_budget_log
    from apportion.domain.occupancy import rebuild
    from apportion.domain.usage import usage_snapshot
    from apportion.timeutil import to_us

    evs = sorted(evs, key=lambda e: to_us(e.ts))
    return usage_snapshot(fold_budget_log(evs), rebuild(evs, WINDOW_S), at_us, producer="accounting")


async def _until(pred, what: str, deadline_s: float = DEADLINE_S, step: float = 0.05):
    """Await ``pred()`` (sync, run in a thread) returning a truthy value, or fail after the deadline."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        got = await asyncio.to_thread(pred)
        if got:
            return got
        if loop.time() > end:
            pytest.fail(f"timed out after {deadline_s}s waiting for {what}")
        await asyncio.sleep(step)


async def test_accounting_and_policy_equal_bulk_rebuild(kafka_bootstrap, redis_url, monkeypatch):
    import redis as redis_lib

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.bus.reader import read_log
    from apportion.clock import ManualClock
    from apportion.domain.budgets import fold_budget_log
    from apportion.domain.usage import ranking_of
    from apportion.timeutil import from_us
    from apportion.topics import RANKING, USAGE
    from services.accounting import logic as acc_logic
    from services.accounting.app import run as run_accounting
    from services.accounting.config import AccountingSettings
    from services.accounting.store import ReadModelStore
    from services.policy.app import run as run_policy
    from services.policy.config import PolicySettings

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"t{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    db_url = redis_url.rsplit("/", 1)[0] + "/13"
    r = redis_lib.Redis.from_url(db_url, **redis_auth())
    store = ReadModelStore(r)
    store.wipe()

    producer = EventProducer(kafka_bootstrap, client_id="test")
    for e in PHASE1:
        _publish(producer, e)

    clock = ManualClock(from_us(h(5)))
    acc_settings = AccountingSettings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=db_url,
        window_s=WINDOW_S,
        snapshot_interval_s=0,
        snapshot_debounce_wall_s=0,
        rebuild=True,
    )
    pol_settings = PolicySettings(kafka_bootstrap=kafka_bootstrap)
    stop = asyncio.Event()
    acc_ready, pol_ready = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(run_accounting(acc_settings, stop, clock=clock, ready=acc_ready)),
        asyncio.create_task(run_policy(pol_settings, stop, clock=clock, ready=pol_ready)),
    ]

    def usage_and_ranking():
        recs = read_log(kafka_bootstrap, [topic_name(USAGE), topic_name(RANKING)])
        return (
            [x.event for x in recs if isinstance(x.event, events.OccupancySnapshot)],
            [x.event for x in recs if isinstance(x.event, events.FairShareRanking)],
        )

    try:
        await asyncio.wait_for(asyncio.gather(acc_ready.wait(), pol_ready.wait()), DEADLINE_S)

        # ---- after the start-up rebuild
        ref1 = _bulk(PHASE1, h(5))
        meta, rows = store.read()
        assert meta is not None
        exp_meta, exp_rows = acc_logic.read_model(ref1, fold_budget_log(PHASE1), {})
        assert meta["snapshot_id"] == str(ref1.event_id)
        assert rows == exp_rows
        assert (meta["at"], meta["capacity_gpu_s"]) == (exp_meta["at"], exp_meta["capacity_gpu_s"])

        def first_published():
            s, rk = usage_and_ranking()
            return (s, rk) if s else None

        snaps, _ = await _until(first_published, "the first snapshot")
        assert snaps[-1].model_copy(update={"inputs": None}) == ref1  # its input position aside (a rebuild has none)

        # ---- live events
        for e in PHASE2:
            _publish(producer, e)
        everything = PHASE1 + PHASE2
        ref2 = _bulk(everything, h(8))

        def stored_final():
            m, _ = store.read()
            return m if m and m["snapshot_id"] == str(ref2.event_id) else None

        await _until(stored_final, "the read model of the live events")
        _, rows = store.read()
        assert rows == acc_logic.read_model(ref2, fold_budget_log(everything), {})[1]

        def published_final():
            s, rk = usage_and_ranking()
            return (s, rk) if s and s[-1].event_id == ref2.event_id and rk and rk[-1].at == ref2.at else None

        snaps, ranks = await _until(published_final, "the live snapshot and its ranking")
        assert snaps[-1].model_copy(update={"inputs": None}) == ref2
        expected_rank = ranking_of(fold_budget_log(everything), ref2)
        assert [(b.path, b.rank, b.ratio) for b in ranks[-1].budgets] == [
            (b.path, b.rank, b.ratio) for b in expected_rank.budgets
        ]
        # occupancy by hand: a = j1 8x4h + j3 8x1h = 40 GPU-h; lab/b = j2 4x6h = 24 GPU-h
        occ = {u.path: u.occupancy_gpu_s for u in ref2.budgets}
        assert occ["lab/a"] == 40 * 3600 and occ["lab/b"] == 24 * 3600
    finally:
        stop.set()
        done, pending = await asyncio.wait(tasks, timeout=DEADLINE_S)
        assert not pending, "services did not stop in time"
        for t in done:
            t.result()
        producer.close()
        store.wipe()
        r.close()


def _group_offsets(bootstrap: str, group: str, offsets: dict[str, int], write: bool) -> dict[str, int | None]:
    """``group``'s committed offsets of the partitions named in ``offsets``, after overwriting them if ``write``."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    kc = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False, **kafka_auth())
    try:
        tps = {k: TopicPartition(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1])) for k in offsets}
        kc.assign(list(tps.values()))
        if write:
            kc.commit({tp: OffsetAndMetadata(offsets[k], "", -1) for k, tp in tps.items()})
        return {k: kc.committed(tp) for k, tp in tps.items()}
    finally:
        kc.close()


async def test_accounting_resumes_from_its_checkpoint_and_equals_a_fresh_rebuild(
    kafka_bootstrap, redis_url, monkeypatch
):
    """Start (no checkpoint: rebuild), stop, more events, start again (resume), then ``--rebuild``.

    The second start reads only the records logged after the first one's
    checkpoint (not the log from offset 0, although the group's committed
    offsets were reset to 0: the offsets stored with the state decide), and
    its read model equals, field for field, the one a ``--rebuild`` start
    writes from the whole log.
    """

    import redis as redis_lib

    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.clock import ManualClock
    from apportion.domain.budgets import fold_budget_log
    from apportion.timeutil import from_us
    from services.accounting import checkpoint
    from services.accounting import logic as acc_logic
    from services.accounting.app import run as run_accounting
    from services.accounting.config import AccountingSettings
    from services.accounting.service import StartReport
    from services.accounting.store import ReadModelStore

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"t{uuid.uuid4().hex[:8]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    db_url = redis_url.rsplit("/", 1)[0] + "/14"
    r = redis_lib.Redis.from_url(db_url, **redis_auth())
    store = ReadModelStore(r)
    store.wipe()
    producer = EventProducer(kafka_bootstrap, client_id="test")
    clock = ManualClock(from_us(h(5)))

    async def start_and_stop(rebuild: bool):
        """Run accounting until it is caught up and has stored its state, then stop it gracefully."""
        settings = AccountingSettings(
            kafka_bootstrap=kafka_bootstrap,
            redis_url=db_url,
            window_s=WINDOW_S,
            snapshot_interval_s=0,
            snapshot_debounce_wall_s=0,
            rebuild=rebuild,
        )
        stop, ready = asyncio.Event(), asyncio.Event()
        reports: list[StartReport] = []
        task = asyncio.create_task(run_accounting(settings, stop, clock=clock, ready=ready, on_start=reports.append))
        waiter = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait([task, waiter], timeout=DEADLINE_S, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            stop.set()
            if task in done:
                task.result()  # raises the service's error
            pytest.fail("accounting did not become ready")
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
        (report,) = reports
        meta, rows = store.read()
        header = checkpoint.read_header(store.read_checkpoint())
        return report, meta, rows, header

    try:
        for e in PHASE1:
            _publish(producer, e)
        first, meta1, rows1, header1 = await start_and_stop(rebuild=False)
        assert (first.mode, first.reason) == ("rebuild", "missing: no checkpoint stored")
        assert first.records == len(PHASE1)
        assert rows1 == acc_logic.read_model(_bulk(PHASE1, h(5)), fold_budget_log(PHASE1), {})[1]
        assert header1["offsets"] == meta1["offsets"] and sum(header1["offsets"].values()) == len(PHASE1)

        # as after a crash between the Redis transaction and the Kafka commit, but worse: the group's
        # committed offsets say nothing was processed. The start must not care.
        assert (
            await asyncio.to_thread(_group_offsets, kafka_bootstrap, "accounting", header1["offsets"], False)
            == header1["offsets"]
        )  # committed right after the checkpoint
        zeros = {p: 0 for p in header1["offsets"]}
        assert await asyncio.to_thread(_group_offsets, kafka_bootstrap, "accounting", zeros, True) == zeros
        for e in PHASE2:
            _publish(producer, e)
        second, meta2, rows2, header2 = await start_and_stop(rebuild=False)
        assert (second.mode, second.reason, second.late_across_cut) == ("resume", "", 0)
        assert second.offsets == header1["offsets"]  # it read from the checkpoint's offsets ...
        assert second.records == len(PHASE2)  # ... only the records logged since, not the log from 0
        everything = PHASE1 + PHASE2
        ref = _bulk(everything, h(8))
        assert meta2["snapshot_id"] == str(ref.event_id)
        assert rows2 == acc_logic.read_model(ref, fold_budget_log(everything), {})[1]
        assert sum(header2["offsets"].values()) == len(everything)

        third, meta3, rows3, header3 = await start_and_stop(rebuild=True)
        assert (third.mode, third.reason, third.records) == ("rebuild", "--rebuild", len(everything))
        assert (meta3, rows3) == (meta2, rows2)  # the resumed read model is the rebuilt one, exactly
        assert header3["offsets"] == header2["offsets"] and header3["clock_us"] == header2["clock_us"] == h(8)
    finally:
        producer.close()
        store.wipe()
        r.close()
