"""The preemption candidate rule, :func:`victim_rule` (rule D3.victims), as a table.

Tree for every case::

    lab (1.0)
    ├── a  0.5      <- the preemptor B (leaf lab/a) unless stated
    ├── b  0.25     <- victims V
    └── c  0.25
        └── (c/x 1.0, c/y ... only in the one-line case)

The view is a real :class:`FairShareQueue` over window occupancy with K =
1,000,000 GPU-s, so E_a = 500,000 and E_b = E_c = 250,000 GPU-s. Ratios are
chosen to be exact in binary floating point (multiples of 1/8), so "exactly
delta" is exact: delta = 0.125 in these cases.
"""

from __future__ import annotations

import dataclasses

import pytest

from apportion.domain.budgets import BudgetTree
from apportion.domain.fairshare import FairShareQueue
from apportion.domain.preemption import (
    CHECKPOINT_NONE_DUE,
    CHECKPOINT_NOT_WORTH,
    CHECKPOINT_OFF,
    CHECKPOINT_WAIT,
    PATIENCE_NOTHING_LOST,
    PATIENCE_OFF,
    PATIENCE_REPAID,
    PATIENCE_SPENT,
    PATIENCE_UNDER_SHARE,
    PATIENCE_WAIT,
    REFUSED_AFTER_MOVE,
    REFUSED_GANG_FRACTION,
    REFUSED_NOT_BEHIND,
    REFUSED_ONE_LINE,
    REFUSED_PROTECTED,
    REFUSED_REVERSAL,
    REFUSED_SAME_LEAF,
    REFUSED_STOPPING,
    RULE_EXPIRED_BEHIND,
    RULE_UNALLOCATED,
    VictimVerdict,
    checkpoint_rule,
    gang_bound_us,
    gang_rule,
    patience_rule,
    victim_rule,
)
from tests.kit.builders import h
from tests.kit.preemption import DELTA, NOW, ONE_LINE, TREE, K, run_of, view

CASES = [
    pytest.param(run_of(), "lab/a", NOW, view(1.0, 1.125), 0.0, (), RULE_EXPIRED_BEHIND, id="exactly delta behind"),
    pytest.param(
        run_of(),
        "lab/a",
        NOW,
        view(1.0, 1.125 - 1 / 1024),
        0.0,
        (),
        REFUSED_NOT_BEHIND,
        id="just under delta behind (r_V = 1.125 - 2**-10)",
    ),
    pytest.param(
        run_of(), "lab/a", h(1), view(1.0, 2.0), 0.0, (), RULE_EXPIRED_BEHIND, id="exactly at the protection end"
    ),
    pytest.param(
        run_of(), "lab/a", h(1) - 1, view(1.0, 2.0), 0.0, (), REFUSED_PROTECTED, id="one µs before the protection end"
    ),
    pytest.param(
        run_of(min_runtime_s=1e9), "lab/a", NOW, view(0.0, 100.0), 0.0, (), REFUSED_PROTECTED, id="protected, far ahead"
    ),
    pytest.param(
        run_of("lab/a"),
        "lab/a",
        NOW,
        view(0.0, 0.0, TREE, **{"lab/a": 1e9}),
        0.0,
        (),
        REFUSED_SAME_LEAF,
        id="same leaf never",
    ),
    pytest.param(
        run_of("lab/a"),
        "lab/a/x",
        NOW,
        FairShareQueue(ONE_LINE, {"lab/a": 1e9, "lab": 1e9}, K, {}),
        0.0,
        (),
        REFUSED_ONE_LINE,
        id="an ancestor's run: no branches to compare",
    ),
    pytest.param(
        # r_a = 1.0, r_b = 1.5: behind by 0.5. J's charge 100,000 GPU-s: r_a after = 600000/500000 = 1.2 <= 1.5.
        run_of(),
        "lab/a",
        NOW,
        view(1.0, 1.5),
        100_000.0,
        (),
        RULE_EXPIRED_BEHIND,
        id="after the move B is still at or below V: allowed",
    ),
    pytest.param(
        # the same charge + 150,000: r_a after = 750000/500000 = 1.5 = r_V exactly: allowed (<=)
        run_of(),
        "lab/a",
        NOW,
        view(1.0, 1.5),
        250_000.0,
        (),
        RULE_EXPIRED_BEHIND,
        id="after the move B exactly at V: allowed",
    ),
    pytest.param(
        # one GPU-s more: r_a after = 750001/500000 > 1.5: the move would invert the pair
        run_of(),
        "lab/a",
        NOW,
        view(1.0, 1.5),
        250_001.0,
        (),
        REFUSED_AFTER_MOVE,
        id="the after-move inversion is refused",
    ),
    pytest.param(
        run_of(),
        "lab/a",
        NOW,
        view(1.0, 2.0),
        0.0,
        (("lab", "lab/a", "lab/b"),),
        REFUSED_REVERSAL,
        id="this cycle already preempted a's work for b: no reversal",
    ),
    pytest.param(
        run_of(),
        "lab/a",
        NOW,
        view(1.0, 2.0),
        0.0,
        (("lab", "lab/b", "lab/a"),),
        RULE_EXPIRED_BEHIND,
        id="the same direction again is no reversal",
    ),
    pytest.param(
        run_of(allocated=False, started=NOW), "lab/a", NOW, view(5.0, 0.0), 1e9, (), RULE_UNALLOCATED, id="unallocated"
    ),
    pytest.param(run_of(stopping=True), "lab/a", NOW, view(0.0, 5.0), 0.0, (), REFUSED_STOPPING, id="stopping: never"),
]


