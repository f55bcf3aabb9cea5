"""Idle runs as the dispatcher folds them from heartbeats (``apportion.domain.idle``) and shows them
in the ``apportion:rm:jobs`` rows (``services.dispatcher.logic.read_model``).

Tree and nodes of ``test_heartbeat_reconcile``: lab (1.0) -> a 0.5 (alice), b 0.5; n0, n1 with 4 GPUs;
j1 placed and started at T0.
"""

from __future__ import annotations

import pytest

from apportion import events as ev
from apportion.domain.dispatch import step
from apportion.domain.idle import RunIdle, run_idle
from services.dispatcher.logic import read_model
from tests.kit.builders import m
from tests.kit.domain_dispatch import REC, _running, hb


def idle_hb(node: str, at: int, *running: tuple[int, float | None, bool]) -> ev.NodeHeartbeat:
    """A heartbeat of ``node`` listing replicas of j1 attempt 1 as ``(replica, idle_s, idle)``."""
    base = hb(node, at, *(("j1", 1, r) for r, _, _ in running))
    entries = (
        w.model_copy(update={"idle_s": s, "idle": i}) for w, (_, s, i) in zip(base.running, running, strict=True)
    )
    return base.model_copy(update={"running": tuple(entries)})


def test_a_run_reported_idle_is_idle_in_the_state_and_the_read_model():
    state, placed = _running()
    node = placed.placements[0].node_id
    step(state, idle_hb(node, m(130), (0, 7200.0, True)), m(130), REC)
    assert run_idle(state.idle, state.cluster.runs[("j1", 1)]) == RunIdle(7200.0, True)
    jobs, _ = read_model(state, m(130), REC)
    assert (jobs["j1"]["idle_s"], jobs["j1"]["idle"]) == (7200.0, True)


def test_a_busy_heartbeat_ends_the_idle_spell():
    state, placed = _running()
    node = placed.placements[0].node_id
    step(state, idle_hb(node, m(1), (0, 60.0, False)), m(1), REC)
    step(state, idle_hb(node, m(2), (0, 0.0, False)), m(2), REC)
    assert run_idle(state.idle, state.cluster.runs[("j1", 1)]) == RunIdle(0.0, False)


def test_an_older_heartbeat_changes_nothing():
    state, placed = _running()
    node = placed.placements[0].node_id
    step(state, idle_hb(node, m(2), (0, 120.0, False)), m(2), REC)
    step(state, idle_hb(node, m(1), (0, 0.0, False)), m(1), REC)  # arrives late
    assert run_idle(state.idle, state.cluster.runs[("j1", 1)]) == RunIdle(120.0, False)


@pytest.mark.parametrize(
    ("r0", "r1", "want"),
    [
        pytest.param((0, 3600.0, True), (1, 600.0, False), RunIdle(600.0, False), id="shortest replica counts"),
        pytest.param((0, 7300.0, True), (1, 7200.0, True), RunIdle(7200.0, True), id="idle only when every one is"),
        pytest.param((0, 7300.0, True), (1, None, False), None, id="one replica unknown: unknown"),
    ],
)
def test_a_gang_is_idle_only_while_every_replica_is(r0, r1, want):
    state, placed = _running(gpus=4, replicas=2)
    nodes = [p.node_id for p in placed.placements]
    assert len(set(nodes)) == 2  # one replica per node (4 GPUs each)
    step(state, idle_hb(nodes[0], m(130), r0), m(130), REC)
    step(state, idle_hb(nodes[1], m(130), r1), m(130), REC)
    assert run_idle(state.idle, state.cluster.runs[("j1", 1)]) == want


def test_without_a_report_the_read_model_has_no_idle_fields():
    state, placed = _running()
    node = placed.placements[0].node_id
    step(state, idle_hb(node, m(1), (0, None, False)), m(1), REC)  # an agent with no utilisation sample
    jobs, _ = read_model(state, m(1), REC)
    assert "idle_s" not in jobs["j1"] and "idle" not in jobs["j1"]


def test_heartbeats_of_an_unregistered_node_are_not_kept():
    state, _ = _running()
    step(state, idle_hb("ghost", m(1), (0, 60.0, False)), m(1), REC)
    assert "ghost" not in state.idle.by_node
