"""Rule ``D3.hero-cover``: a job of at least ``hero_min_gpus`` GPUs larger than its budget's share of the capacity
neither reserves nodes nor preempts busy allocated runs; a job its share covers, or a smaller one, keeps the
ordinary rules. The cases set ``hero_min_gpus`` to 1 (the rule for every job) unless they say otherwise.

Tree (``tests.unit.test_engine``): lab/a 0.5, lab/b 0.25, lab/c 0.25. Cluster: n0, n1 of 8 GPUs, so C = 16
and lab/a covers g x k <= 0.5 x 16 = 8 GPUs. lab/c is far over its share,
so its expired runs are behind lab/a's jobs (K = 1e6 GPU-s: r_c = 9e5 / 2.5e5 = 3.6, r_a = 0, and 8 or 16 GPUs
for 1 h charge lab/a at most 57,600 / 5e5 = 0.12).
"""

from __future__ import annotations

import pytest

from apportion import events as ev
from apportion.domain.cluster import placed_run
from apportion.domain.engine.reservation import hero_sheltered, share_covers, untakable_nodes
from apportion.timeutil import from_us
from tests.kit.builders import h
from tests.kit.builders import placed as placed_event
from tests.unit.test_engine import World, placed, preempted

ALL = tuple(range(8))
BUSY = {"lab/c": 9e5, "lab": 9e5}  # of K = 1e6 GPU-s in the window


def _world(job_gpus: int, replicas: int, *, victims: str = "expired", queued: int | None = None) -> World:
    """n0 and n1 full with lab/c's runs x (n0) and y (n1): ``expired`` (allocated, 1 h minimum runtime, started
    at h(0), so past it at h(10)), ``protected`` (minimum runtime 1e6 s) or ``unallocated``; lab/a's job j."""
    w = World().node("n0", 8).node("n1", 8)
    alloc = victims != "unallocated"
    mr = 1e6 if victims == "protected" else 3600.0
    w.run("x", "lab/c", {"n0": ALL}, allocated=alloc, min_runtime_s=mr)
    w.run("y", "lab/c", {"n1": ALL}, allocated=alloc, min_runtime_s=mr)
    w.occupancy, w.capacity = dict(BUSY), 1e6
    return w.job("j", "lab/a", job_gpus, replicas, queued=queued)


CASES = [
    # (case id, g, k, victims, hero_min_gpus, expected preemptions, expected placements)
    (
        "covered (8 <= 8): takes an expired run behind it",
        8,
        1,
        "expired",
        1,
        ["x<-j"],
        ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]"],
    ),
    ("uncovered (16 > 8): takes no busy allocated run", 8, 2, "expired", 1, [], []),
    (
        "uncovered, the rule off: takes both",
        8,
        2,
        "expired",
        None,
        ["x<-j", "y<-j"],
        ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]+n1[0, 1, 2, 3, 4, 5, 6, 7]"],
    ),
    (
        "uncovered: unallocated work it still takes",
        8,
        2,
        "unallocated",
        1,
        ["x<-j", "y<-j"],
        ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]+n1[0, 1, 2, 3, 4, 5, 6, 7]"],
    ),
    (
        "uncovered but below hero_min_gpus (16 < 17): the ordinary rules",
        8,
        2,
        "expired",
        17,
        ["x<-j", "y<-j"],
        ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]+n1[0, 1, 2, 3, 4, 5, 6, 7]"],
    ),
    ("uncovered, at hero_min_gpus (16)", 8, 2, "expired", 16, [], []),
]