@pytest.mark.parametrize("run, leaf, now, v, charge, moves, expected", CASES)
def test_victim_rule(run, leaf, now, v, charge, moves, expected):
    verdict = victim_rule(run, leaf, now, v, DELTA, charge, frozenset(moves))
    assert verdict.rule == expected
    assert verdict.allowed is (expected in (RULE_EXPIRED_BEHIND, RULE_UNALLOCATED))


@pytest.mark.parametrize(
    ("replicas", "gpus", "job_gpus", "allowed"),
    [
        (1, 8, 1, True),  # a single-node run: the cost order decides
        (2, 16, 15, False),  # a gang larger than the job: never
        (2, 16, 16, True),  # a job of the gang's size may
        (4, 32, 64, True),
    ],
)
def test_gang_rule(replicas, gpus, job_gpus, allowed):
    assert gang_rule(replicas, gpus, job_gpus) is allowed


H_US = 3_600_000_000  # one hour, µs
CAP = 42 * H_US  # W / 4 of a 7-day window, µs


@pytest.mark.parametrize(
    ("replicas", "gpus", "job_gpus", "ran_us", "cap_us", "allowed"),
    [
        pytest.param(2, 16, 8, CAP - 1, CAP, False, id="gang, half the size, 1 µs before the cap: spared"),
        pytest.param(2, 16, 8, CAP, CAP, True, id="gang at exactly the cap: a victim like any other"),
        pytest.param(2, 16, 8, CAP + H_US, CAP, True, id="gang past the cap"),
        pytest.param(2, 16, 8, 100 * H_US, None, False, id="no cap: spared whatever its age"),
        pytest.param(2, 16, 1, 2 * H_US - 1, 2 * H_US, False, id="a budget's max_min_runtime (2 h) as the cap: before"),
        pytest.param(2, 16, 1, 2 * H_US, 2 * H_US, True, id="a budget's max_min_runtime (2 h) as the cap: at it"),
        pytest.param(2, 16, 16, 0, CAP, True, id="a job of the gang's size: at once"),
        pytest.param(1, 8, 1, 0, CAP, True, id="a single-node run: at once"),
    ],
)
def test_gang_rule_is_bounded_by_the_protection_cap(replicas, gpus, job_gpus, ran_us, cap_us, allowed):
    assert gang_rule(replicas, gpus, job_gpus, ran_us, cap_us) is allowed


