"""Refused starts (rule D3.refused-starts): a start a node agent refuses ends its run at the refusal's event time in
every occupancy reader (``D3.refused-starts``), the job backs off, and a node refusing starts in a row is cordoned.

Given / when / then on the dispatcher's pure ``step`` with event time driven by hand. Tree::

    lab (1.0)
    ├── a  0.5   members: alice
    └── b  0.5

Nodes n0 and n1, 4 GPUs each, registered at T0. Every job is alice's, in ``lab/a``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

from apportion import events as ev
from apportion.audit.config import config_from_event, configured_event
from apportion.audit.explain import explain
from apportion.audit.replay import occupancy_at
from apportion.audit.verify import records_from_events, verify
from apportion.domain.dispatch import (
    NO_ACCOUNT,
    NODE_FAULT_REFUSALS,
    UNDO_ON_REFUSAL,
    DispatchConfig,
    DispatchState,
    Tick,
    fold,
    refusal_backoff_s,
    step,
    wakeups,
)
from apportion.domain.occupancy import OccupancyLedger
from apportion.events import Event
from apportion.report import JobLedger
from apportion.timeutil import US_PER_S, Micros, from_us
from services.accounting import logic as accounting
from services.dispatcher.logic import read_model
from tests.kit.builders import T0, budget_set, completed, failed, s, started, submitted
from tests.kit.domain_dispatch import reg
from tests.kit.narrowing import narrow

CFG = DispatchConfig(heartbeat_timeout_s=None)
K = TypeVar("K", bound=Event)
LEAF = "lab/a"
AT = s(600)  # every reader is asked at T0 + 10 min


def of_kind(kind: type[K], events: Iterable[Event]) -> list[K]:
    return [e for e in events if isinstance(e, kind)]


def refused(job: str, node: str, at: Micros, attempt: int = 1, code: str = "gpus_busy") -> ev.WorkloadRefused:
    """The node agent's refusal of a start."""
    return ev.WorkloadRefused(
        node_id=node,
        job_id=job,
        attempt=attempt,
        reason=f"{code}: refused by the test",
        ts=from_us(at),
        producer="node-agent",
        event_id=ev.det_id("test-refused", job, attempt, node, at),
    )


@dataclass
class Cluster:
    """A dispatcher driven by hand; ``log`` is every input and every decision, in order."""

    cfg: DispatchConfig = CFG
    nodes: tuple[str, ...] = ("n0", "n1")
    state: DispatchState = field(default_factory=DispatchState)
    log: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        for e in (
            budget_set("lab", 1.0),
            budget_set("lab/a", 0.5, members=["alice"]),
            budget_set("lab/b", 0.5),
            *(reg(n) for n in self.nodes),
        ):
            self.feed(e, T0)

    def feed(self, inp: Event | Tick, at: Micros) -> list[Event]:
        out = step(self.state, inp, at, self.cfg)
        if isinstance(inp, Event):
            self.log.append(inp)
        self.log += out
        return out

    def audit_mismatches(self) -> list[str]:
        """``audit verify`` of the log, its dispatcher's configuration recorded first: the mismatches it finds."""
        configured = configured_event(self.cfg, instance="d", fencing_token=None, ts=from_us(T0), producer="dispatcher")
        return [str(m) for m in verify(records_from_events([configured, *self.log]), config=self.cfg).mismatches]

    def placed(self, job: str, attempt: int = 1) -> ev.JobPlaced:
        return next(e for e in of_kind(ev.JobPlaced, self.log) if (e.job_id, e.attempt) == (job, attempt))


# --------------------------------------------------------------------------- occupancy: one rule, every reader