@pytest.mark.parametrize(
    ("g", "k", "victims", "least", "pre", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_preemption_by_cover(g: int, k: int, victims: str, least: int | None, pre: list[str], want: list[str]) -> None:
    res = _world(g, k, victims=victims).cycle(patience_s=0.0, hero_min_gpus=least)
    assert (preempted(res), placed(res)) == (pre, want)


@pytest.mark.parametrize(
    ("g", "k", "least", "want"), [(8, 2, 1, None), (8, 2, None, ("j", ("n0", "n1"))), (8, 1, 1, ("j", ("n0",)))]
)
def test_reservation_by_cover(g: int, k: int, least: int | None, want: tuple[str, tuple[str, ...]] | None) -> None:
    # x and y protected: no preemption; j waited 2 h (>= reservation_after): it reserves only when covered
    res = _world(g, k, victims="protected", queued=h(8)).cycle(hero_min_gpus=least)
    assert (res.reservation, placed(res)) == (want, [])


def test_share_covers_at_the_boundary() -> None:
    # 0.5 x 16 = 8: 8 GPUs covered, 9 not; the hero scenario's 8,192 GPUs on 10% of 16,384 (1,638.4) not
    assert [share_covers(n, 0.5, 16) for n in (8, 9)] == [True, False]
    assert (share_covers(8192, 0.10, 16384), share_covers(1024, 0.10, 16384)) == (False, True)


# D3.hero-cover, the victims' clause: a covered hero within its share is a victim only when no feasible set
# without one exists. Tree as above; cluster n0..n3 of 8 GPUs, so C = 32: lab/a covers 16 GPUs, lab/b 8.
# hero_min_gpus 8. K = 1e6 GPU-s; lab/c at 9e5 (r_c = 3.6); lab/b at 2e5 (r_b = 2e5 / 2.5e5 = 0.8, within
# its share) or 3e5 (r_b = 1.2, over it); lab/a at 0, and j's 8 or 16 GPUs for 1 h charge it at most
# 57,600 / 5e5 = 0.12 < 0.8 - delta: both lab/b and lab/c are behind lab/a by delta.
#
#   n0: hb  lab/b, 8 GPUs, started h(5): the covered hero (8 <= 0.25 x 32), 40 GPU-h lost at h(10)
#   n1: x   lab/c, 8 GPUs, started h(0), expired (80 GPU-h lost) or protected
#   n2: z   lab/c, 8 GPUs, started h(0), protected (minimum runtime 1e6 s)
#   n3: hb2 lab/b, 8 GPUs, started h(4): a second covered hero (48 GPU-h lost)
#
# Without the clause the least-cost victims are the heroes (fewest GPU-s lost: 40 < 48 < 80).
SHELTER_CASES = [
    # (case id, lab/b occupancy, x protected, hero_min_gpus, k of j (8 GPUs a replica), preempted, placed)
    ("hero avoided: x frees a node", 2e5, False, 8, 1, ["x<-j"], ["j@n1[0, 1, 2, 3, 4, 5, 6, 7]"]),
    ("hero taken: no set without one (x protected)", 2e5, True, 8, 1, ["hb<-j"], ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]"]),
    (
        "hero over its share (r_b 1.2): an ordinary victim",
        3e5,
        False,
        8,
        1,
        ["hb<-j"],
        ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]"],
    ),
    ("the clause off: the hero, least work lost", 2e5, False, None, 1, ["hb<-j"], ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]"]),
    ("hero below hero_min_gpus (8 < 9): ordinary", 2e5, False, 9, 1, ["hb<-j"], ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]"]),
    (
        "two nodes: x's node, then the cheapest hero",
        2e5,
        False,
        8,
        2,
        ["hb<-j", "x<-j"],
        ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]+n1[0, 1, 2, 3, 4, 5, 6, 7]"],
    ),
]


@pytest.mark.parametrize(
    ("occ_b", "x_protected", "least", "k", "pre", "want"),
    [c[1:] for c in SHELTER_CASES],
    ids=[c[0] for c in SHELTER_CASES],
)
def test_covered_hero_is_the_last_victim(
    occ_b: float, x_protected: bool, least: int | None, k: int, pre: list[str], want: list[str]
) -> None:
    w = World().node("n0", 8).node("n1", 8).node("n2", 8).node("n3", 8)
    w.run("hb", "lab/b", {"n0": ALL}, started=h(5))
    w.run("x", "lab/c", {"n1": ALL}, min_runtime_s=1e6 if x_protected else 3600.0)
    w.run("z", "lab/c", {"n2": ALL}, min_runtime_s=1e6)
    w.run("hb2", "lab/b", {"n3": ALL}, started=h(4))
    w.occupancy, w.capacity = {"lab/c": 9e5, "lab/b": occ_b, "lab": 9e5 + occ_b}, 1e6
    res = w.job("j", "lab/a", 8, k).cycle(patience_s=0.0, hero_min_gpus=least)
    assert (sorted(preempted(res)), placed(res)) == (pre, want)