def test_the_gang_rules_bound_is_the_cap_of_every_protection():
    from apportion.domain.engine import EngineConfig, protection_cap_us

    tree = BudgetTree.from_mapping(
        {"lab": 1.0, "lab/a": 0.5, "lab/b": {"share": 0.5, "max_min_runtime_s": 7200.0}, "lab/b/x": 1.0}
    )
    cfg = EngineConfig()  # W = 7 days, cap W / 4 = 42 h
    assert protection_cap_us("lab/a", tree, cfg) == 42 * H_US
    assert protection_cap_us("lab/b/x", tree, cfg) == 2 * H_US  # inherited max_min_runtime, lower than W / 4
    assert protection_cap_us("lab/a", tree, EngineConfig(window_s=4 * 3600.0)) == H_US


def test_victim_rule_applies_the_gang_bound_from_the_runs_latest_start():
    gang = dataclasses.replace(run_of(started=h(0)), replicas=2, started_replicas=frozenset({0, 1}))  # 2 x 4 GPUs
    for now, rule in ((h(42) - 1, REFUSED_GANG_FRACTION), (h(42), RULE_EXPIRED_BEHIND)):
        verdict = victim_rule(gang, "lab/a", now, view(1.0, 2.0), DELTA, 0.0, frozenset(), 4, gang_cap_us=CAP)
        assert verdict.rule == rule, now


@pytest.mark.parametrize(
    ("replicas", "gpus", "job_gpus", "least_gpus", "allowed"),
    [
        pytest.param(2, 1016, 8, 1024, True, id="a gang 8 GPUs under the least size: a victim like a single-node run"),
        pytest.param(2, 1024, 8, 1024, False, id="a gang of exactly the least size: spared"),
        pytest.param(128, 1024, 1023, 1024, False, id="the least size, a job one GPU smaller: spared"),
        pytest.param(128, 1024, 1024, 1024, True, id="the least size, a job of its size: a victim"),
        pytest.param(2, 16, 8, None, False, id="no least size: every gang is spared"),
    ],
)
def test_gang_rule_scoped_by_the_gangs_size(replicas, gpus, job_gpus, least_gpus, allowed):
    # EngineConfig.gang_min_gpus (rule D3.gangs): the age is 0, so only the size decides
    assert gang_rule(replicas, gpus, job_gpus, 0, CAP, least_gpus) is allowed


def _gang(protection_h: float | None, min_runtime_s: float = 3600.0):
    """2 x 4 GPUs started at 0 h; its recorded protection (``None``: none recorded, the minimum runtime counts)."""
    g = dataclasses.replace(
        run_of(min_runtime_s=min_runtime_s, started=h(0)), replicas=2, started_replicas=frozenset({0, 1})
    )
    return g if protection_h is None else dataclasses.replace(g, protection_us=int(protection_h * H_US))


@pytest.mark.parametrize(
    ("protection_h", "times", "cap_us", "expected"),
    [
        pytest.param(2.0, 2.0, CAP, 4 * H_US, id="2 h protection x 2 = 4 h, under the 42 h cap"),
        pytest.param(21.0, 2.0, CAP, CAP, id="21 h x 2 = 42 h: exactly the cap"),
        pytest.param(24.0, 2.0, CAP, CAP, id="24 h x 2 = 48 h: the cap, 42 h"),
        pytest.param(2.0, None, CAP, CAP, id="no multiple: the cap alone"),
        pytest.param(2.0, 2.0, None, 4 * H_US, id="no cap: the multiple alone"),
        pytest.param(None, 3.0, CAP, 3 * H_US, id="no recorded protection: 3 x the 1 h minimum runtime"),
    ],
)
def test_gang_bound_is_the_cap_or_a_multiple_of_the_gangs_own_protection(protection_h, times, cap_us, expected):
    assert gang_bound_us(_gang(protection_h), cap_us, times) == expected


