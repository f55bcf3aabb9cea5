"""What the dispatcher's ``app.py`` wires together, with fakes (no Kafka, no Redis): the standby loop
(``lease.stand_by``, ``lease.lead_when_elected``), the keeper's test of leadership, sends without acks
(``bus.producer.Unacked``) and the resume from a snapshot (``store.restore_snapshot``)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from apportion.events import NodeCordoned
from apportion.settings import topic_name
from apportion.topics import COMMANDS, JOBS, NODES
from services.dispatcher import lease as lease_mod
from services.dispatcher import store
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.lease import LeadershipLost, Lease, LeaseKeeper, lead_when_elected, stand_by


class ScriptedLease(Lease):
    """A lease whose ``held_by_another`` and ``try_acquire`` answers come from lists; it records each call."""

    def __init__(self, others: list[bool], tokens: list[int], ttl_s: float = 0.003) -> None:  # no Redis
        self.others, self.tokens, self.ttl_s = others, tokens, ttl_s
        self.calls: list[Any] = []
        self.token = 0

    def held_by_another(self) -> bool:
        self.calls.append("held?")
        return self.others.pop(0)

    def try_acquire(self, floor: int | None = None) -> int:
        self.calls.append(("acquire", floor))
        self.token = self.tokens.pop(0)
        return self.token


class Ready:
    def __init__(self) -> None:
        self.said: list[Any] = []

    def set(self, ready: bool, reason: str = "") -> None:
        self.said.append((ready, reason))


def floors(monkeypatch: pytest.MonkeyPatch, answers: list[Any]) -> list[Any]:
    """Make ``highest_token_in_log`` answer from ``answers`` (an exception is raised); returns the calls."""
    calls: list[Any] = []

    def fake(bootstrap: str, topics: list[str]) -> int:
        calls.append((bootstrap, tuple(topics)))
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(lease_mod, "highest_token_in_log", fake)
    return calls


def test_stand_by_reads_a_floor_only_when_a_take_over_is_possible_and_never_leads_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # try 1: another owner holds it (no floor read, no acquire); try 2: Kafka down (no acquire without a
    # floor); try 3: floor 7 read, the race lost (standing by: ready); try 4: floor 7, token 8
    read = floors(monkeypatch, [ConnectionError("no broker"), 7, 7])
    lease = ScriptedLease(others=[True, False, False, False], tokens=[0, 8])
    ready = Ready()
    token = asyncio.run(stand_by(lease, "k:1", ready, asyncio.Event(), 0.001))
    assert token == 8
    assert lease.calls == ["held?", "held?", "held?", ("acquire", 7), "held?", ("acquire", 7)]
    assert read == [("k:1", (topic_name(COMMANDS), topic_name(JOBS), topic_name(NODES)))] * 3
    assert ready.said == [(True, "")]


def test_stand_by_gives_up_once_stop_is_set() -> None:
    stop = asyncio.Event()
    stop.set()
    lease = ScriptedLease(others=[], tokens=[])
    assert asyncio.run(stand_by(lease, "k:1", Ready(), stop, 0.001)) is None
    assert lease.calls == []


class Gauge:
    def __init__(self) -> None:
        self.values: list[int] = []

    def set(self, v: int) -> None:
        self.values.append(v)


def test_lead_when_elected_runs_a_term_per_election_and_stands_by_again_after_a_lost_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    floors(monkeypatch, [3, 4])
    lease = ScriptedLease(others=[False, False], tokens=[4, 5])
    ready, gauge, stop = Ready(), Gauge(), asyncio.Event()
    terms: list[int] = []

    async def term() -> None:
        terms.append(lease.token)
        if len(terms) == 1:
            raise LeadershipLost()
        stop.set()  # the second term ends with the shutdown

    asyncio.run(lead_when_elected(lease, "k:1", ready, stop, gauge, term))
    assert terms == [4, 5]
    assert gauge.values == [1, 0, 1, 0]
    assert ready.said == [(False, "rebuilding as the leader")] * 2


def test_lead_when_elected_lets_any_other_failure_of_a_term_through(monkeypatch: pytest.MonkeyPatch) -> None:
    floors(monkeypatch, [1])
    lease, gauge = ScriptedLease(others=[False], tokens=[2]), Gauge()

    async def term() -> None:
        raise ConnectionError("redis went away")

    with pytest.raises(ConnectionError):
        asyncio.run(lead_when_elected(lease, "k:1", Ready(), asyncio.Event(), gauge, term))
    assert gauge.values == [1, 0]


class ClockLease(Lease):
    def __init__(self, token: int, left_s: float) -> None:  # no Redis: Lease.__init__ is not called
        self.token, self.left_s = token, left_s

    def expires_in(self) -> float:
        return self.left_s


@pytest.mark.parametrize(
    "left_s, lost, holds",
    [
        pytest.param(3.01, False, True, id="more than a third of the TTL left: leading"),
        pytest.param(3.0, False, False, id="exactly a third left: stop before it can expire"),
        pytest.param(9.0, True, False, id="a renewal was lost: stop at once"),
    ],
)
def test_the_keeper_holds_the_lease_while_no_renewal_was_lost_and_more_than_a_period_is_left(
    left_s: float, lost: bool, holds: bool
) -> None:
    keeper = LeaseKeeper.for_ttl(ClockLease(5, left_s), ttl_s=9.0)
    assert (keeper.every_s, keeper.stall_s) == (3.0, 90.0)
    if lost:
        keeper.lost.set()
    assert keeper.holds() is holds


def test_the_keeper_stops_renewing_after_30_s_without_a_beat_for_a_short_ttl() -> None:
    assert LeaseKeeper.for_ttl(ClockLease(5, 1.0), ttl_s=0.6).stall_s == 30.0


def test_the_keeper_beats_from_the_event_loop_every_period() -> None:
    beats: list[float] = []

    class CountingKeeper(LeaseKeeper):
        def beat(self) -> None:
            beats.append(0.0)

    keeper = CountingKeeper.for_ttl(ClockLease(5, 1.0), ttl_s=0.003)

    async def go() -> None:
        task = asyncio.create_task(keeper.beats())
        while len(beats) < 3:
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(asyncio.wait_for(go(), 10.0))
    assert len(beats) >= 3


def test_unacked_sends_each_record_and_raises_on_the_first_that_was_not_delivered() -> None:
    from kafka.future import Future

    from apportion.bus.producer import Unacked

    class Producer:
        def __init__(self) -> None:
            self.sent: list[Any] = []
            self.futures: list[Future] = []

        def send_many(self, sent: list[tuple[Any, Any]]) -> list[Future]:
            self.sent.extend(sent)
            futures = [Future() for _ in sent]
            self.futures.extend(futures)
            return futures

    a, b = (NodeCordoned(node_id=n, ts=datetime(2026, 1, 1, tzinfo=UTC)) for n in ("a", "b"))
    p = Producer()
    sends = Unacked(p)
    sends.send_all([(a, b"1"), (b, None)])
    assert p.sent == [(a, b"1"), (b, None)]
    p.futures[0].success("acked")
    sends.check()  # nothing failed yet
    p.futures[1].failure(ConnectionError("gone"))
    with pytest.raises(RuntimeError, match=r"not delivered \(ConnectionError\('gone'\)\)"):
        sends.check()


class Snap:
    def __init__(self, token: int) -> None:
        self.fencing_token, self.offsets = token, {"apportion.jobs:0": 5}


class Svc:
    def __init__(self) -> None:
        self.restored: list[Any] = []

    def restore(self, snap: Any) -> None:
        self.restored.append(snap)


class Consumer:
    def __init__(self) -> None:
        self.sought: list[Any] = []

    def offsets_at_start(self) -> tuple[dict[str, int], dict[str, int]]:
        return {"apportion.jobs:0": 0}, {"apportion.jobs:0": 9}

    def seek(self, offsets: dict[str, int]) -> None:
        self.sought.append(offsets)


class ObservingLease:
    def __init__(self, token: int) -> None:
        self.token = token
        self.observed: list[int] = []

    def observe(self, token: int) -> None:
        self.observed.append(token)


@pytest.mark.parametrize(
    "stored, token, restored",
    [
        pytest.param(None, 4, False, id="no snapshot that fits: rebuild from offset 0"),
        pytest.param(4, 4, True, id="our own token: resume and seek to its offsets"),
        pytest.param(3, 4, True, id="an older leader's: resume"),
        pytest.param(5, 4, None, id="a newer leader's: deposed"),
    ],
)
def test_restore_snapshot(monkeypatch: pytest.MonkeyPatch, stored: int | None, token: int, restored: Any) -> None:
    snap = Snap(stored) if stored is not None else None
    asked: list[Any] = []

    def load(r: Any, settings: Any, begin: Any, end: Any) -> Any:
        asked.append((begin, end))
        return snap

    monkeypatch.setattr(store, "load_snapshot", load)
    svc, consumer, lease = Svc(), Consumer(), ObservingLease(token)
    if restored is None:
        with pytest.raises(LeadershipLost):
            store.restore_snapshot(None, DispatcherSettings(), svc, consumer, lease)
        assert (svc.restored, consumer.sought, lease.observed) == ([], [], [5])
        return
    got = store.restore_snapshot(None, DispatcherSettings(), svc, consumer, lease)
    assert asked == [({"apportion.jobs:0": 0}, {"apportion.jobs:0": 9})]
    assert got is snap
    assert svc.restored == ([snap] if restored else [])
    assert consumer.sought == ([{"apportion.jobs:0": 5}] if restored else [])
    assert lease.observed == ([stored] if restored else [])
