"""Occupancy windows O_b(t), U_b(t) and the capacity integral K(t) (rule D2.occupancy).

A table of named cases with hand-computed values, then hypothesis
properties: the incremental fold, the bulk rebuild and a brute-force
interval model agree exactly (GPU-µs), and rebuild(prefix) + apply(rest)
equals rebuild(all).

Most cases use a 10-hour window (W = 36,000 s) so edges are easy to read.
1 GPU-hour = 3,600 GPU-seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apportion import events as ev
from apportion.domain.occupancy import OccupancyLedger, rebuild
from apportion.timeutil import US_PER_S, s_to_us, to_us
from tests.kit.builders import (
    T0,
    cancelled,
    completed,
    cordoned,
    drain,
    drained,
    failed,
    h,
    job_lost,
    node,
    node_lost,
    placed,
    preempted,
    requeued,
    s,
    started,
    uncordoned,
)
from tests.kit.occupancy_logs import PROP_W, event_logs

W10H = 10 * 3600
GPU_H = 3600.0  # GPU-seconds in one GPU-hour


@dataclass
class Case:
    id: str
    events: list
    t: int
    occupancy: dict[str, float] = field(default_factory=dict)
    unallocated: dict[str, float] = field(default_factory=dict)
    capacity_gpu_s: float | None = None
    capacity_gpus: int | None = None
    paths: tuple[str, ...] | None = None
    window_s: float = W10H


CASES = [
    Case(
        "job still running at t counts up to t",
        [placed("j1", budget="lab/a", gpus=2, at=h(1))],
        t=h(4),
        # 2 GPUs x (4h - 1h) = 6 GPU-h
        occupancy={"lab/a": 6 * GPU_H, "lab": 6 * GPU_H},
        paths=("lab", "lab/a"),
    ),
    Case(
        "completed job inside the window",
        [placed("j1", gpus=4, at=h(1)), completed("j1", at=h(3))],
        t=h(5),
        # 4 GPUs x 2h = 8 GPU-h
        occupancy={"lab/a": 8 * GPU_H},
    ),
    Case(
        "job spanning the window edge counts only its part inside",
        [placed("j1", gpus=1, at=h(0)), completed("j1", at=h(12))],
        t=h(15),
        # window (5h, 15h]; run [0h, 12h) overlaps [5h, 12h) = 7h x 1 GPU
        occupancy={"lab/a": 7 * GPU_H},
    ),
    Case(
        "job that ended before the window counts zero",
        [placed("j1", gpus=3, at=h(0)), completed("j1", at=h(2))],
        t=h(13),
        # window (3h, 13h], run ended at 2h
        occupancy={"lab/a": 0.0, "lab": 0.0},
    ),
    Case(
        "running job longer than the window counts exactly W",
        [placed("j1", gpus=3, at=h(0))],
        t=h(25),
        # 3 GPUs x W = 3 x 10h = 30 GPU-h
        occupancy={"lab/a": 30 * GPU_H},
    ),
    Case(
        "several budgets and levels aggregate to every ancestor",
        #   lab
        #   ├── prior
        #   │   ├── robotics   j1: 2 GPUs [0h, 2h)         = 4 GPU-h
        #   │   └── nlp        j2: 1 GPU  [1h, running@4h) = 3 GPU-h
        #   └── vision         j3: 4 GPUs [2h, 3h)         = 4 GPU-h
        #   other              j4: 1 GPU  [0h, 1h)         = 1 GPU-h
        [
            placed("j1", budget="lab/prior/robotics", gpus=2, at=h(0)),
            placed("j4", budget="other", gpus=1, at=h(0)),
            placed("j2", budget="lab/prior/nlp", gpus=1, at=h(1)),
            completed("j4", at=h(1)),
            completed("j1", at=h(2)),
            placed("j3", budget="lab/vision", gpus=4, at=h(2)),
            completed("j3", at=h(3)),
        ],
        t=h(4),
        occupancy={
            "lab/prior/robotics": 4 * GPU_H,
            "lab/prior/nlp": 3 * GPU_H,
            "lab/prior": 7 * GPU_H,  # 4 + 3
            "lab/vision": 4 * GPU_H,
            "lab": 11 * GPU_H,  # 7 + 4
            "other": 1 * GPU_H,
        },
        paths=("lab", "lab/prior", "lab/prior/nlp", "lab/prior/robotics", "lab/vision", "other"),
    ),
    Case(
        "unallocated runs are tracked separately and never charged",
        [
            placed("j1", budget="lab/a", gpus=2, at=h(0)),
            placed("j2", budget="lab/a", gpus=4, allocated=False, at=h(0)),
            placed("j3", budget="lab/b", gpus=1, allocated=False, at=h(0)),
            completed("j1", at=h(1)),
            completed("j2", at=h(2)),
            completed("j3", at=h(3)),
        ],
        t=h(3),
        # allocated: j1 2 GPUs x 1h = 2 GPU-h; unallocated: j2 4 x 2h = 8, j3 1 x 3h = 3
        occupancy={"lab/a": 2 * GPU_H, "lab/b": 0.0, "lab": 2 * GPU_H},
        unallocated={"lab/a": 8 * GPU_H, "lab/b": 3 * GPU_H, "lab": 11 * GPU_H},
    ),
    Case(
        "gang replica ending early releases only its GPUs",
        [
            placed("j1", gpus=2, replicas=3, at=h(0)),
            completed("j1", replica=1, at=h(1)),
            failed("j1", replica=None, at=h(2)),
        ],
        t=h(3),
        # 3 replicas x 2 GPUs on [0h, 1h) = 6 GPU-h; 2 replicas x 2 on [1h, 2h) = 4 GPU-h
        occupancy={"lab/a": 10 * GPU_H},
    ),
    Case(
        "replica ended twice or out of range is ignored",
        [
            placed("j1", gpus=1, replicas=2, at=h(0)),
            completed("j1", replica=0, at=h(1)),
            completed("j1", replica=0, at=h(1.5), event_id=ev.det_id("other")),
            completed("j1", replica=7, at=h(1.5)),
        ],
        t=h(2),
        # replica 0: [0h, 1h) = 1; replica 1: [0h, 2h) running = 2  -> 3 GPU-h
        occupancy={"lab/a": 3 * GPU_H},
    ),
    Case(
        "preempted run ends at the preemption; requeue is not an end",
        [
            placed("j1", gpus=2, at=h(0)),
            preempted("j1", at=h(1.5)),
            requeued("j1", attempt=2, at=h(1.5)),
            placed("j1", attempt=2, gpus=2, at=h(3)),
            started("j1", attempt=2, at=h(3)),
        ],
        t=h(4),
        # attempt 1: 2 x 1.5h = 3 GPU-h; attempt 2: 2 x 1h = 2 GPU-h
        occupancy={"lab/a": 5 * GPU_H},
    ),
    Case(
        "cancel of a running attempt ends it; cancel while pending does nothing",
        [placed("j1", gpus=1, at=h(0)), cancelled("j1", attempt=None, at=h(0.5)), cancelled("j1", attempt=1, at=h(1))],
        t=h(2),
        occupancy={"lab/a": 1 * GPU_H},
    ),
    Case(
        "duplicate events are ignored",
        [
            placed("j1", gpus=1, at=h(0)),
            placed("j1", gpus=1, at=h(0)),  # same event_id, redelivered
            completed("j1", at=h(2)),
            completed("j1", at=h(2)),
            placed("j1", gpus=1, at=h(0)),
        ],  # redelivered after the run ended
        t=h(4),
        # one run of 1 GPU on [0h, 2h)
        occupancy={"lab/a": 2 * GPU_H},
    ),
    Case(
        "end of an unknown run is ignored",
        [placed("j1", gpus=1, at=h(0)), completed("ghost", at=h(1)), preempted("j1", attempt=9, at=h(1))],
        t=h(2),
        occupancy={"lab/a": 2 * GPU_H},
    ),
    Case(
        "node lost: run and capacity charged up to the last heartbeat",
        [
            node("n0", 8, at=h(0)),
            placed("j1", gpus=8, nodes=["n0"], at=h(0)),
            node_lost("n0", last_heartbeat=h(1.5), at=h(2)),
            job_lost("j1", charged_until=h(1.5), node="n0", at=h(2)),
        ],
        t=h(3),
        # run: 8 GPUs x 1.5h = 12 GPU-h; capacity: 8 GPUs x 1.5h = 12 GPU-h
        occupancy={"lab/a": 12 * GPU_H},
        capacity_gpu_s=12 * GPU_H,
        capacity_gpus=0,
    ),
    Case(
        "lost run charged before its start is charged nothing",
        [placed("j1", gpus=2, at=h(2)), job_lost("j1", charged_until=h(1), at=h(3))],
        t=h(3),
        occupancy={"lab/a": 0.0},
    ),
    Case(
        "capacity integral with cordon, drain, drained, uncordon and loss",
        # C(t): [0,2) n1+n2 = 12; [2,3) n1 cordoned -> 4; [3,5) 12 (n2 draining counts);
        #       [5,6.5) n2 drained -> 8; [6.5,8) n1 lost at its last heartbeat -> 0
        [
            node("n1", 8, at=h(0)),
            node("n2", 4, at=h(0)),
            cordoned("n1", at=h(2)),
            uncordoned("n1", at=h(3)),
            drain("n2", at=h(4)),
            drained("n2", at=h(5)),
            node_lost("n1", last_heartbeat=h(6.5), at=h(7)),
        ],
        t=h(8),
        # K = 12x2 + 4x1 + 12x2 + 8x1.5 + 0 = 24 + 4 + 24 + 12 = 64 GPU-h
        capacity_gpu_s=64 * GPU_H,
        capacity_gpus=0,
    ),
    Case(
        "re-registering a node changes its GPU count; events of unknown nodes ignored",
        [node("n1", 8, at=h(0)), node("n1", 4, at=h(1)), cordoned("ghost", at=h(1))],
        t=h(2),
        # 8 GPUs x 1h + 4 GPUs x 1h = 12 GPU-h
        capacity_gpu_s=12 * GPU_H,
        capacity_gpus=4,
    ),
    Case(
        "window rollover: old runs leave the window, capacity too",
        [
            node("n1", 4, at=h(0)),
            placed("j1", gpus=1, at=h(0)),
            completed("j1", at=h(1)),
            placed("j2", gpus=2, at=h(20)),
        ],
        t=h(25),
        # window (15h, 25h]: j1 gone; j2 2 GPUs x 5h = 10 GPU-h; capacity 4 x 10h = 40 GPU-h
        occupancy={"lab/a": 10 * GPU_H},
        capacity_gpu_s=40 * GPU_H,
        capacity_gpus=4,
    ),
    Case(
        "a late event of another run takes effect at its own time",
        [placed("j1", gpus=1, at=h(2)), placed("j2", gpus=1, at=h(1))],
        t=h(3),
        # j2 from 1h, folded after j1 (2h): 1 x 1h + 1 x 2h = 3 GPU-h, as in time order
        occupancy={"lab/a": 3 * GPU_H},
    ),
    Case(
        "a late end of another run is charged up to its own time",
        [
            placed("j1", gpus=2, at=h(0)),
            placed("j2", gpus=1, at=h(0)),
            completed("j2", at=h(3)),
            completed("j1", at=h(1)),
        ],
        t=h(4),
        # j1 ends at 1h though folded after j2's end at 3h: 2 x 1h + 1 x 3h = 5 GPU-h
        occupancy={"lab/a": 5 * GPU_H},
    ),
    Case(
        "an end stamped before its run's start (another writer's clock) ends it at the start",
        [placed("j1", gpus=1, at=h(2)), completed("j1", at=h(1))],
        t=h(3),
        occupancy={"lab/a": 0.0},
    ),
    Case(
        "a node's change stamped before its latest one takes effect at the latest",
        [node("n0", 4, at=h(1)), cordoned("n0", at=h(0))],
        t=h(3),
        # registered at 1h, cordoned 'at 0h' by a clock behind the agent's: counted for 0 s
        capacity_gpu_s=0.0,
        capacity_gpus=0,
    ),
    Case(
        "duplicate placement exactly W after its run ended is still ignored",
        # the run ended at 1h; the same (job, attempt) placed again at 11h = end + W: remembered, ignored
        [placed("j1", gpus=1, at=h(0)), completed("j1", at=h(1)), placed("j1", gpus=1, at=h(11))],
        t=h(12),
        occupancy={"lab/a": 0.0},
    ),
    Case(
        "placement of a run that ended more than W ago is a new run",
        # ended at 1h, placed again at 11.5h > end + W: 1 GPU x (12h - 11.5h) = 0.5 GPU-h
        [placed("j1", gpus=1, at=h(0)), completed("j1", at=h(1)), placed("j1", gpus=1, at=h(11.5))],
        t=h(12),
        occupancy={"lab/a": 0.5 * GPU_H},
    ),
    Case(
        "node event redelivered exactly W after it was applied is still ignored",
        # the cordon of 1h comes again at 11h with the same event id: ignored, the node stays ready
        [
            node("n1", 8, at=h(0)),
            cordoned("n1", at=h(1), event_id=ev.det_id("cordon-once")),
            uncordoned("n1", at=h(2)),
            cordoned("n1", at=h(11), event_id=ev.det_id("cordon-once")),
        ],
        t=h(12),
        # window (2h, 12h]: 8 GPUs ready throughout = 80 GPU-h
        capacity_gpu_s=80 * GPU_H,
        capacity_gpus=8,
    ),
    Case(
        "replica index equal to the replica count is out of range and ignored",
        [placed("j1", gpus=1, replicas=2, at=h(0)), completed("j1", replica=2, at=h(1))],
        t=h(2),
        # both replicas run on: 2 x 1 GPU x 2h = 4 GPU-h
        occupancy={"lab/a": 4 * GPU_H},
    ),
    Case(
        "lost node's capacity ends no earlier than its last registration",
        # registered 0h, lost at 2h (heartbeat 1h); registered again at 3h, lost at 5h with a heartbeat of 2.5h
        # (older than the registration): the second stint ends at 3h, so it adds nothing
        [
            node("n1", 8, at=h(0)),
            node_lost("n1", last_heartbeat=h(1), at=h(2)),
            node("n1", 8, at=h(3)),
            node_lost("n1", last_heartbeat=h(2.5), at=h(5)),
        ],
        t=h(6),
        # 8 GPUs x [0h, 1h) = 8 GPU-h
        capacity_gpu_s=8 * GPU_H,
        capacity_gpus=0,
    ),
    Case(
        "lost node's capacity ends no earlier than it last became counted",
        # cordoned at 1h (not counted), uncordoned at 2h (counted again from 2h), lost at 3h with its last
        # heartbeat at 1.5h: the loss is clamped to 2h
        [
            node("n1", 8, at=h(0)),
            cordoned("n1", at=h(1)),
            uncordoned("n1", at=h(2)),
            node_lost("n1", last_heartbeat=h(1.5), at=h(3)),
        ],
        t=h(4),
        # 8 GPUs x [0h, 1h) + 8 x [2h, 2h) = 8 GPU-h
        capacity_gpu_s=8 * GPU_H,
        capacity_gpus=0,
    ),
    Case(
        "lost run charged retroactively: later changes of its budget are corrected",
        # j1 1 GPU from 0h; j2 2 GPUs from 2h (same budget); at 3h j1 is lost, charged until 1h
        [
            placed("j1", gpus=1, at=h(0)),
            placed("j2", gpus=2, at=h(2)),
            job_lost("j1", charged_until=h(1), at=h(3)),
        ],
        t=h(4),
        # j1: 1 GPU x 1h = 1; j2: 2 GPUs x 2h = 4 -> 5 GPU-h (not 1 x 3h + 4 = 7)
        occupancy={"lab/a": 5 * GPU_H},
    ),
    Case(
        "lost run charged retroactively to the instant of a later change",
        # j1 1 GPU from 0h, j2 1 GPU from 1h, j3 1 GPU from 2h; j1 lost at 3h, charged until exactly 1h
        [
            placed("j1", gpus=1, at=h(0)),
            placed("j2", gpus=1, at=h(1)),
            placed("j3", gpus=1, at=h(2)),
            job_lost("j1", charged_until=h(1), at=h(3)),
        ],
        t=h(4),
        # j1: 1 x 1h; j2: 1 x 3h; j3: 1 x 2h -> 6 GPU-h
        occupancy={"lab/a": 6 * GPU_H},
    ),
    Case(
        "lost run charged retroactively, read from a window that starts inside the corrected span",
        # as above; t = 11.5h: window (1.5h, 11.5h] starts between the inserted 1h breakpoint and 2h
        [
            placed("j1", gpus=1, at=h(0)),
            placed("j2", gpus=2, at=h(2)),
            job_lost("j1", charged_until=h(1), at=h(3)),
        ],
        t=h(11.5),
        # j1 ended at 1h: 0; j2: 2 GPUs x (11.5h - 2h) = 19 GPU-h
        occupancy={"lab/a": 19 * GPU_H},
    ),
    Case(
        "lost run charged retroactively to the instant of a later change, read from inside the span",
        [
            placed("j1", gpus=1, at=h(0)),
            placed("j2", gpus=1, at=h(1)),
            placed("j3", gpus=1, at=h(2)),
            job_lost("j1", charged_until=h(1), at=h(3)),
        ],
        t=h(11.5),
        # window (1.5h, 11.5h]: j1 ended at 1h: 0; j2 1 GPU x 10h; j3 1 GPU x 9.5h -> 19.5 GPU-h
        occupancy={"lab/a": 19.5 * GPU_H},
    ),
    Case(
        "lost run charged back to before the retained history",
        # window 10h. j1 1 GPU from 0h; j2 1 GPU on [2h, 2.5h); at 14h j1 is lost, charged until 1h: before
        # the oldest breakpoint still kept (2.5h, the last one at or before 14h - W = 4h)
        [
            placed("j1", gpus=1, at=h(0)),
            placed("j2", gpus=1, at=h(2)),
            completed("j2", at=h(2.5)),
            placed("j3", gpus=1, budget="lab/b", at=h(14)),
            job_lost("j1", charged_until=h(1), at=h(14)),
        ],
        t=h(15),
        # window (5h, 15h]: j1 charged until 1h and j2 are outside it; j3 1 GPU x 1h
        occupancy={"lab/a": 0.0, "lab/b": 1 * GPU_H, "lab": 1 * GPU_H},
    ),
    Case(
        "lost node's capacity removed retroactively below later registrations",
        # n1 8 GPUs from 0h, n2 4 GPUs from 2h; at 3h n1 is lost with its last heartbeat at 1h
        [
            node("n1", 8, at=h(0)),
            node("n2", 4, at=h(2)),
            node_lost("n1", last_heartbeat=h(1), at=h(3)),
        ],
        t=h(4),
        # 8 x [0h, 1h) + 4 x [2h, 4h) = 8 + 8 = 16 GPU-h
        capacity_gpu_s=16 * GPU_H,
        capacity_gpus=4,
    ),
    Case(
        "two runs lost at one instant, both charged retroactively",
        # j1, j2 1 GPU each from 0h, j3 1 GPU from 2h; at 3h j1 is lost (charged until 1h) and j2 (until 1.5h)
        [
            placed("j1", gpus=1, at=h(0)),
            placed("j2", gpus=1, at=h(0)),
            placed("j3", gpus=1, at=h(2)),
            job_lost("j1", charged_until=h(1), at=h(3)),
            job_lost("j2", charged_until=h(1.5), at=h(3)),
        ],
        t=h(4),
        # 1 x 1h + 1 x 1.5h + 1 x 2h = 4.5 GPU-h
        occupancy={"lab/a": 4.5 * GPU_H},
    ),
    Case(
        "changes within one expiry step are merged in time order",
        # all within W/64 = 562.5 s: j1 from 3600 s, j2 from 3660 s, j1 lost at 3720 s charged until 3630 s
        [
            placed("j1", gpus=1, at=s(3600)),
            placed("j2", gpus=1, at=s(3660)),
            job_lost("j1", charged_until=s(3630), at=s(3720)),
        ],
        t=h(2),
        # j1: 1 GPU x 30 s; j2: 1 GPU x (7200 - 3660) s = 3540 -> 3570 GPU-s
        occupancy={"lab/a": 3570.0},
    ),
    Case(
        "a short run inside one expiry step",
        [placed("j1", gpus=2, at=h(1)), completed("j1", at=s(3690))],
        # read from a window that starts inside the run: (3645 s, 3645 s + W]
        t=s(3645 + W10H),
        # 2 GPUs x (3690 - 3645) s = 90 GPU-s
        occupancy={"lab/a": 90.0},
    ),
    Case(
        "capacity: moves between states that do not count change nothing",
        # ready [0h, 1h); cordoned 1h -> drained 2h -> cordoned 3h (none counts); ready again from 4h
        [
            node("n1", 8, at=h(0)),
            cordoned("n1", at=h(1)),
            drained("n1", at=h(2)),
            cordoned("n1", at=h(3)),
            uncordoned("n1", at=h(4)),
        ],
        t=h(5),
        # 8 x 1h + 8 x 1h = 16 GPU-h
        capacity_gpu_s=16 * GPU_H,
        capacity_gpus=8,
    ),
    Case(
        "capacity: a drain does not restart the counted span, a loss clamps to the registration",
        # ready from 0h, draining from 2h (still counted), lost at 3h with its last heartbeat at 1h
        [
            node("n1", 8, at=h(0)),
            drain("n1", at=h(2)),
            node_lost("n1", last_heartbeat=h(1), at=h(3)),
        ],
        t=h(4),
        # counted [0h, 1h): 8 GPU-h (not [0h, 2h) = 16)
        capacity_gpu_s=8 * GPU_H,
        capacity_gpus=0,
    ),
    Case(
        "week window by default: 1 GPU for 8 days counts 7 days",
        [placed("j1", gpus=1, at=h(0))],
        t=h(8 * 24),
        occupancy={"lab/a": 7 * 24 * GPU_H},
        window_s=7 * 86400,
    ),
]


def _check(ledger: OccupancyLedger, case: Case) -> None:
    occ = ledger.occupancy(case.t)
    una = ledger.unallocated(case.t)
    for path, want in case.occupancy.items():
        assert occ[path] == want, (path, occ)
    for path, want in case.unallocated.items():
        assert una[path] == want, (path, una)
    if case.paths is not None:
        assert tuple(occ) == case.paths
        assert tuple(una) == case.paths
    if case.capacity_gpu_s is not None:
        assert ledger.capacity_gpu_s(case.t) == case.capacity_gpu_s
    if case.capacity_gpus is not None:
        assert ledger.capacity_gpus(case.t) == case.capacity_gpus


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_incremental(case: Case) -> None:
    ledger = OccupancyLedger(case.window_s)
    for e in case.events:
        ledger.apply(e)
    _check(ledger, case)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rebuild(case: Case) -> None:
    _check(rebuild(case.events, case.window_s), case)


def test_query_before_clock_is_refused() -> None:
    ledger = OccupancyLedger(W10H).apply_all([placed("j1", at=h(2))])
    with pytest.raises(ValueError) as got:
        ledger.occupancy(h(1))
    assert str(got.value) == f"query time {h(1)} precedes the ledger clock {h(2)} (µs)"


def test_query_while_rebuilding_is_refused() -> None:
    ledger = OccupancyLedger(W10H)
    ledger._bulk = True  # what rebuild() sets while it folds
    with pytest.raises(RuntimeError) as got:
        ledger.occupancy(h(1))
    assert str(got.value) == "ledger is being rebuilt"


@pytest.mark.parametrize("fold", ["incremental", "rebuild"])
def test_retained_counts_allocated_unallocated_and_capacity_series(fold: str) -> None:
    # lab/a (allocated) and lab/b (unallocated): a sentinel and a 1h breakpoint each; capacity: sentinel and 0h
    events = [
        node("n1", 8, at=h(0)),
        placed("j1", gpus=1, at=h(1)),
        placed("j2", budget="lab/b", allocated=False, at=h(1)),
    ]
    ledger = OccupancyLedger(W10H).apply_all(events) if fold == "incremental" else rebuild(events, W10H)
    assert ledger.retained() == 2 + 2 + 2


@pytest.mark.parametrize("fold", ["incremental", "rebuild"])
def test_expire_keeps_only_the_last_breakpoint_at_or_before_the_window_start(fold: str) -> None:
    """Memory bounded by the window: at 14h (W = 10h) lab/a keeps its 3h breakpoint (the last at or before 4h)
    and the 14h one; capacity keeps its sentinel: 3 breakpoints. The answer needs nothing older."""
    events = [
        placed("j1", gpus=1, at=h(0)),
        completed("j1", at=h(1)),
        placed("j2", gpus=1, at=h(2)),
        completed("j2", at=h(3)),
        placed("j3", gpus=1, at=h(14)),
    ]
    ledger = OccupancyLedger(W10H).apply_all(events) if fold == "incremental" else rebuild(events, W10H)
    assert ledger.retained() == 3
    assert ledger.occupancy(h(15))["lab/a"] == 1 * GPU_H


def test_empty_ledger_answers_zero() -> None:
    ledger = OccupancyLedger()
    assert ledger.occupancy(h(1)) == {}
    assert ledger.capacity_gpu_s(h(1)) == 0.0
    assert ledger.capacity_gpus() == 0
    # no clock and no time asked: every answer is empty or 0
    assert (ledger.occupancy(), ledger.unallocated(), ledger.capacity_us(), ledger.capacity_gpu_s()) == ({}, {}, 0, 0.0)


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError) as got:
        OccupancyLedger(0)
    assert str(got.value) == "window_s must be positive, got 0"


def test_window_of_one_microsecond_is_the_shortest_accepted() -> None:
    assert OccupancyLedger(1e-6).window_us == 1


@pytest.mark.parametrize("fold", ["incremental", "rebuild"])
def test_changes_at_one_instant_share_one_breakpoint(fold: str) -> None:
    """Equal times are merged: two placements at 1h in one budget add one breakpoint to its series.

    Retained: lab/a's series holds its start sentinel and the 1h breakpoint (2); capacity its sentinel (1).
    """
    events = [placed("j1", gpus=1, at=h(1)), placed("j2", gpus=2, at=h(1))]
    ledger = OccupancyLedger(W10H).apply_all(events) if fold == "incremental" else rebuild(events, W10H)
    assert ledger.retained() == 3
    assert ledger.occupancy(h(2))["lab/a"] == 3 * GPU_H  # 3 GPUs x 1h


@pytest.mark.parametrize("fold", ["incremental", "rebuild"])
def test_compaction_keeps_the_breakpoint_a_window_start_needs(fold: str) -> None:
    """W = 1h. 40 jobs on [60i, 60i + 30) s, then one placed at 5945 s: that expiry's window starts at 2345 s,
    so 79 breakpoints are dropped (sentinel and 0..2310 s) and the lists compacted; the kept 2340 s breakpoint
    is what A(2345 s) is read from. O(5945 s) = job 39's 25 s inside (2345, 5945] = 25 GPU-s."""
    events = [e for i in range(40) for e in (placed(f"j{i}", at=s(60 * i)), completed(f"j{i}", at=s(60 * i + 30)))]
    events.append(placed("jx", at=s(5945)))
    ledger = OccupancyLedger(3600).apply_all(events) if fold == "incremental" else rebuild(events, 3600)
    assert ledger.occupancy(s(5945))["lab/a"] == 25.0
    assert ledger.retained() == 4  # lab/a: 2340, 2370, 5945 s; capacity: its sentinel