def test_victim_rule_bounds_the_gang_rule_by_twice_its_protection():
    gang = _gang(2.0)  # 2 x 4 GPUs, protection 2 h from 0 h: the gang rule's bound is 4 h (x 2), not 42 h
    for now, rule in ((h(4) - 1, REFUSED_GANG_FRACTION), (h(4), RULE_EXPIRED_BEHIND)):
        verdict = victim_rule(
            gang, "lab/a", now, view(1.0, 2.0), DELTA, 0.0, frozenset(), 4, gang_cap_us=CAP, gang_times=2.0
        )
        assert verdict.rule == rule, now
    # scoped by size: a gang of 8 GPUs under a least size of 9 is a victim past its protection at once
    verdict = victim_rule(
        gang, "lab/a", h(2), view(1.0, 2.0), DELTA, 0.0, frozenset(), 4, gang_cap_us=CAP, gang_least_gpus=9
    )
    assert verdict.rule == RULE_EXPIRED_BEHIND
    verdict = victim_rule(
        gang, "lab/a", h(2), view(1.0, 2.0), DELTA, 0.0, frozenset(), 4, gang_cap_us=CAP, gang_least_gpus=8
    )
    assert verdict.rule == REFUSED_GANG_FRACTION


def test_victim_rule_refuses_a_gang_larger_than_the_job_only_when_told_the_jobs_size():
    run = run_of()  # 1 x 4 GPUs
    gang = dataclasses.replace(run, replicas=2, started_replicas=frozenset({0, 1}))  # 2 x 4 GPUs, started in full
    assert victim_rule(gang, "lab/a", NOW, view(1.0, 2.0), DELTA, 0.0, frozenset(), 4).rule == REFUSED_GANG_FRACTION
    assert victim_rule(gang, "lab/a", NOW, view(1.0, 2.0), DELTA, 0.0, frozenset(), 8).rule == RULE_EXPIRED_BEHIND
    assert victim_rule(gang, "lab/a", NOW, view(1.0, 2.0), DELTA, 0.0).rule == RULE_EXPIRED_BEHIND
    assert victim_rule(run, "lab/a", NOW, view(1.0, 2.0), DELTA, 0.0, frozenset(), 1).rule == RULE_EXPIRED_BEHIND


def test_the_verdict_carries_the_compared_ratios():
    verdict = victim_rule(run_of(), "lab/a", NOW, view(1.0, 1.5), DELTA, 100_000.0)
    assert (verdict.lca, verdict.victim_ratio, verdict.preemptor_ratio) == ("lab", 1.5, 1.0)
    assert verdict.preemptor_ratio_after == 1.2


def test_the_ratios_include_the_cycles_provisional_charges_on_both_sides():
    # B = lab/a at r 1.0, V = lab/b at r 1.0: not behind. A provisional charge of 62,500 GPU-s to
    # lab/b in this cycle (r_b = 1.25) makes it behind by 0.25 >= delta: the view is the live one.
    q = view(1.0, 1.0)
    assert victim_rule(run_of(), "lab/a", NOW, q, DELTA).rule == REFUSED_NOT_BEHIND
    q.charge("lab/b", 62_500.0)
    assert victim_rule(run_of(), "lab/a", NOW, q, DELTA).rule == RULE_EXPIRED_BEHIND
    q.charge("lab/a", 62_500.0)  # and a's own charges count for a: r_a = 1.125, gap 0.125
    assert victim_rule(run_of(), "lab/a", NOW, q, DELTA).rule == RULE_EXPIRED_BEHIND
    q.charge("lab/a", 1.0)
    assert victim_rule(run_of(), "lab/a", NOW, q, DELTA).rule == REFUSED_NOT_BEHIND


# ---------------------------------------------------------------- charge_of, backfill_rule, the default charge