def readers(c: Cluster, at: Micros) -> dict[str, tuple[float, float]]:
    """(O, U) of ``lab/a`` at ``at`` in GPU-seconds, as each reader of the log computes it."""

    def rows(snap: ev.OccupancySnapshot | None) -> tuple[float, float]:
        assert snap is not None
        row = next(u for u in snap.budgets if u.path == LEAF)
        return row.occupancy_gpu_s, row.unallocated_gpu_s

    def ledger(led: OccupancyLedger) -> tuple[float, float]:
        return led.occupancy(at).get(LEAF, 0.0), led.unallocated(at).get(LEAF, 0.0)

    live = accounting.Accounting()
    for e in c.log:
        live.apply(e)
    return {
        "dispatcher (its live state)": ledger(c.state.ledger),
        "dispatcher (recovered from the log)": ledger(fold(c.log).ledger),
        "accounting (live fold)": rows(live.snapshot(at)),
        "accounting (rebuild)": rows(accounting.rebuild(c.log).snapshot(at)),
        "audit (occupancy at T)": rows(occupancy_at(c.log, at)[0]),
        # the simulator folds its log into an OccupancyLedger (Simulator.total) and a DispatchState, as above
        "simulator (its totals ledger)": ledger(OccupancyLedger(10 * 365 * 86400).apply_all(c.log)),
    }


def allocated_gang_refused(c: Cluster) -> None:
    # 4 GPUs x 2 replicas placed at 0 s; n1 refuses replica 1 at 60 s; the dispatcher reads it at 300 s
    c.feed(submitted("j1", gpus=4, replicas=2), T0)
    c.feed(Tick(T0), T0)
    node = c.placed("j1").placements[1].node_id
    c.feed(refused("j1", node, s(60)), s(300))


def unallocated_run_refused(c: Cluster) -> None:
    # 2 GPUs, unallocated (min_runtime 0), placed at 0 s, refused at 60 s, read at 90 s
    c.feed(submitted("j1", gpus=2, min_runtime_s=0.0), T0)
    c.feed(Tick(T0), T0)
    c.feed(refused("j1", c.placed("j1").placements[0].node_id, s(60)), s(90))


def one_replica_refused_after_the_other_started(c: Cluster) -> None:
    # replica 0 starts at 10 s; replica 1's node refuses at 60 s; replica 0 is stopped and reports at 70 s
    c.feed(submitted("j1", gpus=4, replicas=2), T0)
    c.feed(Tick(T0), T0)
    p = c.placed("j1").placements
    c.feed(started("j1", replica=0, node=p[0].node_id, at=s(10)), s(10))
    out = c.feed(refused("j1", p[1].node_id, s(60)), s(60))
    assert [e.type for e in out] == ["StopWorkload", "JobRequeued"]
    c.feed(failed("j1", replica=0, node=p[0].node_id, at=s(70)), s(70))


def stale_refusal_of_an_old_attempt(c: Cluster) -> None:
    # attempt 1 refused at 60 s (backoff 30 s); attempt 2 placed at 90 s; then another refusal of attempt 1,
    # stamped 30 s (earlier than the first), read at 120 s: it changes nothing
    c.feed(submitted("j1", gpus=2), T0)
    c.feed(Tick(T0), T0)
    node = c.placed("j1").placements[0].node_id
    c.feed(refused("j1", node, s(60)), s(60))
    c.feed(Tick(s(90)), s(90))
    assert c.placed("j1", 2).ts == from_us(s(90))
    assert c.feed(refused("j1", node, s(30)), s(120)) == []


def gang_refused_for_want_of_an_account(c: Cluster) -> None:
    # replica 0 starts at 10 s; replica 1's node has no account for the user at 60 s (read at 300 s): the job
    # fails at 60 s; replica 0 is stopped and reports at 310 s
    c.feed(submitted("j1", gpus=4, replicas=2), T0)
    c.feed(Tick(T0), T0)
    p = c.placed("j1").placements
    c.feed(started("j1", replica=0, node=p[0].node_id, at=s(10)), s(10))
    out = c.feed(refused("j1", p[1].node_id, s(60), code=NO_ACCOUNT), s(300))
    assert [e.type for e in out] == ["StopWorkload", "JobFailed"]
    c.feed(failed("j1", replica=0, node=p[0].node_id, at=s(310)), s(310))


def refused_then_started_later(c: Cluster) -> None:
    # attempt 1 refused at 60 s; attempt 2 placed at 90 s, started at 95 s, completed at 300 s
    c.feed(submitted("j1", gpus=2), T0)
    c.feed(Tick(T0), T0)
    c.feed(refused("j1", c.placed("j1").placements[0].node_id, s(60)), s(60))
    c.feed(Tick(s(90)), s(90))
    node = c.placed("j1", 2).placements[0].node_id
    c.feed(started("j1", attempt=2, node=node, at=s(95)), s(95))
    c.feed(completed("j1", attempt=2, node=node, at=s(300)), s(300))