def test_memory_is_bounded_by_the_window() -> None:
    """A day of 1-minute jobs in a 1-hour window keeps about an hour of breakpoints."""
    ledger = OccupancyLedger(3600)
    for i in range(24 * 60):
        ledger.apply(placed(f"j{i}", at=s(60 * i)))
        ledger.apply(completed(f"j{i}", at=s(60 * i + 30)))
    # 2 breakpoints a minute; the window plus one expiry step (W/64) holds <= ~2 x 61
    assert ledger.retained() < 2 * 61 + 10
    # 1 GPU for 30 s in each of the 60 minutes of (23h, 24h]
    assert ledger.occupancy(s(24 * 3600))["lab/a"] == 60 * 30


def test_query_full_tree_is_fast_enough() -> None:
    """Smoke check of the query cost at 200 leaves (the figure is in bench/)."""
    import time

    ledger = OccupancyLedger()
    events = [placed(f"j{i}", budget=f"o{i % 4}/g{i % 20}/l{i % 200}", at=s(i)) for i in range(2000)]
    ledger.apply_all(events)
    t = s(3000)
    start = time.perf_counter()
    for _ in range(20):
        occ = ledger.occupancy(t)
    per_query = (time.perf_counter() - start) / 20
    assert len(occ) == 4 + 20 + 200
    assert per_query < 0.05  # generous bound for slow CI; bench prints the real figure