@pytest.mark.parametrize(
    ("g", "k", "min_runtime_s", "window_s", "expected"),
    [
        pytest.param(2, 3, 100.0, 1000.0, 600.0, id="g x k x min_runtime"),
        pytest.param(2, 3, 5000.0, 1000.0, 6000.0, id="a minimum runtime past W charges W"),
        pytest.param(8, 1, 0.0, 1000.0, 0.0, id="unallocated: nothing"),
    ],
)
def test_charge_of_is_g_k_min_runtime_capped_by_the_window(g, k, min_runtime_s, window_s, expected) -> None:
    from apportion.domain.preemption import charge_of

    assert charge_of(g, k, min_runtime_s, window_s) == expected


@pytest.mark.parametrize(
    ("allocated", "protection_us", "holder_fit_us", "holder_may_preempt", "expected"),
    [
        pytest.param(False, 10**9, 0, False, True, id="unallocated work always backfills"),
        pytest.param(True, 50, 150, True, True, id="protection ends exactly when the holder fits"),
        pytest.param(True, 50, 149, True, False, id="protection ends 1 µs after the holder fits"),
        pytest.param(True, 10, 150, False, False, id="the holder could not take it back"),
    ],
)
def test_backfill_rule_table(allocated, protection_us, holder_fit_us, holder_may_preempt, expected) -> None:
    from apportion.domain.preemption import backfill_rule

    assert backfill_rule(allocated, protection_us, 100, holder_fit_us, holder_may_preempt) is expected


def test_without_a_charge_the_after_move_test_compares_the_ratios_as_they_are() -> None:
    # delta 0 and equal ratios: allowed with no charge (r_B_after = r_B = r_V), refused with 1 GPU-s more
    assert victim_rule(run_of(), "lab/a", NOW, view(1.0, 1.0), 0.0).rule == RULE_EXPIRED_BEHIND
    assert victim_rule(run_of(), "lab/a", NOW, view(1.0, 1.0), 0.0, 1.0).rule == REFUSED_AFTER_MOVE


# ---------------------------------------------------------------- patience_rule (is the least-cost plan worth its loss?)


@pytest.mark.parametrize(
    ("lost_gpu_s", "gpus", "waited_s", "ratio", "patience_s", "expected"),
    [
        pytest.param(1e9, 1, 0.0, 2.0, 0.0, PATIENCE_OFF, id="patience 0: off, any loss goes"),
        pytest.param(1e9, 1, 0.0, 0.999, 7200.0, PATIENCE_UNDER_SHARE, id="under its share (r < 1): at once"),
        pytest.param(7200.0, 1, 0.0, 1.0, 7200.0, PATIENCE_WAIT, id="exactly at its share (r = 1): it waits"),
        pytest.param(0.0, 1, 0.0, 1.0, 7200.0, PATIENCE_NOTHING_LOST, id="nothing lost: at once"),
        # 2 GPUs x 3600 s waited = 7200 GPU-s: exactly the loss -> repaid; one second less -> waits
        pytest.param(7200.0, 2, 3600.0, 1.5, 7200.0, PATIENCE_REPAID, id="waited GPU-s exactly the loss"),
        pytest.param(7200.0, 2, 3599.0, 1.5, 7200.0, PATIENCE_WAIT, id="waited GPU-s one GPU-s x 2 short"),
        pytest.param(288000.0, 1, 7200.0, 1.5, 7200.0, PATIENCE_SPENT, id="waited exactly patience: any loss"),
        pytest.param(288000.0, 1, 7199.0, 1.5, 7200.0, PATIENCE_WAIT, id="one second before patience ends"),
        pytest.param(1.0, 1, 0.0, float("inf"), 7200.0, PATIENCE_WAIT, id="r infinite (share 0 with usage) waits"),
    ],
)
def test_patience_rule_table(lost_gpu_s, gpus, waited_s, ratio, patience_s, expected) -> None:
    assert patience_rule(lost_gpu_s, gpus, waited_s, ratio, patience_s) == expected