@pytest.mark.parametrize(
    "script, expected",
    [
        # 8 GPUs x 60 s (placement to refusal), not to the dispatcher's reading at 300 s (2,400) nor to 600 s
        pytest.param(allocated_gang_refused, (480.0, 0.0), id="allocated gang refused"),
        # 2 GPUs x 60 s, unallocated: U only
        pytest.param(unallocated_run_refused, (0.0, 120.0), id="unallocated run refused"),
        # the whole gang, 8 GPUs x 60 s: the stopped replica's later report does not extend it
        pytest.param(
            one_replica_refused_after_the_other_started, (480.0, 0.0), id="one replica refused after another started"
        ),
        # 2 x 60 (attempt 1) + 2 x (600 - 90) (attempt 2, still running) = 120 + 1,020
        pytest.param(stale_refusal_of_an_old_attempt, (1140.0, 0.0), id="stale refusal of an old attempt"),
        # 2 x 60 (attempt 1) + 2 x (300 - 90) (attempt 2) = 120 + 420
        pytest.param(refused_then_started_later, (540.0, 0.0), id="refused, then a later attempt runs"),
        # 8 GPUs x 60 s: the failure is stamped at the refusal, not at the dispatcher's reading (300 s)
        pytest.param(gang_refused_for_want_of_an_account, (480.0, 0.0), id="failed for want of an account"),
    ],
)
def test_a_refused_start_is_charged_up_to_the_refusal_in_every_reader(
    script: Callable[[Cluster], None], expected: tuple[float, float]
) -> None:
    c = Cluster()
    script(c)
    got = readers(c, AT)
    assert got == dict.fromkeys(got, expected)
    assert c.audit_mismatches() == []  # the audit re-runs every decision of the log, the undo included


def test_the_requeue_records_the_refusal_it_ends_the_run_at() -> None:
    c = Cluster()
    allocated_gang_refused(c)
    requeued = narrow(ev.JobRequeued, c.log[-1])
    assert (requeued.refused_by, requeued.refused_at, requeued.ts) == ("n1", from_us(s(60)), from_us(s(300)))
    assert (requeued.attempt, requeued.reason, requeued.refusals) == (
        2,
        "start refused: gpus_busy: refused by the test",
        1,
    )


def test_a_refusal_stamped_after_the_decision_ends_the_run_at_the_decision() -> None:
    # an agent whose clock runs ahead: the run cannot end after the requeue that ended it
    c = Cluster()
    c.feed(submitted("j1", gpus=2), T0)
    c.feed(Tick(T0), T0)
    c.feed(refused("j1", "n0", s(80)), s(60))
    assert narrow(ev.JobRequeued, c.log[-1]).refused_at == from_us(s(60))
    assert c.state.ledger.occupancy(AT)[LEAF] == 2 * 60.0


def test_the_log_reports_job_hours_end_a_refused_run_at_the_refusal() -> None:
    # the per-budget report (simulator and log alike): one run, placement (0 s) to refusal (60 s)
    c = Cluster()
    allocated_gang_refused(c)
    assert JobLedger().apply_all(c.log).run_hours(AT) == {LEAF: 60 / 3600}


def test_audit_explain_tells_the_refusal_its_charge_and_the_backoff() -> None:
    c = Cluster()
    allocated_gang_refused(c)
    ex = explain(records_from_events(c.log), "j1", CFG)
    requeued = next(e for e in ex.timeline if e.kind == "JobRequeued")
    assert requeued.summary == (
        "requeued as attempt 2 (start refused: gpus_busy: refused by the test), keeping submitted_at 2024-01-01T00:00:00+00:00; "
        "n1 refused attempt 1, charged until 2024-01-01T00:01:00+00:00; "
        "refusal 1: not placed before 2024-01-01T00:05:30+00:00"
    )


# --------------------------------------------------------------------------- backoff


@pytest.mark.parametrize(
    "refusals, seconds",
    [(0, 0.0), (1, 30.0), (2, 60.0), (3, 120.0), (4, 240.0), (5, 480.0), (6, 900.0), (40, 900.0), (10_000, 900.0)],
)
def test_the_backoff_is_30_s_doubled_per_refusal_capped_at_15_min(refusals: int, seconds: float) -> None:
    assert refusal_backoff_s(refusals, CFG) == seconds


