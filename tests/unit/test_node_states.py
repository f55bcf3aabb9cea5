"""The node state machine (rule D1.node): every transition of ``node_transition``, and its two folds.

The table lists each (state before, event) pair: 6 states before (``None`` is a node not registered yet)
x 6 node events = 36 rows, written out by hand from rule D1.node and the module docstring of
``apportion.domain.nodes``.
"""

from __future__ import annotations

import pytest

from apportion.domain.cluster import ClusterState
from apportion.domain.nodes import COUNTED_STATES, NODE_STATES, NodeEvent, is_node_state, node_transition
from apportion.domain.occupancy import OccupancyLedger
from tests.kit.builders import T0, cordoned, drain, drained, h, node, node_lost, uncordoned

EVENTS: dict[str, NodeEvent] = {
    "registered": node("n0", 4, at=h(1)),
    "cordoned": cordoned("n0", at=h(1)),
    "drain": drain("n0", at=h(1)),
    "drained": drained("n0", at=h(1)),
    "uncordoned": uncordoned("n0", at=h(1)),
    "lost": node_lost("n0", last_heartbeat=h(1), at=h(1)),
}

# (state before, event) -> state after
TRANSITIONS = [
    # a registration makes any node ready, an unknown or lost one too (its agent restarted)
    (None, "registered", "ready"),
    ("ready", "registered", "ready"),
    ("cordoned", "registered", "ready"),
    ("draining", "registered", "ready"),
    ("drained", "registered", "ready"),
    ("lost", "registered", "ready"),
    # cordon
    (None, "cordoned", None),
    ("ready", "cordoned", "cordoned"),
    ("cordoned", "cordoned", "cordoned"),
    ("draining", "cordoned", "cordoned"),
    ("drained", "cordoned", "cordoned"),
    ("lost", "cordoned", "lost"),
    # drain request
    (None, "drain", None),
    ("ready", "drain", "draining"),
    ("cordoned", "drain", "draining"),
    ("draining", "drain", "draining"),
    ("drained", "drain", "draining"),
    ("lost", "drain", "lost"),
    # drained (the dispatcher's report that a draining node is empty)
    (None, "drained", None),
    ("ready", "drained", "drained"),
    ("cordoned", "drained", "drained"),
    ("draining", "drained", "drained"),
    ("drained", "drained", "drained"),
    ("lost", "drained", "lost"),
    # uncordon returns a cordoned, draining or drained node to service
    (None, "uncordoned", None),
    ("ready", "uncordoned", "ready"),
    ("cordoned", "uncordoned", "ready"),
    ("draining", "uncordoned", "ready"),
    ("drained", "uncordoned", "ready"),
    ("lost", "uncordoned", "lost"),
    # loss
    (None, "lost", None),
    ("ready", "lost", "lost"),
    ("cordoned", "lost", "lost"),
    ("draining", "lost", "lost"),
    ("drained", "lost", "lost"),
    ("lost", "lost", "lost"),
]


def test_node_states_table_covers_every_state_and_event():
    assert {(before, e) for before, e, _ in TRANSITIONS} == {(s, e) for s in (None, *NODE_STATES) for e in EVENTS}
    assert len(TRANSITIONS) == 36


@pytest.mark.parametrize(("before", "event", "after"), TRANSITIONS, ids=[f"{b}-{e}" for b, e, _ in TRANSITIONS])
def test_node_transition(before, event, after):
    assert node_transition(before, EVENTS[event]) == after


def test_node_states_counted_toward_capacity_are_ready_and_draining():
    assert {s for s in NODE_STATES if s in COUNTED_STATES} == {"ready", "draining"}


def test_is_node_state_names_the_five_states_only():
    assert [is_node_state(s) for s in ("ready", "cordoned", "draining", "drained", "lost")] == [True] * 5
    assert [is_node_state(s) for s in ("unknown", "", None, "Ready")] == [False] * 4


def _cluster_state(before: str | None) -> ClusterState:
    """A cluster whose node n0 is in ``before`` (``None``: not registered)."""
    cs = ClusterState()
    if before is None:
        return cs
    cs.apply(node("n0", 4, at=T0))
    lead: dict[str, list[NodeEvent]] = {
        "cordoned": [cordoned("n0")],
        "draining": [drain("n0")],
        "drained": [drain("n0"), drained("n0")],
    }
    lead["lost"] = [node_lost("n0", last_heartbeat=T0)]
    for e in lead.get(before, []):
        cs.apply(e)
    assert cs.nodes["n0"].state == before
    return cs


@pytest.mark.parametrize(("before", "event", "after"), TRANSITIONS, ids=[f"{b}-{e}" for b, e, _ in TRANSITIONS])
def test_cluster_state_follows_node_transition(before, event, after):
    cs = _cluster_state(before)
    cs.apply(EVENTS[event])
    got = cs.nodes["n0"].state if "n0" in cs.nodes else None
    assert got == after


def test_capacity_follows_node_transition_with_a_lost_node_ending_at_its_last_heartbeat():
    # 4 GPUs: ready [0h, 1h) counts, cordoned [1h, 2h) does not, draining [2h, 3h) counts, drained [3h, 4h)
    # does not, ready again from 4h, lost at 6h with its last heartbeat at 5.5h: counts on [4h, 5.5h).
    # K over (0h, 7h] = 4 GPUs x (1 + 1 + 1.5) h = 14 GPU-h; a cordon of the lost node changes nothing.
    ledger = OccupancyLedger(10 * 3600).apply_all(
        [
            node("n0", 4, at=h(0)),
            cordoned("n0", at=h(1)),
            drain("n0", at=h(2)),
            drained("n0", at=h(3)),
            uncordoned("n0", at=h(4)),
            node_lost("n0", last_heartbeat=h(5.5), at=h(6)),
            cordoned("n0", at=h(6.5)),
        ]
    )
    assert ledger.capacity_gpu_s(h(7)) == 14 * 3600.0
    assert ledger.capacity_gpus(h(7)) == 0
