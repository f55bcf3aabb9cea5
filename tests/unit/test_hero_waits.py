"""Rule ``D3.hero-waits`` (``EngineConfig.hero_waits``): a covered hero never preempts another covered hero within
its share; it waits, and from its first blocked cycle reserves the nodes that fit it soonest, a covered hero's
nodes left out, where backfill must end (or be preemptible) before it can start.

Tree (``tests.unit.test_engine``): lab/a 0.5, lab/b 0.25, lab/c 0.25. Cluster n0..n3 of 8 GPUs, so C = 32: lab/a
covers 16 GPUs, lab/b 8; hero_min_gpus 8. K = 1e6 GPU-s; lab/c at 9e5 (r_c = 3.6); lab/b at 2e5 (r_b = 0.8, within
its share) or 3e5 (r_b = 1.2, over it); lab/a at 0, and j's 8 or 16 GPUs for 1 h charge it at most
57,600 / 5e5 = 0.12 < 0.8 - delta: lab/b and lab/c are behind lab/a by delta. The cycle runs at h(10); j is queued
then (it has waited 0 s, under ``reservation_after``).

  n0: hb  lab/b, 8 GPUs, started h(5), 1 h minimum runtime (expired): the covered hero (8 <= 0.25 x 32)
  n1: x   lab/c, 8 GPUs, started h(0): expired (1 h), or protected to h(12) (12 h)
  n2: z   lab/c, 8 GPUs, started h(0), protected to h(0) + 1e6 s (h(277.8)), or nothing (free)
  n3: hb2 lab/b, 8 GPUs, started h(4), expired: a second covered hero
"""

from __future__ import annotations

import dataclasses

import pytest

from apportion.domain.cluster import UNTIL_STARTED
from apportion.domain.engine.placement import CycleFree
from apportion.domain.engine.reservation import node_fit_us, soonest_nodes
from tests.kit.builders import h
from tests.unit.test_engine import World, placed, preempted

ALL = tuple(range(8))
N0, N1 = "j@n0[0, 1, 2, 3, 4, 5, 6, 7]", "j@n1[0, 1, 2, 3, 4, 5, 6, 7]"


def _world(occ_b: float, x_h: float, z: bool = True) -> World:
    w = World().node("n0", 8).node("n1", 8).node("n2", 8).node("n3", 8)
    w.run("hb", "lab/b", {"n0": ALL}, started=h(5))
    w.run("x", "lab/c", {"n1": ALL}, min_runtime_s=x_h * 3600.0)
    if z:
        w.run("z", "lab/c", {"n2": ALL}, min_runtime_s=1e6)
    w.run("hb2", "lab/b", {"n3": ALL}, started=h(4))
    w.occupancy, w.capacity = {"lab/c": 9e5, "lab/b": occ_b, "lab": 9e5 + occ_b}, 1e6
    return w


CASES = [
    # (case id, hero_waits, lab/b occupancy, x's minimum runtime h, hero_min_gpus, k, preempted, placed, reservation)
    ("off: no set without a hero, hb taken (40 GPU-h lost < hb2's 48)", False, 2e5, 12, 8, 1, ["hb<-j"], [N0], None),
    ("on: waits, reserves n1 (x's end, h(12)), not n0 (hb)", True, 2e5, 12, 8, 1, [], [], ("j", ("n1",))),
    ("on, two nodes: n1 (h(12)) and n2 (h(277.8))", True, 2e5, 12, 8, 2, [], [], ("j", ("n1", "n2"))),
    ("on, x expired: x taken, as off", True, 2e5, 1, 8, 1, ["x<-j"], [N1], None),
    ("on, hb over its share (r_b 1.2): hb an ordinary victim", True, 3e5, 12, 8, 1, ["hb<-j"], [N0], None),
    ("on, j below hero_min_gpus (8 < 9): as off", True, 2e5, 12, 9, 1, ["hb<-j"], [N0], None),
    ("on, D3.hero-cover off: as off", True, 2e5, 12, None, 1, ["hb<-j"], [N0], None),
]


