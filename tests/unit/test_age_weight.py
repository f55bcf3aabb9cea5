"""``EngineConfig.age_weight``: a capped age weight on the fair-share walk (a measured lever, off by default).

World of ``tests.kit.engine_world`` (lab/a 0.5, lab/b 0.25, lab/c 0.25) with K = 1,000 GPU-s: r_a = 0, r_b = 200 /
250 = 0.8, r_c = 900 / 250 = 3.6. One node n0 of 1 GPU. ``fresh`` is lab/a's job queued at NOW (term 0, key 0);
``old`` lab/c's and ``mid`` lab/b's, queued ``waited`` before NOW. A leaf's key is r - w * min(floor(wait / 1 h) /
max_age_h, 1) and the lowest key goes first, ties by path (lab/a before lab/c). With w = 4 and a cap at 8 h,
lab/c's key is 3.6 - 0.5 x whole hours waited: 0.1 at 7 h (after lab/a's 0), -0.4 at 8 h and after (before it).
"""

from __future__ import annotations

import pytest

from apportion.domain.budgets import BudgetTree
from apportion.domain.engine import EngineConfig
from apportion.domain.engine.aging import AgedQueue
from apportion.domain.fairshare import FairShareQueue
from tests.kit.builders import h
from tests.kit.engine_world import NOW, World, placed, preempted

HOUR = h(1) - h(0)  # µs
CAP_S = 8 * 3600.0


def _world(waited_us: int, *, with_mid: bool = False, held_by_free: bool = False) -> World:
    w = World().node("n0", 1)
    if held_by_free:  # lab/a's unallocated run holds the only GPU: a victim for any allocated job (D3.victims 1)
        w.run("u", "lab/a", {"n0": (0,)}, allocated=False, started=h(9))
    w.occupancy, w.capacity = {"lab/a": 0.0, "lab/b": 200.0, "lab/c": 900.0, "lab": 1100.0}, 1000.0
    w.job("fresh", "lab/a", 1, submitted=NOW, queued=NOW)
    w.job("old", "lab/c", 1, submitted=h(0), queued=NOW - waited_us)
    if with_mid:
        w.job("mid", "lab/b", 1, submitted=h(0), queued=NOW - waited_us)
    return w


CASES = [
    # (case id, age_weight, age_max_s, waited (µs), world options, expected preemptions, expected placements)
    ("off (None): the fair-share order, lab/a first", None, CAP_S, 100 * HOUR, {}, [], ["fresh@n0[0]"]),
    ("8 h, the cap: key -0.4 < 0, lab/c first", 4.0, CAP_S, 8 * HOUR, {}, [], ["old@n0[0]"]),
    ("1 µs short of 8 h: 7 whole hours, key 0.1 > 0", 4.0, CAP_S, 8 * HOUR - 1, {}, [], ["fresh@n0[0]"]),
    ("past the cap the term stays w: key -0.4", 4.0, CAP_S, 1000 * HOUR, {}, [], ["old@n0[0]"]),
    ("w = r_c: key 0 at the cap, a tie: by path", 3.6, CAP_S, 1000 * HOUR, {}, [], ["fresh@n0[0]"]),
    ("gradual: a cap at 16 h, 8 h is half: key 1.6", 4.0, 2 * CAP_S, 8 * HOUR, {}, [], ["fresh@n0[0]"]),
    ("15 h of a 16 h cap: key 3.6 - 3.75 = -0.15", 4.0, 2 * CAP_S, 15 * HOUR, {}, [], ["old@n0[0]"]),
    ("both aged: lab/b's -3.2 before lab/c's -0.4", 4.0, CAP_S, 9 * HOUR, {"with_mid": True}, [], ["mid@n0[0]"]),
    ("aged: preempts free work", 4.0, CAP_S, 9 * HOUR, {"held_by_free": True}, ["u<-old"], ["old@n0[0]"]),
    ("off: lab/a preempts it", None, CAP_S, 9 * HOUR, {"held_by_free": True}, ["u<-fresh"], ["fresh@n0[0]"]),
]