# --------------------------------------------------------------------------- properties


class Reference:
    """Brute-force model of the same contract: explicit intervals, integrals by overlap."""

    def __init__(self, window_s: float) -> None:
        self.w = round(window_s * US_PER_S)
        self.clock: int | None = None
        self.runs: dict = {}  # key -> [budget, allocated, g, start, per replica its end (None: open)]
        self.intervals: list = []  # (budget, allocated, gpus, start, end)
        self.nodes: dict = {}  # node -> [state, gpus, since, time of its latest event]
        self.cap: list = []  # (gpus, start, end)
        self.seen: dict = {}

    def apply(self, e: ev.Event) -> None:
        kinds = (
            ev.JobPlaced,
            ev.JobCompleted,
            ev.JobFailed,
            ev.JobPreempted,
            ev.JobCancelled,
            ev.JobLost,
            ev.NodeRegistered,
            ev.NodeCordoned,
            ev.NodeDrainRequested,
            ev.NodeDrained,
            ev.NodeUncordoned,
            ev.NodeLost,
        )
        if not isinstance(e, kinds):
            return
        ts = to_us(e.ts)
        self.clock = ts if self.clock is None else max(self.clock, ts)
        # every event at its own time, or the window's start if older (a run's end not before its start, a node's
        # change not before its last)
        now = max(ts, self.clock - self.w)
        if isinstance(e, ev.JobPlaced):
            key = (e.job_id, e.attempt)
            run = self.runs.get(key)
            if run is not None and (None in run[4] or max(run[4]) >= now - self.w):
                return  # open, or ended within the last W: a duplicate
            if run is not None:  # the same run again after W: the old one's intervals stay
                self.intervals.extend((run[0], run[1], run[2], run[3], x) for x in run[4])
            self.runs[key] = [e.budget, e.allocated, e.gpus_per_replica, now, [None] * e.replicas]
        elif isinstance(e, (ev.JobCompleted, ev.JobFailed)):
            self._end((e.job_id, e.attempt), e.replica, now)
        elif isinstance(e, ev.JobPreempted):
            self._end((e.job_id, e.attempt), None, now)
        elif isinstance(e, ev.JobCancelled):
            if e.attempt is not None:
                self._end((e.job_id, e.attempt), None, now)
        elif isinstance(e, ev.JobLost):
            run = self.runs.get((e.job_id, e.attempt))
            if run:
                self._end((e.job_id, e.attempt), None, min(max(to_us(e.charged_until), run[3]), now))
        else:
            if e.event_id in self.seen and self.seen[e.event_id] >= now - self.w:
                return
            self.seen[e.event_id] = now
            counted = ("ready", "draining")
            n = self.nodes.get(e.node_id)
            if n is not None:
                now = n[3] = max(now, n[3])
            if isinstance(e, ev.NodeRegistered):
                if n and n[0] in counted:
                    self.cap.append((n[1], n[2], now))
                self.nodes[e.node_id] = ["ready", e.gpu_count, now, now]
                return
            if n is None or n[0] == "lost":
                return
            if isinstance(e, ev.NodeLost):
                if n[0] in counted:
                    self.cap.append((n[1], n[2], min(max(to_us(e.last_heartbeat), n[2]), now)))
                n[0] = "lost"
                return
            new = {
                ev.NodeCordoned: "cordoned",
                ev.NodeDrainRequested: "draining",
                ev.NodeDrained: "drained",
                ev.NodeUncordoned: "ready",
            }[type(e)]
            if n[0] in counted and new not in counted:
                self.cap.append((n[1], n[2], now))
            if n[0] not in counted and new in counted:
                n[2] = now
            n[0] = new

    def _end(self, key, replica, x) -> None:
        run = self.runs.get(key)
        if run is None:
            return
        ends = run[4]
        x = max(x, run[3])
        for i in range(len(ends)) if replica is None else [replica] if 0 <= replica < len(ends) else []:
            if ends[i] is None or x < ends[i]:  # the earliest end reported wins
                ends[i] = x

    @staticmethod
    def _overlap(a: int, b: int, lo: int, hi: int) -> int:
        return max(0, min(b, hi) - max(a, lo))

    def totals(self, t: int, allocated: bool) -> dict[str, int]:
        out: dict[str, int] = {}
        items = list(self.intervals) + [
            (r[0], r[1], r[2], r[3], t if x is None else x) for r in self.runs.values() for x in r[4]
        ]
        every = {r[0] for r in self.intervals} | {r[0] for r in self.runs.values()}
        for b in every:
            parts = b.split("/")
            for i in range(len(parts)):
                out.setdefault("/".join(parts[: i + 1]), 0)
        for budget, alloc, g, a, b in items:
            if alloc != allocated:
                continue
            v = g * self._overlap(a, b, t - self.w, t)
            parts = budget.split("/")
            for i in range(len(parts)):
                out["/".join(parts[: i + 1])] += v
        return dict(sorted(out.items()))

    def capacity(self, t: int) -> tuple[int, int]:
        items = list(self.cap) + [(n[1], n[2], t) for n in self.nodes.values() if n[0] in ("ready", "draining")]
        k = sum(g * self._overlap(a, b, t - self.w, t) for g, a, b in items)
        c = sum(n[1] for n in self.nodes.values() if n[0] in ("ready", "draining"))
        return k, c