def test_no_backoff_when_it_is_off() -> None:
    off = DispatchConfig(heartbeat_timeout_s=None, refusal_backoff_s=0.0)
    assert refusal_backoff_s(3, off) == 0.0
    c = Cluster(cfg=off)
    c.feed(submitted("j1", gpus=2), T0)
    c.feed(Tick(T0), T0)
    c.feed(refused("j1", "n0", s(60)), s(60))
    assert narrow(ev.JobRequeued, c.log[-1]).not_before is None
    assert [e.type for e in c.feed(Tick(s(60)), s(60))] == ["JobPlaced", "StartWorkload"]


def test_a_refused_job_waits_out_its_backoff_and_says_why() -> None:
    c = Cluster()
    c.feed(submitted("j1", gpus=2), T0)
    c.feed(Tick(T0), T0)
    c.feed(refused("j1", "n0", s(60)), s(60))
    requeued = narrow(ev.JobRequeued, c.log[-1])
    assert requeued.not_before == from_us(s(90))
    assert s(90) in wakeups(requeued, CFG)  # the simulator ticks when the backoff ends
    assert c.feed(Tick(s(89)), s(89)) == []
    jobs, _ = read_model(c.state, s(70), CFG)
    assert jobs["j1"]["reason"] == (
        "refused_backoff: node n0 refused its start (start refused: gpus_busy: refused by the test; 1 refused so far); "
        "it may be placed again from 2024-01-01 00:01:30 UTC"
    )
    assert jobs["j1"]["reason_detail"] == {
        "kind": "refused_backoff",
        "text": jobs["j1"]["reason"],
        "node_id": "n0",
        "refusal": "start refused: gpus_busy: refused by the test",
        "refusals": 1,
        "until": "2024-01-01T00:01:30+00:00",
    }
    assert [e.type for e in c.feed(Tick(s(90)), s(90))] == ["JobPlaced", "StartWorkload"]
    # refused again: twice as long, from the second decision
    c.feed(refused("j1", c.placed("j1", 2).placements[0].node_id, s(100), attempt=2), s(100))
    again = narrow(ev.JobRequeued, c.log[-1])
    assert (again.attempt, again.refusals, again.not_before) == (3, 2, from_us(s(160)))


def test_other_jobs_are_placed_while_one_backs_off() -> None:
    c = Cluster()
    c.feed(submitted("j1", gpus=2), T0)
    c.feed(Tick(T0), T0)
    c.feed(refused("j1", "n0", s(60)), s(60))
    c.feed(submitted("j2", gpus=2, at=s(61)), s(61))
    out = c.feed(Tick(s(62)), s(62))
    assert [getattr(e, "job_id", "") for e in of_kind(ev.JobPlaced, out)] == ["j2"]


# --------------------------------------------------------------------------- cordon


def _refuse_one_start(c: Cluster, job: str, at: Micros, code: str = "gpus_busy") -> list[Event]:
    c.feed(submitted(job, gpus=4, at=at), at)
    c.feed(Tick(at), at)
    p = c.placed(job)
    return c.feed(refused(job, p.placements[0].node_id, at, code=code), at)


def test_a_node_refusing_three_starts_in_a_row_is_cordoned_with_the_refusal() -> None:
    c = Cluster(nodes=("n0",))
    assert [e.type for e in _refuse_one_start(c, "j1", s(1))] == ["JobRequeued"]
    assert [e.type for e in _refuse_one_start(c, "j2", s(2))] == ["JobRequeued"]
    out = _refuse_one_start(c, "j3", s(3))
    assert [e.type for e in out] == ["JobRequeued", "NodeCordoned"]
    cordon = narrow(ev.NodeCordoned, out[1])
    assert (cordon.node_id, cordon.by, cordon.producer) == ("n0", "dispatcher", "dispatcher")
    assert cordon.reason == "refused 3 starts in a row, the last j3#1: gpus_busy: refused by the test"
    assert c.state.cluster.nodes["n0"].state == "cordoned"
    assert fold(c.log).cluster.nodes["n0"].state == "cordoned"  # a replay agrees
    assert c.feed(Tick(s(600)), s(600)) == []  # nothing lands there any more


