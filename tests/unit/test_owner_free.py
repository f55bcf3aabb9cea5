"""Rule ``D3.owner-free``: a leaf at or under its share places its unallocated jobs on free GPUs, up to its
headroom, before the allocated jobs of leaves over their share; they stay free and preemptible at once.

Tree (``tests.unit.test_engine``)::

    lab (1.0)
    ├── a  0.5
    ├── b  0.25
    └── c  0.25

One node n0 of 8 GPUs, so C(t) = 8 and lab/a's share of it is 0.5 x 8 = 4 GPUs. Window capacity K = 1,000 GPU-s:
lab/b at O = 500 has r = 500 / (0.25 x 1,000) = 2 (a borrower); lab/a and lab/c at O = 0 have r = 0. lab/b's
allocated run x holds n0's GPUs 0, 1; its allocated job b1 (2 GPUs) waits.
"""

from __future__ import annotations

import pytest

from apportion.domain.fairshare import owner_headroom
from tests.kit.builders import h
from tests.kit.engine_world import World, placed, preempted

BORROWING = {"lab/b": 500.0, "lab": 500.0}


def _world(a_holds: tuple[int, ...] = (), a_holds_allocated: bool = True, a_over: bool = False) -> World:
    """n0: x (lab/b, GPUs 0, 1), lab/a's run y on ``a_holds`` (allocated or not); lab/a's unallocated a1 (2 GPUs)
    and a2 (1 GPU), lab/b's allocated b1 (2 GPUs). ``a_over``: lab/a at O = 600, r = 600 / 500 = 1.2."""
    w = World().node("n0", 8).run("x", "lab/b", {"n0": (0, 1)})
    if a_holds:
        w.run("y", "lab/a", {"n0": a_holds}, allocated=a_holds_allocated)
    w.occupancy = dict(BORROWING)
    if a_over:
        w.occupancy = {"lab/b": 500.0, "lab/a": 600.0, "lab": 1100.0}
    w.job("a1", "lab/a", 2, min_runtime_s=0, submitted=h(1))
    w.job("a2", "lab/a", 1, min_runtime_s=0, submitted=h(2))
    return w.job("b1", "lab/b", 2, submitted=h(1))


CASES = [
    # (case id, world, expected placements with owner_free, expected without)
    (
        # headroom 4 - 0 = 4: a1 (2) and a2 (1) first, on the fullest fit; b1 takes 2 of the 3 left
        "a leaf under its share runs its free work before a borrower's allocated job",
        _world(),
        ["a1@n0[2, 3]", "a2@n0[4]", "b1@n0[5, 6]"],
        ["b1@n0[2, 3]", "a1@n0[4, 5]", "a2@n0[6]"],
    ),
    (
        # y allocated on 2: headroom 4 - 2 = 2, exactly a1; a2 (1) is over what is left of it; b1 takes the last 2
        # free GPUs, so a2 finds none in pass 2
        "headroom boundary: the share less the allocated GPUs in use, filled exactly",
        _world((2, 3)),
        ["a1@n0[4, 5]", "b1@n0[6, 7]"],
        ["b1@n0[4, 5]", "a1@n0[6, 7]"],
    ),
    (
        # y allocated on 3: headroom 1, a1 (2) is over it, a2 (1) is not; b1 next; a1 finds nothing free in pass 2
        "headroom boundary: a job larger than the headroom is passed over, a smaller one behind it placed",
        _world((2, 3, 4)),
        ["a2@n0[5]", "b1@n0[6, 7]"],
        ["b1@n0[5, 6]", "a2@n0[7]"],
    ),
    (
        # lab/a's own free run y on 4 GPUs counts: headroom 0, the cycle is as without the rule
        "its unallocated GPUs in use count against the headroom",
        _world((2, 3, 4, 5), a_holds_allocated=False),
        ["b1@n0[6, 7]"],
        ["b1@n0[6, 7]"],
    ),
    (
        # r_a = 1.2 > 1: no headroom to lend; b1 first (pass 1), then a1 and a2 on what is left (pass 2)
        "a leaf over its share has no headroom",
        _world(a_over=True),
        ["b1@n0[2, 3]", "a1@n0[4, 5]", "a2@n0[6]"],
        ["b1@n0[2, 3]", "a1@n0[4, 5]", "a2@n0[6]"],
    ),
]


@pytest.mark.parametrize(("world", "with_rule", "without"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_owner_free_placements(world: World, with_rule: list[str], without: list[str]) -> None:
    assert placed(world.cycle(owner_free=True)) == with_rule
    assert placed(world.cycle(owner_free=False)) == without


def test_owner_free_runs_are_preempted_at_once_by_an_owed_budget() -> None:
    # the next cycle: lab/a's free run u (GPUs 2-7, started at h(10) itself, so it has run 0 s) and lab/c's
    # allocated c1 (6 GPUs, r_c = 0: owed GPUs). u is an unallocated victim (D3.victims 1), preempted at once;
    # x, protected for its minimum runtime of 1 h since h(9.5), is not
    w = World().node("n0", 8).run("x", "lab/b", {"n0": (0, 1)}, started=h(9) + h(1) // 2)
    w.run("u", "lab/a", {"n0": (2, 3, 4, 5, 6, 7)}, allocated=False, started=h(10))
    w.occupancy = dict(BORROWING)
    w.job("c1", "lab/c", 6, submitted=h(1))
    res = w.cycle(owner_free=True)
    assert preempted(res) == ["u<-c1"]
    assert placed(res) == ["c1@n0[2, 3, 4, 5, 6, 7]"]


@pytest.mark.parametrize(
    ("share", "capacity", "in_use", "expected"),
    [(0.5, 8, 0, 4.0), (0.5, 8, 2, 2.0), (0.5, 8, 4, 0.0), (0.5, 8, 6, -2.0), (0.0, 8, 0, 0.0)],
    ids=["nothing in use", "2 in use", "exactly its share", "over its share", "share 0"],
)
def test_owner_headroom_is_share_of_capacity_less_gpus_in_use(
    share: float, capacity: int, in_use: int, expected: float
) -> None:
    assert owner_headroom(share, capacity, in_use) == expected