@pytest.mark.parametrize(
    ("on", "occ_b", "x_h", "least", "k", "pre", "want", "res_"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_covered_hero_waits_for_the_soonest_nodes(
    on: bool,
    occ_b: float,
    x_h: float,
    least: int | None,
    k: int,
    pre: list[str],
    want: list[str],
    res_: tuple[str, tuple[str, ...]] | None,
) -> None:
    res = _world(occ_b, x_h).job("j", "lab/a", 8, k).cycle(patience_s=0.0, hero_min_gpus=least, hero_waits=on)
    assert (sorted(preempted(res)), placed(res), res.reservation) == (pre, want, res_)


# Backfill on the reservation: n2 free, so j (2 x 8) is blocked on n1 (x protected to h(12)) and reserves n2 and n1,
# its fit at h(12). l (lab/c, 8 GPUs) may use n2 only if its protection ends by then: a 1 h minimum runtime (h(11))
# may, a 5 h one (h(15)) may not. Unallocated work u may, preempted the moment j can start.
BACKFILL = [
    # (case id, l's minimum runtime h (0: unallocated), placed)
    ("l's protection ends h(11) <= h(12): backfills n2", 1.0, ["l@n2[0, 1, 2, 3, 4, 5, 6, 7]"]),
    ("l's protection ends h(15) > h(12): waits", 5.0, []),
    ("unallocated: backfills n2", 0.0, ["l@n2[0, 1, 2, 3, 4, 5, 6, 7]"]),
]


@pytest.mark.parametrize(("mr_h", "want"), [c[1:] for c in BACKFILL], ids=[c[0] for c in BACKFILL])
def test_backfill_on_the_waiting_hero_ends_before_it_starts(mr_h: float, want: list[str]) -> None:
    w = _world(2e5, 12, z=False).job("j", "lab/a", 8, 2)
    w.job("l", "lab/c", 8, 1, min_runtime_s=mr_h * 3600.0)
    res = w.cycle(patience_s=0.0, hero_min_gpus=8, hero_waits=True)
    assert (res.reservation, placed(res)) == (("j", ("n2", "n1")), want)


def test_node_fit_and_soonest_nodes_on_labels() -> None:
    # four nodes of 8 GPUs at h(10): x on n1 protected to h(12), y on n2 to h(11), n0 and n3 free. Blocks b0 (rack r0:
    # n0, n1) and b1 (rack r1: n2, n3). Two nodes: n0 and n3 fit now (two blocks, the earliest time); bound "rack":
    # r1 (n3 now, n2 at h(11)) fits before r0 (n0 now, n1 at h(12)); a holder that may take nothing back: n0 and n3,
    # and no three.
    w = World().node("n0", 8).node("n1", 8).node("n2", 8).node("n3", 8)
    w.run("x", "lab/c", {"n1": ALL}, min_runtime_s=12 * 3600.0)
    w.run("y", "lab/c", {"n2": ALL}, min_runtime_s=11 * 3600.0)
    snap = w.cluster.snapshot()
    fits = [node_fit_us(snap, n, 8, h(10), set(), None) for n in ("n0", "n1", "n2", "n3")]
    assert fits == [h(10), h(12), h(11), h(10)]
    assert node_fit_us(snap, "n1", 8, h(10), set(), lambda run, at: False) == UNTIL_STARTED
    assert node_fit_us(snap, "n1", 8, h(10), {("x", 1)}, None) == h(10)  # x preempted in this cycle: now
    assert node_fit_us(snap, "n1", 4, h(10), set(), None) == h(12)  # 4 GPUs: x's 8 still
    where = {"n0": ("b0", "r0"), "n1": ("b0", "r0"), "n2": ("b1", "r1"), "n3": ("b1", "r1")}
    nodes = {n: dataclasses.replace(node, block=where[n][0], rack=where[n][1]) for n, node in snap.nodes.items()}
    snap = dataclasses.replace(snap, nodes=nodes)
    free = CycleFree(snap)
    every = lambda run, at: True  # noqa: E731
    none = lambda run, at: False  # noqa: E731
    assert soonest_nodes(snap, free, 8, 2, None, h(10), set(), every) == ["n0", "n3"]
    assert soonest_nodes(snap, free, 8, 2, None, h(10), set(), every, bound="rack") == ["n3", "n2"]
    # three: n0, n3 and n2 (by h(11), before n1's h(12)), block b1 first (it holds two of them)
    assert soonest_nodes(snap, free, 8, 3, None, h(10), set(), every) == ["n3", "n2", "n0"]
    assert soonest_nodes(snap, free, 8, 3, None, h(10), set(), none) == []
    assert soonest_nodes(snap, free, 8, 2, None, h(10), set(), none) == ["n0", "n3"]
    assert soonest_nodes(snap, free, 8, 2, None, h(10), set(), none, bound="rack") == []
