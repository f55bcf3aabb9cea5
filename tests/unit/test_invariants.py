"""Each invariant detector, fed the fault it exists to find, names it (and stays silent on a clean log)."""

from __future__ import annotations

from apportion import events as ev
from apportion.audit.invariants import Waiting, double_bookings, idle_while_waiting, partial_gangs
from apportion.domain.cluster import ClusterState
from tests.kit.builders import completed, cordoned, h, node, placed, preempted


def _on(e: ev.JobPlaced, *placements: tuple[str, tuple[int, ...]]) -> ev.JobPlaced:
    return e.model_copy(update={"placements": tuple(ev.Placement(node_id=n, gpus=g) for n, g in placements)})


# one node n0 with 4 GPUs
CLEAN = [
    node("n0", gpus=4, at=h(0)),
    _on(placed("a", gpus=2, at=h(1)), ("n0", (0, 1))),
    _on(placed("b", gpus=2, at=h(1)), ("n0", (2, 3))),
    completed("a", at=h(2)),
    _on(placed("c", gpus=2, at=h(3)), ("n0", (0, 1))),  # a's GPUs, free again
]


def test_clean_log_has_no_breaches() -> None:
    assert double_bookings(CLEAN) == []
    assert partial_gangs(CLEAN) == []


def test_double_booking_is_named() -> None:
    # d lands on GPU 3, still held by running b
    log = [*CLEAN, _on(placed("d", gpus=1, at=h(4)), ("n0", (3,)))]
    [b] = double_bookings(log)
    assert (b.check, b.subject, b.at_us) == ("double_booking", "d#1", h(4))
    assert b.detail == "GPU n0/3 is held by running b#1"


def test_taking_over_a_preempted_runs_gpus_is_not_double_booking() -> None:
    log = [
        *CLEAN,
        preempted("b", at=h(4)),
        _on(placed("d", gpus=2, at=h(4)), ("n0", (2, 3))),
    ]
    assert double_bookings(log) == []


def test_gpu_the_node_does_not_have_is_named() -> None:
    [b] = double_bookings([node("n0", gpus=4, at=h(0)), _on(placed("x", gpus=1, at=h(1)), ("n0", (7,)))])
    assert b.detail == "GPU n0/7 does not exist (4 GPUs)"


def test_partial_gang_is_named() -> None:
    half = _on(placed("g", gpus=2, replicas=2, at=h(1)), ("n0", (0, 1)))
    same_node = _on(placed("s", gpus=1, replicas=2, at=h(1)), ("n0", (0,)), ("n0", (1,)))
    short = _on(placed("t", gpus=2, at=h(1)), ("n0", (0,)))
    got = partial_gangs([node("n0", gpus=4, at=h(0)), half, same_node, short])
    assert [(b.subject, b.detail) for b in got] == [
        ("g#1", "1 of 2 replicas placed"),
        ("s#1", "replicas share a node (n0, n0)"),
        ("t#1", "not 2 distinct GPUs on n0"),
    ]


def _nodes(*evts: ev.Event) -> dict:
    cs = ClusterState()
    for e in evts:
        cs.apply(e)
    return cs.nodes


def test_idle_gpu_while_a_placeable_job_waits_is_named() -> None:
    # n0: 4 GPUs, 2 held; n1: 8 free
    nodes = _nodes(
        node("n0", gpus=4, at=h(0)), node("n1", gpus=8, at=h(0)), _on(placed("a", gpus=2, at=h(1)), ("n0", (0, 1)))
    )
    waiting = [
        Waiting("fits", 2, 1),  # n0 (2 free) or n1
        Waiting("gang", 2, 2),  # n0 and n1
        Waiting("too-big", 8, 2),  # only n1 has 8 free
        Waiting("wrong-model", 1, 1, "H100"),
    ]
    assert [b.subject for b in idle_while_waiting(nodes, waiting)] == ["fits", "gang"]
    # n1 reserved: only the 2 free GPUs of n0 are idle
    assert [b.subject for b in idle_while_waiting(nodes, waiting, reserved={"n1"})] == ["fits"]


def test_cordoned_nodes_do_not_count_as_idle() -> None:
    nodes = _nodes(node("n0", gpus=4, at=h(0)), cordoned("n0", at=h(1)))
    assert idle_while_waiting(nodes, [Waiting("j", 1, 1)]) == []