def _answers(x, t: int | None):  # None: no occupancy fact folded yet (no clock)
    if isinstance(x, Reference):
        t = t or 0  # None only while the reference is empty: every t gives the same answers then
        return x.totals(t, True), x.totals(t, False), x.capacity(t)
    return x.occupancy_us(t), x.unallocated_us(t), (x.capacity_us(t), x.capacity_gpus(t))


PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(log=event_logs(), later=st.sampled_from([0, 1, 5_000_000, 80_000_000, 300_000_000]))
def test_incremental_equals_rebuild_equals_reference(log, later) -> None:
    inc = OccupancyLedger(PROP_W)
    ref = Reference(PROP_W)
    for e in log:
        inc.apply(e)
        ref.apply(e)
        assert _answers(inc, inc.clock) == _answers(ref, ref.clock)
    bulk = rebuild(log, PROP_W)
    t = (inc.clock if inc.clock is not None else T0) + later
    assert _answers(inc, t) == _answers(bulk, t) == _answers(ref, t)


def _merge(log: list, seed: int) -> list:
    """A live service's view of ``log``: each job's and node's events in their order (one key, one partition),
    the entities interleaved as polls deliver them, each event up to W/4 later than in event-time order."""
    rnd = random.Random(seed)
    streams: dict[str, list] = {}
    for e in log:
        streams.setdefault(getattr(e, "job_id", None) or e.node_id, []).append(e)
    jitter = {id(e): to_us(e.ts) + rnd.randrange(s_to_us(PROP_W) // 4) for e in log}
    heads = [(jitter[id(q[0])], k) for k, q in streams.items()]
    out = []
    while heads:
        heads.sort()
        _, k = heads.pop(0)
        out.append(streams[k].pop(0))
        if streams[k]:
            heads.append((jitter[id(streams[k][0])], k))
    return out


@PROPS
@given(log=event_logs(), seeds=st.tuples(st.integers(0, 2**32), st.integers(0, 2**32)))
def test_any_merge_of_the_entities_streams_gives_the_same_ledger(log, seeds) -> None:
    # two interleavings of the same partitions (what a live service folds, and what a replay folds) hold the same
    # windows, exactly, and the brute-force reference agrees. Re-deliveries of old records are left out here:
    # de-duplication memory is one window (test_incremental_equals_rebuild_equals_reference covers it).
    once = list({e.event_id: e for e in reversed(log)}.values())[::-1]
    m1, m2 = _merge(once, seeds[0]), _merge(once, seeds[1])
    a, b = OccupancyLedger(PROP_W).apply_all(m1), OccupancyLedger(PROP_W).apply_all(m2)
    ref = Reference(PROP_W)
    for e in m2:
        ref.apply(e)
    t = a.clock if a.clock is not None else T0
    assert b.clock == a.clock
    assert _answers(a, t) == _answers(b, t) == _answers(ref, t)
    assert _answers(rebuild(m2, PROP_W), t) == _answers(a, t)


@PROPS
@given(log=event_logs(), cut=st.integers(0, 60))
def test_rebuild_prefix_then_apply_rest_equals_rebuild_all(log, cut) -> None:
    cut = min(cut, len(log))
    resumed = rebuild(log[:cut], PROP_W)
    for e in log[cut:]:
        resumed.apply(e)
    whole = rebuild(log, PROP_W)
    t = whole.clock
    assert _answers(resumed, t) == _answers(whole, t)
    assert resumed.occupancy(t) == whole.occupancy(t)


def test_a_share_change_at_the_same_instant_is_another_snapshot_id() -> None:
    # same ledger, same event time, the tree's shares changed: a different payload must not reuse the id
    from apportion.domain.budgets import BudgetTree
    from apportion.domain.occupancy import OccupancyLedger
    from apportion.domain.usage import usage_snapshot

    ledger = OccupancyLedger(3600.0)
    a = usage_snapshot(BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.6, "lab/b": 0.4}), ledger, 10**15)
    b = usage_snapshot(BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.7, "lab/b": 0.3}), ledger, 10**15)
    assert a.budgets != b.budgets and a.event_id != b.event_id
    same = usage_snapshot(BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.6, "lab/b": 0.4}), ledger, 10**15)
    assert same.event_id == a.event_id  # deterministic