@pytest.mark.parametrize("code", sorted(UNDO_ON_REFUSAL - NODE_FAULT_REFUSALS - {NO_ACCOUNT}))
def test_refusals_that_are_not_the_nodes_fault_back_off_but_never_cordon(code: str) -> None:
    # e.g. before_registration: commands queued while the agent restarted, refused at once when it is back
    c = Cluster(nodes=("n0",))
    for i in range(4):
        out = _refuse_one_start(c, f"j{i}", s(i + 1), code=code)
        assert [e.type for e in out] == ["JobRequeued"]
        assert narrow(ev.JobRequeued, out[0]).not_before == from_us(s(i + 1 + 30))
    assert c.state.node_refusals == {} and c.state.cluster.nodes["n0"].state == "ready"


def test_the_nodes_faults_are_refusals_that_undo_a_start() -> None:
    assert NODE_FAULT_REFUSALS == {"gpus_busy", "unknown_gpus", "cannot_isolate"}
    assert NODE_FAULT_REFUSALS <= UNDO_ON_REFUSAL and NO_ACCOUNT in UNDO_ON_REFUSAL - NODE_FAULT_REFUSALS


NO_CAROL = "no_account: no Unix account 'carol' for user 'carol' on node n0"


def test_a_start_refused_for_want_of_an_account_fails_the_job_with_the_agents_reason() -> None:
    """The user has no account on the node: no retry can outrun that, so the job fails (no backoff, no
    requeue, no cordon), at the refusal's event time, the agent's reason and node in the failure."""
    c = Cluster(nodes=("n0",))
    c.feed(submitted("j1", gpus=4), T0)
    c.feed(Tick(T0), T0)
    refusal = refused("j1", "n0", s(60), code=NO_ACCOUNT).model_copy(update={"reason": NO_CAROL})
    out = c.feed(refusal, s(65))
    fail = narrow(ev.JobFailed, out[0])
    assert len(out) == 1
    assert (fail.job_id, fail.attempt, fail.replica, fail.node_id, fail.reason, fail.ts, fail.producer) == (
        "j1", 1, None, "n0", NO_CAROL, from_us(s(60)), "dispatcher"
    )  # fmt: skip
    assert "j1" not in c.state.jobs and "j1" not in c.state.backoff and c.state.node_refusals == {}
    assert c.feed(Tick(s(100)), s(100)) == []  # never placed again
    assert c.feed(refusal, s(70)) == []  # the same refusal again: nothing more
    assert c.audit_mismatches() == []


def test_a_log_whose_dispatcher_requeued_no_account_refusals_is_re_run_as_it_decided() -> None:
    """A dispatcher recorded before the rule (``fail_on_no_account``, ``refusal_detail`` False in its
    ``DispatcherConfigured``) requeued such a start with the code only; the audit re-runs it so."""
    old = DispatchConfig(heartbeat_timeout_s=None, fail_on_no_account=False, refusal_detail=False)
    c = Cluster(cfg=old, nodes=("n0",))
    c.feed(submitted("j1", gpus=4), T0)
    c.feed(Tick(T0), T0)
    out = c.feed(refused("j1", "n0", s(60), code=NO_ACCOUNT), s(60))
    assert [(e.type, getattr(e, "reason", None)) for e in out] == [("JobRequeued", "start refused: no_account")]
    assert c.audit_mismatches() == []


def test_a_start_on_the_node_breaks_the_row() -> None:
    c = Cluster(nodes=("n0",))
    _refuse_one_start(c, "j1", s(1))
    _refuse_one_start(c, "j2", s(2))
    c.feed(submitted("ok", gpus=1, at=s(3)), s(3))
    c.feed(Tick(s(3)), s(3))
    c.feed(started("ok", node="n0", at=s(4)), s(4))
    assert c.state.node_refusals == {}
    c.feed(completed("ok", node="n0", at=s(4.5)), s(4.5))
    _refuse_one_start(c, "j3", s(5))
    out = _refuse_one_start(c, "j4", s(6))
    assert [e.type for e in out] == ["JobRequeued"] and c.state.node_refusals == {"n0": 2}


