"""``EngineConfig.age_first_s``: aged allocated work first, an age term (a measured lever, off by default).

World of ``tests.kit.engine_world`` (lab/a 0.5, lab/b 0.25, lab/c 0.25) with K = 1,000 GPU-s: r_a = 0 (first in
the fair-share order), r_b = 200 / 250 = 0.8, r_c = 900 / 250 = 3.6 (last). One node n0 of 1 GPU. ``fresh`` is
lab/a's job queued at NOW (waited 0); ``old`` lab/c's, ``mid`` lab/b's, queued ``waited`` before NOW. The bound
is 4 h (14,400 s): a job of one node that has waited at least that long is aged (a gang across nodes too with
``age_first_gangs``).
"""

from __future__ import annotations

import pytest

from apportion.domain.engine import EngineConfig
from tests.kit.builders import h
from tests.kit.engine_world import NOW, World, placed, preempted

BOUND_S = 4 * 3600.0
HOUR = h(1) - h(0)  # µs


def _world(waited_us: int, *, old_gpus: int = 1, with_mid: bool = False, held_by_free: bool = False) -> World:
    w = World().node("n0", 1)
    if held_by_free:  # lab/a's unallocated run holds the only GPU: a victim for any allocated job (D3.victims 1)
        w.run("u", "lab/a", {"n0": (0,)}, allocated=False, started=h(9))
    w.occupancy, w.capacity = {"lab/a": 0.0, "lab/b": 200.0, "lab/c": 900.0, "lab": 1100.0}, 1000.0
    w.job("fresh", "lab/a", 1, submitted=NOW, queued=NOW)
    w.job("old", "lab/c", old_gpus, submitted=h(0), queued=NOW - waited_us)
    if with_mid:
        w.job("mid", "lab/b", 1, submitted=h(0), queued=NOW - waited_us)
    return w


CASES = [
    # (case id, age_first_s, waited (µs), world options, expected preemptions, expected placements)
    ("off (None): the fair-share order, lab/a first", None, 9 * HOUR, {}, [], ["fresh@n0[0]"]),
    ("waited the bound exactly: aged, ahead of lab/a", BOUND_S, 4 * HOUR, {}, [], ["old@n0[0]"]),
    ("waited 1 µs less than the bound: not aged", BOUND_S, 4 * HOUR - 1, {}, [], ["fresh@n0[0]"]),
    ("aged, fits nowhere (2 GPUs): keeps its place", BOUND_S, 9 * HOUR, {"old_gpus": 2}, [], ["fresh@n0[0]"]),
    ("two aged: fair-share order (r_b < r_c)", BOUND_S, 9 * HOUR, {"with_mid": True}, [], ["mid@n0[0]"]),
    ("aged: takes free work by the usual rules", BOUND_S, 9 * HOUR, {"held_by_free": True}, ["u<-old"], ["old@n0[0]"]),
    ("off: lab/a's job takes the free work", None, 9 * HOUR, {"held_by_free": True}, ["u<-fresh"], ["fresh@n0[0]"]),
]


@pytest.mark.parametrize(("age", "waited", "opts", "pre", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_age_first(
    age: float | None, waited: int, opts: dict[str, bool | int], pre: list[str], want: list[str]
) -> None:
    res = _world(waited, **opts).cycle(age_first_s=age)  # type: ignore[arg-type]
    assert (preempted(res), placed(res)) == (pre, want)


@pytest.mark.parametrize("age", [None, BOUND_S], ids=["off", "on"])
def test_aged_job_reserves_only_at_its_rank_in_the_walk(age: float | None) -> None:
    # n1 (2 GPUs) is held by lab/b's protected run p: lab/c's aged 2-GPU job fits nowhere and may not take p. Ahead
    # of the walk it reserves nothing; in the walk lab/a's job is placed on n0 and lab/c's (waited 9 h >= the 1 h
    # of reservation_after) is the highest-ranked blocked job: it reserves n1, as with the option off.
    w = _world(9 * HOUR, old_gpus=2).node("n1", 2)
    w.run("p", "lab/b", {"n1": (0, 1)}, min_runtime_s=1e6, started=h(9))
    res = w.cycle(age_first_s=age)
    assert (preempted(res), placed(res), res.reservation) == ([], ["fresh@n0[0]"], ("old", ("n1",)))


@pytest.mark.parametrize(
    ("gangs", "want"),
    [(False, ["fresh@n0[0]"]), (True, ["old@n0[0]+n1[0]"])],
    ids=["a gang keeps its place in the walk", "age_first_gangs: the gang is aged too"],
)
def test_age_first_gangs(gangs: bool, want: list[str]) -> None:
    # n0 and n1 of 1 GPU each: lab/c's aged gang of 1 x 2 takes both ahead of lab/a only when gangs are aged; else
    # lab/a's job is placed first (best fit, n0) and the gang then fits nowhere.
    w = _world(9 * HOUR).node("n1", 1)
    w.pending["lab/c"] = []
    w.job("old", "lab/c", 1, 2, submitted=h(0), queued=NOW - 9 * HOUR)
    res = w.cycle(age_first_s=BOUND_S, age_first_gangs=gangs)
    assert (preempted(res), placed(res)) == ([], want)


def test_default_is_off() -> None:
    assert (EngineConfig().age_first_s, EngineConfig().age_first_gangs) == (None, False)
