"""Heartbeat timeouts count from the dispatcher's recorded grace (issue 18), not from its own blindness.

A dispatcher that led through a broker outage saw no heartbeats because *it* could not read; it records
``DispatcherConfigured.heartbeats_from`` when it can read again, and ``maintenance`` then loses a node
only when both its last heartbeat and that time are more than the timeout ago
(:func:`apportion.domain.dispatch.heartbeat_deadline_us`). Times below are seconds after T0.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from apportion import events
from apportion.domain.dispatch import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DispatchConfig,
    DispatchState,
    evolve,
    heartbeat_deadline_us,
    maintenance,
    overdue_nodes,
)
from apportion.timeutil import s_to_us, to_us
from services.dispatcher.config import DispatcherSettings

T0 = datetime(2025, 3, 1, tzinfo=UTC)
CFG = DispatchConfig(heartbeat_timeout_s=30.0)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def us(s: float) -> int:
    return to_us(at(s))


def configured(heartbeats_from_s: float | None, ts_s: float) -> events.DispatcherConfigured:
    return events.DispatcherConfigured(
        event_id=events.det_id("test-configured", ts_s),
        ts=at(ts_s),
        producer="dispatcher",
        instance="d-1",
        policy_version="fairtree-4",
        window_s=7 * 86400.0,
        delta=0.05,
        grace_s=30.0,
        heartbeat_timeout_s=30.0,
        reservation_after_s=3600.0,
        heartbeats_from=None if heartbeats_from_s is None else at(heartbeats_from_s),
    )


def cluster() -> DispatchState:
    """Two 4-GPU nodes registered at 0 s; n1 heartbeats again at 10 s."""
    st = DispatchState()
    for n in ("n1", "n2"):
        evolve(st, events.NodeRegistered(event_id=events.det_id("r", n), node_id=n, gpu_count=4, ts=at(0)))
    evolve(st, events.NodeHeartbeat(event_id=events.det_id("hb", "n1"), node_id="n1", ts=at(10)))
    return st


def lost(st: DispatchState, now_s: float) -> list[tuple[str, datetime]]:
    return [(e.node_id, e.last_heartbeat) for e in maintenance(st, us(now_s), CFG) if isinstance(e, events.NodeLost)]


def test_the_deadline_is_one_timeout_after_the_later_of_the_heartbeat_and_the_grace() -> None:
    limit = s_to_us(30)
    assert heartbeat_deadline_us(us(10), None, limit) == us(40)
    assert heartbeat_deadline_us(us(10), us(100), limit) == us(130)
    assert heartbeat_deadline_us(us(150), us(100), limit) == us(180)  # a heartbeat after the grace counts


def test_without_a_grace_a_node_is_lost_one_timeout_after_its_last_heartbeat() -> None:
    st = cluster()
    assert lost(st, 30) == []
    assert lost(st, 30.000001) == [("n2", at(0))]
    assert lost(st, 40.000001) == [("n1", at(10)), ("n2", at(0))]


def test_after_an_outage_no_node_is_lost_before_one_timeout_from_the_grace_and_a_silent_one_is_after() -> None:
    st = cluster()
    evolve(st, configured(heartbeats_from_s=200, ts_s=200))  # the dispatcher read nothing from 10 s to 200 s
    assert st.heartbeats_from_us == us(200)
    assert lost(st, 200) == [] and lost(st, 230) == []  # before the fix: both lost at 200 s
    evolve(st, events.NodeHeartbeat(event_id=events.det_id("hb", "n1", 2), node_id="n1", ts=at(215)))
    # n2 stayed silent for a whole timeout after the dispatcher could read again: lost, charged to its real
    # last heartbeat (0 s), not to the grace
    assert lost(st, 230.000001) == [("n2", at(0))]
    assert lost(st, 245.000001) == [("n1", at(215)), ("n2", at(0))]


def test_an_older_grace_never_moves_the_newest_back_and_a_record_without_one_changes_nothing() -> None:
    st = cluster()
    evolve(st, configured(heartbeats_from_s=200, ts_s=200))
    evolve(st, configured(heartbeats_from_s=50, ts_s=201))  # a deposed leader's record, folded late
    evolve(st, configured(heartbeats_from_s=None, ts_s=202))
    assert st.heartbeats_from_us == us(200)
    assert st.fork().heartbeats_from_us == us(200)  # a planning fork judges the same way


def test_the_grace_survives_a_snapshot_pickle() -> None:
    import pickle

    st = cluster()
    evolve(st, configured(heartbeats_from_s=200, ts_s=200))
    back = pickle.loads(pickle.dumps(st))
    assert back.heartbeats_from_us == us(200)
    assert lost(back, 230) == []


def test_the_default_heartbeat_timeout_is_design_section_3s_30_s_in_every_reader() -> None:
    # rule D3.node-lost: "no heartbeat for heartbeat_timeout, default 30 s"; one home, read by the config and the
    # service
    assert DEFAULT_HEARTBEAT_TIMEOUT_S == 30.0
    assert DispatchConfig().heartbeat_timeout_s == DEFAULT_HEARTBEAT_TIMEOUT_S
    assert DispatcherSettings.model_fields["heartbeat_timeout_s"].default == DEFAULT_HEARTBEAT_TIMEOUT_S


def test_overdue_nodes_are_those_past_their_deadline_at_every_boundary() -> None:
    """``overdue_nodes`` (asked before every tick) against its definition: the nodes neither lost nor drained
    that have a heartbeat and whose :func:`heartbeat_deadline_us` is before now, sorted; heartbeats at 0-59 s
    (n00 none, every seventh lost or drained), with no grace and graces at 20 s and 45 s, at every whole
    second from 0 to 120 and one microsecond either side of each deadline."""
    import random

    rng = random.Random(7)
    st = DispatchState()
    for i in range(60):
        nid = f"n{i:02d}"
        evolve(st, events.NodeRegistered(event_id=events.det_id("r", nid), node_id=nid, gpu_count=4, ts=at(0)))
        if i:
            evolve(st, events.NodeHeartbeat(event_id=events.det_id("hb", nid), node_id=nid, ts=at(rng.randrange(60))))
    from dataclasses import replace

    for i in range(0, 60, 7):
        nid = f"n{i:02d}"
        st.cluster.nodes[nid] = replace(st.cluster.nodes[nid], state="lost" if i % 2 else "drained")
    limit = s_to_us(CFG.heartbeat_timeout_s or 0)
    for since in (None, us(20), us(45)):
        st.heartbeats_from_us = since
        deadlines = [
            heartbeat_deadline_us(n.last_heartbeat_us, since, limit)
            for n in st.cluster.nodes.values()
            if n.last_heartbeat_us
        ]
        for now in sorted({us(s) for s in range(121)} | {d + k for d in deadlines for k in (-1, 0, 1)}):
            assert overdue_nodes(st, now, CFG) == [
                nid
                for nid in sorted(st.cluster.nodes)
                if (n := st.cluster.nodes[nid]).state not in ("lost", "drained")
                and n.last_heartbeat_us is not None
                and now > heartbeat_deadline_us(n.last_heartbeat_us, since, limit)
            ]