def test_hero_sheltered_by_its_formula() -> None:
    # covered (g x k <= abs(b) x C), r <= 1, at least hero_min_gpus; the every-hero-covered run's hero-b
    assert [hero_sheltered(4096, 0.25, 16384, r, 1024) for r in (0.99, 1.0, 1.01)] == [True, True, False]
    assert (hero_sheltered(4097, 0.25, 16384, 0.5, 1024), hero_sheltered(1023, 0.25, 16384, 0.5, 1024)) == (
        False,
        False,
    )
    assert hero_sheltered(4096, 0.25, 16384, 0.5, None) is False


def test_the_rest_from_one_hero_gang_when_one_frees_enough() -> None:
    # C = 32 (n0..n2 of 8, n3 and n4 of 4): lab/a covers 16 GPUs, lab/b 8, hero_min_gpus 8; r as above
    # (lab/b 0.8, within its share).
    #   n0: hb  lab/b, 8 GPUs, started h(5): 40 GPU-h lost at h(10)
    #   n1: x, n2: z  lab/c, protected
    #   n3, n4: hg lab/b, a 2 x 4 gang, started h(4): 48 GPU-h lost
    # j: 2 x 4 GPUs. No node frees without a hero; hb's n0 is the cheapest (40 < 48 GPU-h) but frees one, so
    # least cost alone would preempt both gangs; hg alone frees n3 and n4.
    w = World().node("n0", 8).node("n1", 8).node("n2", 8).node("n3", 4).node("n4", 4)
    w.run("hb", "lab/b", {"n0": ALL}, started=h(5))
    w.run("x", "lab/c", {"n1": ALL}, min_runtime_s=1e6)
    w.run("z", "lab/c", {"n2": ALL}, min_runtime_s=1e6)
    w.run("hg", "lab/b", {"n3": (0, 1, 2, 3), "n4": (0, 1, 2, 3)}, started=h(4))
    w.cluster.apply(ev.JobStarted(job_id="hg", attempt=1, replica=1, node_id="n4", ts=from_us(h(4))))
    w.occupancy, w.capacity = {"lab/c": 9e5, "lab/b": 2e5, "lab": 1.1e6}, 1e6
    res = w.job("j", "lab/a", 4, 2).cycle(patience_s=0.0, hero_min_gpus=8)
    assert (preempted(res), placed(res)) == (["hg<-j"], ["j@n3[0, 1, 2, 3]+n4[0, 1, 2, 3]"])


# D3.hero-cover, the reservation clause (EngineConfig.hero_reserve_takable): a covered hero reserves only nodes
# whose allocated runs it may take back once their protection ends. C = 32 (n0..n3 of 8 GPUs): lab/a covers 16.
# K = 1e6 GPU-s; lab/c at 9e5 (r_c = 3.6), lab/b at 1e5 (r_b = 0.4), lab/a at 0: both behind lab/a by delta.
#
#   n0: mine  lab/a, 8 GPUs: j's own leaf, never taken back (no known time to fit)
#   n1: free, 8 GPUs
#   n2: x     lab/c, 8 GPUs, started h(0), minimum runtime 12 h: protected to h(12), then taken back
#   n3: z     lab/c, 8 GPUs, minimum runtime 1e6 s
#
# j: lab/a, 2 x 8 GPUs, queued at h(8) (waited 2 h >= reservation_after): no fit, no victim set, so it reserves.
# l: lab/b, 1 x 8 GPUs, minimum runtime 5 h (protected to h(15), past x's end at h(12)).
# Without the clause j reserves n1 (8 available) and n0 (the first of the full nodes by id); n0 has no known fit
# time, so the reservation lends everything and l lands on n1. With it n0 is left out: j reserves n1 and n2, its
# earliest fit is h(12), and l, protected past it, may not use n1.
RESERVE_CASES = [
    # (case id, hero_reserve_takable, hero_min_gpus, reservation, placed)
    (
        "clause off: n0 in the reservation, which lends n1 to l",
        False,
        16,
        ("j", ("n1", "n0")),
        ["l@n1[0, 1, 2, 3, 4, 5, 6, 7]"],
    ),
    ("clause on: n0 left out, n1 held for j", True, 16, ("j", ("n1", "n2")), []),
    (
        "clause on, j below hero_min_gpus (16 < 17): as off",
        True,
        17,
        ("j", ("n1", "n0")),
        ["l@n1[0, 1, 2, 3, 4, 5, 6, 7]"],
    ),
    ("clause on, at hero_min_gpus (16)", True, 16, ("j", ("n1", "n2")), []),
    ("clause on, D3.hero-cover off: as off", True, None, ("j", ("n1", "n0")), ["l@n1[0, 1, 2, 3, 4, 5, 6, 7]"]),
]


