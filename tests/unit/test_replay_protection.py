"""The audit's protection check uses the scheduler's protection function (rule D3.bounded-churn).

Log: job ``j`` (min_runtime 60 s) is preempted once, requeued, placed again
with the protection the engine recorded (2 x 60 = 120 s), started at 1 h,
then preempted at 1 h + ``x``.
"""

from __future__ import annotations

import pytest

from apportion.audit.config import configured_event
from apportion.audit.replay import preemption_report
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import EngineConfig
from apportion.events import Event
from tests.kit.builders import budget_set, dt, h, placed, preempted, requeued, started


def placed_with(job_id, protection, ratio: float = 0.0, **kw):
    e = placed(job_id, **kw)
    return e.model_copy(update={"decision": e.decision.model_copy(update={"protection_s": protection, "ratio": ratio})})


def log(
    second_preemption_after_s: float,
    recorded: float | None = 120.0,
    max_rt: float | None = None,
    ratio: float = 0.0,
    first: list[Event] | None = None,
):
    us = round(second_preemption_after_s * 1e6)
    return [
        *(first or []),
        budget_set("lab", 1.0),
        budget_set("lab/a", 1.0, max_min_runtime_s=max_rt),
        placed_with("j", 60.0, min_runtime_s=60.0, at=h(0)),
        started("j", at=h(0)),
        preempted("j", at=h(0.5)),
        requeued("j", attempt=2, at=h(0.5)),
        placed_with("j", recorded, ratio, attempt=2, min_runtime_s=60.0, at=h(1)),
        started("j", attempt=2, at=h(1)),
        preempted("j", attempt=2, at=h(1) + us),
    ]


CASES = [
    pytest.param(119.999999, 120.0, None, 1, [], id="one µs before the grown protection ends: a violation"),
    pytest.param(120.0, 120.0, None, 0, [], id="exactly at its end: allowed"),
    pytest.param(90.0, 90.0, 90.0, 0, [], id="max_min_runtime caps it: 90 s"),
    pytest.param(90.0, None, None, 0, [], id="a record without protection_s: the minimum runtime (60 s)"),
    pytest.param(100.0, 60.0, None, 1, [(60.0, 120.0)], id="a wrong recorded protection is a mismatch"),
]


@pytest.mark.parametrize("after, recorded, max_rt, violations, mismatches", CASES)
def test_protection_violations_and_mismatches(after, recorded, max_rt, violations, mismatches):
    rep = preemption_report(log(after, recorded, max_rt))
    assert len(rep.violations) == violations
    assert [(m["recorded_protection_s"], m["protection_s"]) for m in rep.mismatches] == mismatches
    assert rep.total == 2


def _record(grow_over_share: bool) -> list[Event]:
    cfg = DispatchConfig(engine=EngineConfig(grow_over_share=grow_over_share))
    return [configured_event(cfg, instance="d", fencing_token=1, ts=dt(h(0)), producer="dispatcher")]


# The second placement at r = 1.5 (its budget over its share). Rule D3.bounded-churn grows the protection only at or
# under the share (the default, and a record with grow_over_share False): 60 s, the minimum runtime; a record of a
# dispatcher that grew every job (grow_over_share True, policy fairtree-9 and before) gives 2 x 60 = 120 s.
OVER_SHARE_CASES = [
    pytest.param(None, 60.0, 60.0, 0, [], id="no record: the policy, the minimum runtime"),
    pytest.param(False, 60.0, 60.0, 0, [], id="recorded off: preempted at its end, allowed"),
    pytest.param(False, 120.0, 100.0, 0, [(120.0, 60.0)], id="recorded off: a grown protection is a mismatch"),
    pytest.param(True, 120.0, 119.999999, 1, [], id="recorded on: grown to 120 s, one µs before its end"),
    pytest.param(True, 60.0, 100.0, 1, [(60.0, 120.0)], id="recorded on: the minimum runtime is a mismatch"),
]


@pytest.mark.parametrize("grow, recorded, after, violations, mismatches", OVER_SHARE_CASES)
def test_a_placement_over_its_share_is_judged_by_the_recorded_growth_rule(
    grow, recorded, after, violations, mismatches
):
    first = [] if grow is None else _record(grow)
    rep = preemption_report(log(after, recorded, ratio=1.5, first=first))
    assert len(rep.violations) == violations
    assert [(m["recorded_protection_s"], m["protection_s"]) for m in rep.mismatches] == mismatches


def test_a_placement_exactly_at_its_share_grows_under_the_policy():
    # r = 1.0 is at its share: 2 x 60 = 120 s recorded and recomputed, preempted one µs early: a violation
    rep = preemption_report(log(119.999999, 120.0, ratio=1.0, first=_record(False)))
    assert (len(rep.violations), rep.mismatches) == (1, [])


# A 2-replica gang ``g`` (minimum runtime 60 s, no protection_s recorded: the minimum runtime) placed at 0;
# replica 0 starts at 0, replica 1 at 30 s. The window is Run.protected_until_us, the dispatcher's rule: 60 s
# from the LATEST replica start (to 90 s, 2024-01-01T00:01:30), and protected outright while a replica has not started.
GANG_CASES = [
    pytest.param((0, 30), 89.999999, [("g", "2024-01-01T00:01:30+00:00")], id="1 µs before latest start + 60 s"),
    pytest.param((0, 30), 90.0, [], id="exactly latest start + 60 s: allowed"),
    pytest.param((0, 30), 61.0, [("g", "2024-01-01T00:01:30+00:00")], id="past first start + 60 s: still a violation"),
    pytest.param((0,), 3600.0, [("g", None)], id="one replica never started: protected outright"),
]


@pytest.mark.parametrize("starts, at_s, violations", GANG_CASES)
def test_a_gang_is_protected_from_its_latest_replica_start(starts, at_s, violations):
    log: list[Event] = [placed("g", replicas=2, min_runtime_s=60.0, at=h(0))]
    log += [started("g", replica=r, node=f"n{r}", at=h(0) + round(s * 1e6)) for r, s in enumerate(starts)]
    log.append(preempted("g", at=h(0) + round(at_s * 1e6)))
    rep = preemption_report(log)
    assert [(v["job_id"], v["protected_until"]) for v in rep.violations] == violations