@pytest.mark.parametrize(
    ("weight", "cap", "waited", "opts", "pre", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_age_weight(
    weight: float | None, cap: float, waited: int, opts: dict[str, bool], pre: list[str], want: list[str]
) -> None:
    res = _world(waited, **opts).cycle(age_weight=weight, age_max_s=cap)
    assert (preempted(res), placed(res)) == (pre, want)


@pytest.mark.parametrize(
    ("floor", "want"),
    [(None, ["mid@n0[0]"]), (1.0, ["fresh@n0[0]"])],
    ids=["lab/b (r 0.8, key -3.2) first", "floor 1: lab/a (r 0) first, lab/b keeps its 0.8"],
)
def test_age_floor_at_the_share(floor: float | None, want: list[str]) -> None:
    res = _world(9 * HOUR, with_mid=True).cycle(age_weight=4.0, age_max_s=CAP_S, age_floor_r=floor)
    assert placed(res) == want


@pytest.mark.parametrize(
    ("weight", "want"),
    [(None, ["fresh@n0[0]", "old@n1[0]"]), (4.0, ["old@n0[0]", "fresh@n1[0]"])],
    ids=[
        "off: lab/a first, then lab/c's first (old)",
        "the term falls once lab/c's old job is taken: lab/a before its young one",
    ],
)
def test_term_follows_the_oldest_job_left(weight: float | None, want: list[str]) -> None:
    # lab/c has an old job (9 h) and a young one (0 h), both of 1 s minimum runtime (a charge of 1 GPU-s: r_c 3.604
    # after the first). Its key is -0.4 while the old job is left, then 3.604: lab/a's job comes between the two.
    w = _world(9 * HOUR).node("n1", 1)
    w.pending["lab/c"] = []
    w.job("old", "lab/c", 1, min_runtime_s=1.0, submitted=h(0), queued=NOW - 9 * HOUR)
    w.job("young", "lab/c", 1, min_runtime_s=1.0, submitted=h(1), queued=NOW)
    res = w.cycle(age_weight=weight, age_max_s=CAP_S)
    assert placed(res) == want


def test_inner_node_takes_its_leaves_largest_term() -> None:
    # x (r 1.0) and y (r 0.5) under the root; x/p (r 1.0) has a term of 0.6 at its first job, x/q (r 1.0) none: x's
    # key 0.4 < y's 0.5, so x/p's first job comes first; then x/p's term is 0, x's key 1.0 > y's: y, then x/p and x/q
    # (a tie at 1.0, by path). With no term: y, then x/p's two and x/q.
    tree = BudgetTree.from_mapping({"x": 0.5, "x/p": 0.5, "x/q": 0.5, "y": 0.5})
    occ = {"x": 500.0, "x/p": 250.0, "x/q": 250.0, "y": 250.0}
    items = {"x/p": range(2), "x/q": range(1), "y": range(1)}
    aged = AgedQueue(tree, occ, 1000.0, items, {"x/p": [0.6, 0.0], "x/q": [0.0], "y": [0.0]})
    plain = FairShareQueue(tree, occ, 1000.0, items)
    assert [leaf for leaf, _ in aged] == ["x/p", "y", "x/p", "x/q"]
    assert [leaf for leaf, _ in plain] == ["y", "x/p", "x/p", "x/q"]
    assert (aged.initial_order, aged.ratio("x")) == (plain.initial_order, 1.0)


@pytest.mark.parametrize(
    ("terms", "floor", "want"),
    [
        ({"a": [0.0], "b": [0.0], "c": [0.0]}, None, ["a", "c", "b"]),
        ({"a": [0.0], "b": [3.0], "c": [0.0]}, None, ["b", "a", "c"]),
        ({"a": [0.0], "b": [3.0], "c": [0.0]}, 1.0, ["a", "b", "c"]),
        ({"a": [0.0], "b": [0.4], "c": [0.0]}, 1.0, ["a", "c", "b"]),
        ({"a": [0.4], "b": [0.0], "c": [0.0]}, 1.0, ["a", "c", "b"]),
        ({"a": [0.0], "b": [3.0], "c": [0.0]}, 0.25, ["b", "a", "c"]),
        ({"a": [0.0], "b": [3.0], "c": [0.0]}, 0.5, ["a", "b", "c"]),
    ],
    ids=[
        "no term: r order (0.5, 1.5, 2.0)",
        "b's term 3: key -1, before a",
        "floor 1: b lifted to its share (key 1), after a (0.5), before c (1.5)",
        "floor 1: b's term 0.4, key 1.6, after c",
        "floor 1: a at 0.5 keeps its r",
        "floor 0.25: b's key 0.25, before a's 0.5",
        "floor 0.5: b's key 0.5, a tie with a's r: by path",
    ],
)
def test_floor(terms: dict[str, list[float]], floor: float | None, want: list[str]) -> None:
    # a, b, c of share 1/3 each, K = 300 GPU-s (E = 100): r_a 0.5, r_b 2.0, r_c 1.5
    tree = BudgetTree.from_mapping({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    occ = {"a": 50.0, "b": 200.0, "c": 150.0}
    q = AgedQueue(tree, occ, 300.0, {"a": range(1), "b": range(1), "c": range(1)}, terms, floor)
    assert [leaf for leaf, _ in q] == want


def test_steady_end() -> None:
    q = AgedQueue(BudgetTree.from_mapping({"a": 1.0}), {}, 1.0, {"a": range(5)}, {"a": [2.0, 1.0, 1.0, 1.0, 0.0]})
    assert [q.steady_end("a", pos, 5) for pos in range(5)] == [1, 4, 4, 4, 5]
    assert q.steady_end("a", 1, 3) == 3


def test_defaults() -> None:
    cfg = EngineConfig()
    assert (cfg.age_weight, cfg.age_max_s, cfg.age_floor_r) == (None, 7 * 24 * 3600.0, None)