def test_ended_runs_and_node_event_ids_are_forgotten_two_windows_back_and_kept_from_exactly_there() -> None:
    # De-duplication memory (OccupancyLedger.expire) is one window longer than the series: at an expiry at
    # clock t it keeps what ended (or was seen) at or after keep = t - 2W. W = 1 h; runs k_i of 1 GPU from
    # 60 i s to 60 i + 30 s (i = 1..180), so t = 10,830 s and keep = 3,630 s: k60 ended exactly at keep (kept),
    # k59 at 3,570 s (forgotten). Node registrations at 0 s (forgotten) and exactly 3,630 s (kept). The answers
    # do not show this memory (an expired duplicate falls before the window anyway), so the test reads it.
    ledger = OccupancyLedger(3600)
    ledger.apply(node("n0", at=s(0)))
    for i in range(1, 181):
        if i == 61:
            ledger.apply(node("n1", at=s(3630)))  # in time order: after k60's end at 3,630 s
        ledger.apply(placed(f"k{i}", at=s(60 * i)))
        ledger.apply(completed(f"k{i}", at=s(60 * i + 30)))
    assert ledger.clock == s(10830)
    ledger.expire(s(10830))
    assert list(ledger._done) == [(f"k{i}", 1) for i in range(60, 181)]
    assert list(ledger._seen.values()) == [s(3630)]