def test_an_uncordon_gives_the_node_a_fresh_count_and_the_rule_can_be_off() -> None:
    c = Cluster(nodes=("n0",))
    for i in range(3):
        _refuse_one_start(c, f"j{i}", s(i + 1))
    c.feed(ev.NodeUncordoned(node_id="n0", ts=from_us(s(10)), producer="cli/root"), s(10))
    assert c.state.node_refusals == {} and c.state.cluster.nodes["n0"].state == "ready"
    never = Cluster(cfg=DispatchConfig(heartbeat_timeout_s=None, cordon_after_refusals=None), nodes=("n0",))
    for i in range(5):
        assert "NodeCordoned" not in [e.type for e in _refuse_one_start(never, f"j{i}", s(i + 1))]


def test_the_refusal_settings_are_recorded_with_the_dispatchers_configuration() -> None:
    cfg = DispatchConfig(refusal_backoff_s=10.0, refusal_backoff_cap_s=120.0, cordon_after_refusals=5)
    rec = configured_event(cfg, instance="d1", fencing_token=1, ts=from_us(T0), producer="dispatcher")
    assert (rec.refusal_backoff_s, rec.refusal_backoff_cap_s, rec.cordon_after_refusals) == (10.0, 120.0, 5)
    back = config_from_event(rec)
    assert (back.refusal_backoff_s, back.refusal_backoff_cap_s, back.cordon_after_refusals) == (10.0, 120.0, 5)
    # a record from before the settings existed: those dispatchers neither backed off nor cordoned
    old = ev.decode(
        ev.encode(rec).replace(b'"refusal_backoff_s":10.0,', b"").replace(b',"cordon_after_refusals":5', b"")
    )
    old_cfg = config_from_event(narrow(ev.DispatcherConfigured, old))
    assert (old_cfg.refusal_backoff_s, old_cfg.cordon_after_refusals) == (0.0, None)


# --------------------------------------------------------------------------- the storm


def storm(cfg: DispatchConfig) -> tuple[Cluster, list[Micros]]:
    """One node whose agent refuses every start one tick (0.2 s) after the placement, one waiting unallocated
    job, and the live loop's 0.2 s ticks for 10 minutes; returns the cluster and the placement times."""
    c = Cluster(cfg=cfg, nodes=("n0",))
    c.feed(submitted("j1", gpus=2, min_runtime_s=0.0), T0)
    attempts: list[Micros] = []
    answers: list[ev.StartWorkload] = []
    tick = s(0.2) - T0
    for now in range(T0, s(600) + 1, tick):
        for start in answers:
            c.feed(refused(start.job_id, start.node_id, now, attempt=start.attempt), now)
        answers = of_kind(ev.StartWorkload, c.feed(Tick(now), now))
        attempts += [now for _ in answers]
    return c, attempts


def test_a_node_that_always_refuses_gets_attempts_the_backoff_allows_and_is_cordoned() -> None:
    # attempt n+1 is placed at the first tick at or after its refusal (attempt n's time + 0.2 s) plus
    # 30 s x 2^(n-1): 0, 0.2 + 30, 30.2 + 0.2 + 60 s; the third refusal cordons the node: nothing lands there again
    c, attempts = storm(CFG)
    assert [(t - T0) / US_PER_S for t in attempts] == [0.0, 30.2, 90.4]
    assert c.state.cluster.nodes["n0"].state == "cordoned"
    assert c.state.ledger.unallocated_us(AT)[LEAF] == 3 * 2 * (s(0.2) - T0)  # 2 GPUs x 0.2 s per attempt
    assert c.audit_mismatches() == []
    # without the cordon the backoff alone bounds it: 90.4 + 0.2 + 120, + 0.2 + 240 s (the next would be 931 s)
    c, attempts = storm(DispatchConfig(heartbeat_timeout_s=None, cordon_after_refusals=None))
    assert [(t - T0) / US_PER_S for t in attempts] == [0.0, 30.2, 90.4, 210.6, 450.8]
    assert c.state.cluster.nodes["n0"].state == "ready"
    assert narrow(ev.JobRequeued, c.log[-1]).not_before == from_us(s(451 + 480))
    assert c.state.ledger.unallocated_us(AT)[LEAF] == 5 * 2 * (s(0.2) - T0)
