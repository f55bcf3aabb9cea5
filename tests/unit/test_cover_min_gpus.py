"""``EngineConfig.cover_min_gpus``: rule ``D3.hero-cover``'s reservation and preemption clause from a smaller size
than ``hero_min_gpus``, its victims' clause unchanged (a measured lever, off by default).

World of ``tests.unit.test_hero_cover``: lab/a 0.5, lab/b 0.25, lab/c 0.25 on n0, n1 of 8 GPUs (C = 16, so lab/a
covers g x k <= 0.5 x 16 = 8 GPUs); lab/c's runs x (n0) and y (n1) fill both nodes and are behind lab/a
(r_c = 3.6, r_a <= 0.12 with j's charge); lab/a's job j asks for 8 x 2 = 16 GPUs, which its share does not cover.
``hero_min_gpus`` keeps its default (1,024) unless a case says otherwise.
"""

from __future__ import annotations

import pytest

from apportion.domain.engine import EngineConfig
from tests.kit.builders import h
from tests.unit.test_engine import World, placed, preempted
from tests.unit.test_hero_cover import ALL, _world

BOTH = ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]+n1[0, 1, 2, 3, 4, 5, 6, 7]"]

CASES = [
    # (case id, cover_min_gpus, hero_min_gpus, victims, expected preemptions, expected placements)
    ("off (None): the ordinary rules take both expired runs", None, 1024, "expired", ["x<-j", "y<-j"], BOTH),
    ("at the job's size (16): uncovered, takes no busy allocated run", 16, 1024, "expired", [], []),
    ("below it (9): uncovered as well", 9, 1024, "expired", [], []),
    ("above the job's size (17): the ordinary rules", 17, 1024, "expired", ["x<-j", "y<-j"], BOTH),
    ("uncovered: unallocated work it still takes", 16, 1024, "unallocated", ["x<-j", "y<-j"], BOTH),
    ("hero_min_gpus off: cover_min_gpus alone decides", 16, None, "expired", [], []),
    ("hero_min_gpus lower (16) than cover_min_gpus (17): the lower applies", 17, 16, "expired", [], []),
]


@pytest.mark.parametrize(("wide", "least", "victims", "pre", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_preemption_by_cover_min_gpus(
    wide: int | None, least: int | None, victims: str, pre: list[str], want: list[str]
) -> None:
    res = _world(8, 2, victims=victims).cycle(patience_s=0.0, hero_min_gpus=least, cover_min_gpus=wide)
    assert (preempted(res), placed(res)) == (pre, want)


@pytest.mark.parametrize(
    ("g", "k", "wide", "want"),
    [(8, 2, None, ("j", ("n0", "n1"))), (8, 2, 16, None), (8, 2, 17, ("j", ("n0", "n1"))), (8, 1, 8, ("j", ("n0",)))],
    ids=["off: 16 GPUs reserve", "16 uncovered: no reservation", "below 17: reserve", "8 covered (8 <= 8): reserve"],
)
def test_reservation_by_cover_min_gpus(
    g: int, k: int, wide: int | None, want: tuple[str, tuple[str, ...]] | None
) -> None:
    # x and y protected: no preemption; j waited 2 h (>= reservation_after): it reserves only when covered
    res = _world(g, k, victims="protected", queued=h(8)).cycle(cover_min_gpus=wide)
    assert (res.reservation, placed(res)) == (want, [])


def test_victims_clause_keeps_hero_min_gpus() -> None:
    # The victims' clause stays with hero_min_gpus (here None: off). C = 32 (n0..n3 of 8): lab/a covers 16 GPUs,
    # lab/b 8; r_b = 2e5 / 2.5e5 = 0.8 (within its share), r_c = 3.6, both behind lab/a (r_a <= 0.12) by delta.
    #   n0: hb  lab/b, 8 GPUs, started h(5): covered (8 <= 0.25 x 32), 40 GPU-h lost at h(10)
    #   n1: x   lab/c, 8 GPUs, started h(0), expired: 80 GPU-h lost
    #   n2: z   lab/c, protected;  n3: hb2 lab/b, started h(4): 48 GPU-h lost
    # j (8 GPUs, covered) takes the least work lost, hb, as with both clauses off: cover_min_gpus 1 shelters nothing.
    w = World().node("n0", 8).node("n1", 8).node("n2", 8).node("n3", 8)
    w.run("hb", "lab/b", {"n0": ALL}, started=h(5))
    w.run("x", "lab/c", {"n1": ALL}, min_runtime_s=3600.0)
    w.run("z", "lab/c", {"n2": ALL}, min_runtime_s=1e6)
    w.run("hb2", "lab/b", {"n3": ALL}, started=h(4))
    w.occupancy, w.capacity = {"lab/c": 9e5, "lab/b": 2e5, "lab": 1.1e6}, 1e6
    res = w.job("j", "lab/a", 8, 1).cycle(patience_s=0.0, hero_min_gpus=None, cover_min_gpus=1)
    assert (preempted(res), placed(res)) == (["hb<-j"], ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]"])


def test_default_is_off() -> None:
    assert EngineConfig().cover_min_gpus is None
