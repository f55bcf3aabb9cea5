"""Rule ``D3.gang-wait`` (``EngineConfig.gang_wait_s``, off by default): an allocated gang across several nodes
whose attempt has waited less than ``gang_wait_s`` starts only on free GPUs: it neither preempts nor reserves.
From that wait on, and for every single-node job, the normal rules (D3.victims, D3.scheduling-cycle).

Tree (``tests.kit.engine_world``)::

    lab (1.0)
    ├── a  0.5
    ├── b  0.25
    └── c  0.25

Two nodes of 8 GPUs. lab/a (r = 0: no occupancy) asks for a 2 x 8 gang a1; lab/b's unallocated runs u0 and u1
hold GPUs 0-3 of n0 and n1, so 4 + 4 GPUs are free and a1 fits only by preempting both (D3.victims 1).
"""

from __future__ import annotations

import pytest

from tests.kit.engine_world import NOW, World, placed, preempted

WAIT_S = 42 * 3600.0  # W / 4 of a 7-day window
HOUR_US = 3_600_000_000
WAIT_US = 42 * HOUR_US
ALL = list(range(8))


def _world(waited_us: int, gpus: int = 8, replicas: int = 2, unalloc: bool = True) -> World:
    """n0, n1 with lab/b's unallocated u0, u1 on GPUs 0-3 (when ``unalloc``); lab/a's allocated job a1 of
    ``gpus`` x ``replicas`` queued ``waited_us`` before the cycle."""
    w = World().node("n0", 8).node("n1", 8)
    if unalloc:
        w.run("u0", "lab/b", {"n0": (0, 1, 2, 3)}, allocated=False)
        w.run("u1", "lab/b", {"n1": (0, 1, 2, 3)}, allocated=False)
    return w.job("a1", "lab/a", gpus, replicas, submitted=NOW - waited_us, queued=NOW - waited_us)


CASES = [
    # (case id, world, placements and preemptions with the rule at 42 h, the same without it)
    (
        "a gang that has waited 1 h does not preempt",
        _world(HOUR_US),
        ([], []),
        ([f"a1@n0{ALL}+n1{ALL}"], ["u0<-a1", "u1<-a1"]),
    ),
    (
        "boundary: 1 µs short of the wait, it still does not preempt",
        _world(WAIT_US - 1),
        ([], []),
        ([f"a1@n0{ALL}+n1{ALL}"], ["u0<-a1", "u1<-a1"]),
    ),
    (
        "boundary: at exactly the wait the normal rules apply",
        _world(WAIT_US),
        ([f"a1@n0{ALL}+n1{ALL}"], ["u0<-a1", "u1<-a1"]),
        ([f"a1@n0{ALL}+n1{ALL}"], ["u0<-a1", "u1<-a1"]),
    ),
    (
        "a waiting gang still starts on free GPUs",
        _world(HOUR_US, unalloc=False),
        ([f"a1@n0{ALL}+n1{ALL}"], []),
        ([f"a1@n0{ALL}+n1{ALL}"], []),
    ),
    (
        # 8 x 1: one node; the fewest unallocated GPUs to preempt are u0's 4 on n0 (ties by node id)
        "a single-node job is not concerned",
        _world(HOUR_US, replicas=1),
        ([f"a1@n0{ALL}"], ["u0<-a1"]),
        ([f"a1@n0{ALL}"], ["u0<-a1"]),
    ),
]


@pytest.mark.parametrize(("world", "with_rule", "without"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gang_wait_placements(
    world: World, with_rule: tuple[list[str], list[str]], without: tuple[list[str], list[str]]
) -> None:
    on = world.cycle(gang_wait_s=WAIT_S)
    off = world.cycle()
    assert (placed(on), preempted(on)) == with_rule
    assert (placed(off), preempted(off)) == without


def test_a_waiting_gang_reserves_nothing_and_its_nodes_run_other_work() -> None:
    # x (lab/b, allocated, started at the cycle: protected for its hour) holds n0's GPUs 0-3, so a1 cannot
    # preempt its way in either way and, having waited 2 h (past reservation_after, 1 h), is the holder without
    # the rule: it reserves n1 and n0 and fits when x's protection ends (window capacity K = 1e6 GPU-s: lab/b at
    # r = 5e5 / 2.5e5 = 2 is behind lab/a, whose r with a1's charge is 16 x 3,600 / 5e5 = 0.115, so a1 may take x
    # back); lab/c's 8-GPU c1 (r = 0, not behind lab/a: a1 could not take it
    # back) may not borrow n1 and gets nothing. With the rule a1 reserves nothing and c1 takes n1's 8 free GPUs
    w = World().node("n0", 8).node("n1", 8).run("x", "lab/b", {"n0": (0, 1, 2, 3)}, started=NOW)
    w.capacity = 1e6
    w.occupancy = {"lab/b": 5e5, "lab": 5e5}
    w.job("a1", "lab/a", 8, 2, submitted=NOW - 2 * HOUR_US, queued=NOW - 2 * HOUR_US)
    w.job("c1", "lab/c", 8, submitted=NOW, queued=NOW)
    off = w.cycle()
    assert off.reservation == ("a1", ("n1", "n0"))  # the nodes with the most free GPUs first: 8, then 4
    assert placed(off) == []
    on = w.cycle(gang_wait_s=WAIT_S)
    assert on.reservation is None
    assert placed(on) == [f"c1@n1{ALL}"]