def _reserve_world() -> World:
    w = World().node("n0", 8).node("n1", 8).node("n2", 8).node("n3", 8)
    w.run("mine", "lab/a", {"n0": ALL})
    w.run("x", "lab/c", {"n2": ALL}, min_runtime_s=12 * 3600.0)
    w.run("z", "lab/c", {"n3": ALL}, min_runtime_s=1e6)
    w.occupancy, w.capacity = {"lab/c": 9e5, "lab/b": 1e5, "lab": 1e6}, 1e6
    return w.job("j", "lab/a", 8, 2, queued=h(8)).job("l", "lab/b", 8, 1, min_runtime_s=5 * 3600.0)


@pytest.mark.parametrize(
    ("on", "least", "want", "got"), [c[1:] for c in RESERVE_CASES], ids=[c[0] for c in RESERVE_CASES]
)
def test_hero_reserves_only_nodes_it_may_take_back(
    on: bool, least: int | None, want: tuple[str, tuple[str, ...]], got: list[str]
) -> None:
    res = _reserve_world().cycle(patience_s=0.0, hero_min_gpus=least, hero_reserve_takable=on)
    assert (res.reservation, placed(res)) == (want, got)


def test_untakable_nodes_by_run() -> None:
    # may_take: every run but lab/a's (j's own leaf). Left out: n0 (lab/a's run), n4 (protected until it completes,
    # 2e10 s >= PROTECTION_UNTIL_DONE_S), n5 (a run placed earlier in the cycle, of lab/a); kept: n1 (x, taken back
    # at its end), n2 (unallocated), n3 (lab/a's run, but stopping), n6 (lab/a's run, taken in this cycle).
    w = World().node("n0").node("n1").node("n2").node("n3").node("n4").node("n5").node("n6")
    w.run("mine", "lab/a", {"n0": ALL})
    w.run("x", "lab/c", {"n1": ALL}, min_runtime_s=12 * 3600.0)
    w.run("u", "lab/a", {"n2": ALL}, allocated=False)
    w.run("s", "lab/a", {"n3": ALL}, stopping=True)
    w.run("d", "lab/c", {"n4": ALL}, min_runtime_s=2e10)
    w.run("t", "lab/a", {"n6": ALL})
    snap = w.cluster.snapshot()
    later = placed_run(placed_event("p", gpus=8, nodes=["n5"], at=h(10)))
    got = untakable_nodes(snap, h(10), {("t", 1)}, lambda run, _at: run.budget != "lab/a", [later])
    assert got == {"n0", "n4", "n5"}


@pytest.mark.parametrize(
    ("on", "want", "got"), [(False, ("n1", "n0"), ["l@n1[0, 1, 2, 3, 4, 5, 6, 7]"]), (True, ("n1", "n2"), [])]
)
def test_hero_reservation_leaves_out_a_sibling_hero_not_behind(on: bool, want: tuple[str, ...], got: list[str]) -> None:
    # As above, n0 held by hc, a run of lab/b at r_b = 0 (no window usage): not behind lab/a by delta, so j may not
    # take it back (the overloaded lab's running sibling hero). l: lab/c (r_c = 3.6), 8 GPUs, protected to h(15).
    w = World().node("n0", 8).node("n1", 8).node("n2", 8).node("n3", 8)
    w.run("hc", "lab/b", {"n0": ALL})
    w.run("x", "lab/c", {"n2": ALL}, min_runtime_s=12 * 3600.0)
    w.run("z", "lab/c", {"n3": ALL}, min_runtime_s=1e6)
    w.occupancy, w.capacity = {"lab/c": 9e5, "lab": 9e5}, 1e6
    w.job("j", "lab/a", 8, 2, queued=h(8)).job("l", "lab/c", 8, 1, min_runtime_s=5 * 3600.0)
    res = w.cycle(patience_s=0.0, hero_min_gpus=16, hero_reserve_takable=on)
    assert (res.reservation, placed(res)) == (("j", want), got)