def test_backfill_rule_by_default_takes_the_holder_as_able_to_preempt() -> None:
    from apportion.domain.preemption import backfill_rule

    assert backfill_rule(True, 50, 100, 150) is True  # holder_may_preempt defaults to True


def test_a_refusal_before_the_lca_carries_no_ratios() -> None:
    v = VictimVerdict(REFUSED_STOPPING)
    assert (v.lca, v.victim_ratio, v.preemptor_ratio, v.preemptor_ratio_after) == (None, None, None, None)


def test_patience_of_one_second_is_on() -> None:
    # (the rule is off only at patience 0: one second of patience already makes an over-share job wait)
    assert patience_rule(1e9, 1, 0.0, 2.0, 1.0) == PATIENCE_WAIT
    assert patience_rule(1e9, 1, 1.0, 2.0, 1.0) == PATIENCE_SPENT


# checkpoint_rule: victims as (work lost now GPU-s, next checkpoint µs); NOW = T0 + 10 h, a 4-GPU job, wait cap 600 s.
_CK_NOW = h(10)


def _at(s: int) -> int:
    return _CK_NOW + s * 1_000_000


@pytest.mark.parametrize(
    "victims, wait_s, expected",
    [
        pytest.param([(8000.0, _at(100))], 0.0, (CHECKPOINT_OFF, 0.0, None), id="wait 0: off"),
        # the rule is off only at wait 0: a 1 s wait already waits for a checkpoint due in it (4 x 1 < 8000)
        pytest.param([(8000.0, _at(1))], 1.0, (CHECKPOINT_WAIT, 8000.0, _at(1)), id="wait 1 s: on"),
        pytest.param([], 600.0, (CHECKPOINT_NONE_DUE, 0.0, None), id="no victims: none due"),
        pytest.param([(0.0, _at(100))], 600.0, (CHECKPOINT_NONE_DUE, 0.0, None), id="nothing lost: none due"),
        # any work lost counts: 1 GPU-s saved against 4 x 100 GPU-s of waiting
        pytest.param([(1.0, _at(100))], 600.0, (CHECKPOINT_NOT_WORTH, 1.0, _at(100)), id="1 GPU-s lost: counted"),
        pytest.param([(8000.0, None)], 600.0, (CHECKPOINT_NONE_DUE, 0.0, None), id="no interval: none due"),
        pytest.param([(8000.0, _CK_NOW)], 600.0, (CHECKPOINT_NONE_DUE, 0.0, None), id="due now = overdue: none"),
        pytest.param([(8000.0, _at(601))], 600.0, (CHECKPOINT_NONE_DUE, 0.0, None), id="after the cap: none"),
        pytest.param([(8000.0, _at(600))], 600.0, (CHECKPOINT_WAIT, 8000.0, _at(600)), id="at the cap: 2400 < 8000"),
        # 4 GPUs x 2000 s = 8000 GPU-s of waiting against 8000 saved: not worth it (strict <)
        pytest.param([(8000.0, _at(2000))], 3600.0, (CHECKPOINT_NOT_WORTH, 8000.0, _at(2000)), id="equal: preempt"),
        pytest.param([(8001.0, _at(2000))], 3600.0, (CHECKPOINT_WAIT, 8001.0, _at(2000)), id="one more: wait"),
        # two victims due at 100 s and 300 s, a third overdue: saved 3000 + 2000, until the later one
        pytest.param(
            [(3000.0, _at(100)), (2000.0, _at(300)), (9000.0, _at(-5))],
            600.0,
            (CHECKPOINT_WAIT, 5000.0, _at(300)),
            id="two due, one overdue",
        ),
    ],
)
def test_checkpoint_rule_table(victims, wait_s, expected) -> None:
    got = checkpoint_rule(victims, 4, _CK_NOW, wait_s)
    assert (got.rule, got.saved_gpu_s, got.until_us) == expected
    assert got.wait == (expected[0] == CHECKPOINT_WAIT)
