"""Accounting and policy services with fakes (no Kafka, no Redis).

Records are fake kafka-python records carrying encoded events; the Redis
read model is an in-memory fake with the few commands the store uses.
"""

from __future__ import annotations

import random

import pytest

from apportion import events
from apportion.clock import ManualClock
from apportion.domain.budgets import fold_budget_log
from apportion.domain.occupancy import rebuild as rebuild_ledger
from apportion.domain.usage import usage_snapshot
from apportion.events import BudgetRejected, DeadLetter, FairShareRanking, OccupancySnapshot
from apportion.timeutil import from_us
from services.accounting import logic as acc_logic
from services.accounting.config import AccountingSettings
from services.accounting.service import AccountingService
from services.accounting.store import ReadModelStore
from services.policy import logic as pol_logic
from services.policy.service import PolicyService
from tests.kit.builders import budget_set, completed, h, node, placed
from tests.kit.fakes import FakeRedis, Rec, records

WINDOW_S = 24 * 3600.0


# The cluster of these tests:
#
#   lab (1.0)
#   ├── a  0.75      2 nodes x 8 GPUs from T0
#   └── b  0.25
LOG = [
    budget_set("lab", 1.0, at=h(0)),
    budget_set("lab/a", 0.75, at=h(0)),
    budget_set("lab/b", 0.25, at=h(0)),
    node("n0", 8, at=h(0)),
    node("n1", 8, at=h(0)),
    placed("j1", budget="lab/a", gpus=8, at=h(1)),
    placed("j2", budget="lab/b", gpus=4, at=h(2)),
    placed("u1", budget="lab/b", gpus=4, allocated=False, at=h(2)),
    completed("j1", at=h(5)),
    completed("u1", at=h(6)),
]


def bare(snap: OccupancySnapshot) -> OccupancySnapshot:
    """``snap`` without its input position (a rebuild has none)."""
    return snap.model_copy(update={"inputs": None})


def bulk(evs, at_us: int) -> OccupancySnapshot:
    """The reference: a bulk rebuild of ``evs`` in event-time order evaluated at ``at_us``."""
    evs = sorted(evs, key=lambda e: events.to_dict(e)["ts"])
    return usage_snapshot(fold_budget_log(evs), rebuild_ledger(evs, WINDOW_S), at_us, producer="accounting")


def make_accounting(clock=None):
    published: list = []
    redis = FakeRedis()
    svc = AccountingService(
        AccountingSettings(window_s=WINDOW_S, snapshot_interval_s=3600),
        clock or ManualClock(from_us(h(7))),
        published.append,
        ReadModelStore(redis),
    )
    return svc, published, redis


def test_bootstrap_snapshot_and_read_model_equal_bulk_rebuild():
    svc, published, redis = make_accounting()
    snap = svc.bootstrap(records(LOG))
    ref = bulk(LOG, h(6))
    assert snap.inputs == dict(svc.offsets)  # the position it had read, for audit verify
    assert bare(snap) == ref
    assert published == [snap]
    a = next(u for u in snap.budgets if u.path == "lab/a")
    assert a.occupancy_gpu_s == 8 * 4 * 3600  # j1: 8 GPUs for 4 h
    b = next(u for u in snap.budgets if u.path == "lab/b")
    assert b.occupancy_gpu_s == 4 * 4 * 3600 and b.unallocated_gpu_s == 4 * 4 * 3600
    meta, rows = ReadModelStore(redis).read()
    assert meta is not None
    assert meta["capacity_gpu_s"] == snap.capacity_gpu_s and meta["at"] == snap.at.isoformat()
    assert rows["lab/a"]["occupancy_gpu_s"] == a.occupancy_gpu_s
    # K = 16 GPUs x 6 h; r_a = 32 GPU-h / (0.75 K) = 0.44 < r_b = 16 GPU-h / (0.25 K) = 0.67
    assert rows["lab/a"]["rank"] == 0 and rows["lab/b"]["rank"] == 1
    assert rows["lab"]["rank"] is None
    assert meta["offsets"]  # processed offsets are stored with the snapshot


def test_live_ingest_with_duplicates_and_shuffled_topics_equals_bulk():
    svc, published, _ = make_accounting()
    svc.bootstrap([])
    recs = records(LOG)
    batch = recs + recs  # every record twice
    random.Random(7).shuffle(batch)  # batches are sorted into log order by the service
    svc.ingest(batch)
    assert svc.dirty
    snap = svc.snapshot_now()
    assert bare(snap) == bulk(LOG, h(6))


def test_undecodable_record_is_dead_lettered_and_processing_goes_on():
    svc, published, _ = make_accounting()
    bad = Rec("apportion.jobs", 0, 99, b"j9", b"{not json")
    svc.bootstrap(records(LOG) + [bad])
    letters = [e for e in published if isinstance(e, DeadLetter)]
    assert len(letters) == 1 and letters[0].source_offset == 99
    assert letters[0].event_id == events.det_id("DeadLetter", "apportion.jobs", 0, 99)
    assert bare(published[-1]) == bulk(LOG, h(6))


def test_periodic_snapshot_slides_the_window():
    clock = ManualClock(from_us(h(6)))
    svc, published, _ = make_accounting(clock)
    svc.bootstrap(records(LOG))
    assert svc.due() is None  # the grid point h(6) was just published
    clock.set(from_us(h(9) + 5))
    at = svc.due()
    assert at == h(9)
    snap = svc.snapshot_now(at)
    assert bare(snap) == bulk(LOG, h(9))


PERIODIC_CASES = [
    # id, last, now, ledger clock, interval, expected
    ("nothing folded yet", None, 100, None, 10, None),
    ("first grid point", None, 105_000_000, 1, 10, 100_000_000),
    ("already published this point", 100_000_000, 105_000_000, 1, 10, None),
    ("grid point before the ledger clock", None, 105_000_000, 101_000_000, 10, None),
    ("disabled", None, 105_000_000, 1, 0, None),
]


@pytest.mark.parametrize("case_id,last,now,clock,interval,expected", PERIODIC_CASES, ids=[c[0] for c in PERIODIC_CASES])
def test_periodic_due(case_id, last, now, clock, interval, expected):
    assert acc_logic.periodic_due(last, now, clock, interval) == expected


# --------------------------------------------------------------------------- policy


def test_policy_rejects_invalid_change_once_and_tree_matches_fold_budget_log():
    over = budget_set("lab/c", 0.5, at=h(1))  # 0.75 + 0.25 + 0.5 > 1
    orphan = budget_set("nope/x", 0.5, at=h(1))
    log = LOG[:3] + [over, orphan]
    published: list = []
    svc = PolicyService(ManualClock(from_us(h(2))), published.append)
    svc.fold(records(log, partitions=1))
    out = svc.flush()
    rej = [e for e in out if isinstance(e, BudgetRejected)]
    assert [(r.path, r.reason) for r in rej] == [("lab/c", "over_allocated"), ("nope/x", "no_parent")]
    assert svc.state.tree == fold_budget_log(log)
    assert [r.path for r in next(e for e in out if isinstance(e, FairShareRanking)).budgets] == ["lab/a", "lab/b"]
    # nothing new to say: no second publication
    assert svc.flush() == []

    # restart: the log now holds the rejections after the changes; none is repeated
    svc2 = PolicyService(ManualClock(from_us(h(3))), published.append)
    svc2.fold(records(log + rej, partitions=1))
    again = svc2.flush()
    assert not [e for e in again if isinstance(e, BudgetRejected)]
    assert svc2.state.tree == svc.state.tree


def _batch(*sets: tuple[str, float], removes: tuple[str, ...] = ()) -> events.BudgetBatch:
    return events.BudgetBatch(
        sets=tuple(events.BudgetSpec(path=p, share=x) for p, x in sets), removes=removes, ts=from_us(h(1))
    )


def test_policy_accepts_a_batch_valid_only_as_a_whole_and_rejects_a_bad_one_whole_naming_each_path():
    # lab: a 0.75 -> 0.5 with b 0.25 -> 0.5 (valid together; b alone first would sum to 1.25)
    move = _batch(("lab/b", 0.5), ("lab/a", 0.5))
    # b 0.5 -> 0.6 is over-full beside a 0.5, and nope/x has no parent: rejected whole, a is not touched
    bad = _batch(("lab/a", 0.4), ("lab/b", 0.7), ("nope/x", 0.5))
    svc = PolicyService(ManualClock(from_us(h(2))), [].append)
    svc.fold(records(LOG[:3] + [move, bad], partitions=1))
    out = svc.flush()
    [rej] = [e for e in out if isinstance(e, BudgetRejected)]
    assert rej.rejected_event_id == bad.event_id
    assert (rej.path, rej.reason) == ("nope/x", "no_parent")  # the first failure
    assert [(f.path, f.reason) for f in rej.failures] == [
        ("nope/x", "no_parent"),
        ("lab/a", "over_allocated"),
        ("lab/b", "over_allocated"),
    ]
    assert rej.message == (
        "nope/x: no_parent: parent budget 'nope' of 'nope/x' does not exist; "
        "lab/a: over_allocated: shares under 'lab' would sum to 1.1 > 1; "
        "lab/b: over_allocated: shares under 'lab' would sum to 1.1 > 1"
    )
    tree = svc.state.tree
    assert (tree.share("lab/a"), tree.share("lab/b"), "nope/x" in tree) == (0.5, 0.5, False)
    assert tree == fold_budget_log(LOG[:3] + [move, bad])  # every reader's fold agrees without the rejection
    assert tree == fold_budget_log(LOG[:3] + [move, bad, rej])


def test_policy_ranking_follows_newest_snapshot():
    svc = PolicyService(ManualClock(from_us(h(7))), lambda e: None)
    svc.fold(records(LOG[:3], partitions=1))
    svc.flush()
    old = bulk(LOG[:8], h(3))  # a and b both busy
    new = bulk(LOG, h(6))
    svc.fold(records([new, old], partitions=1))  # an older snapshot after the newer: ignored
    (rank,) = svc.flush()
    assert rank.at == new.at
    assert [(b.path, b.rank) for b in rank.budgets] == [("lab/a", 0), ("lab/b", 1)]
    ratios = {b.path: b.ratio for b in rank.budgets}
    snap_r = {u.path: u.ratio for u in new.budgets}
    assert ratios == {p: snap_r[p] for p in ("lab/a", "lab/b")}


def test_check_budget_event_skips_invalid_and_keeps_tree():
    t0 = fold_budget_log(LOG[:3])
    t1, rej = pol_logic.check_budget_event(t0, budget_set("lab/b", 0.5, at=h(1)))
    assert rej is not None and rej.reason == "over_allocated" and t1 == t0
    t2, rej2 = pol_logic.check_budget_event(t0, budget_set("lab/b", 0.2, at=h(1)))
    assert rej2 is None and t2.share("lab/b") == 0.2


def test_policy_flags_for_membership_and_faust_dir():
    from services.policy.__main__ import parse_args
    from services.policy.config import PolicySettings

    assert parse_args(["--instance-id", "policy-b", "--faust-dir", "/var/lib/x"]) == {
        "instance_id": "policy-b",
        "faust_dir": "/var/lib/x",
    }
    defaults = PolicySettings(kafka_bootstrap="k:1")
    assert (defaults.group_id, defaults.instance_id, defaults.faust_dir) == ("policy", "policy-0", None)


def test_accounting_folds_a_batch_whole_into_its_tree_and_read_model():
    move = _batch(("lab/b", 0.5), ("lab/a", 0.5))
    acc = acc_logic.rebuild(LOG)
    assert acc.apply(move) is True  # the tree changed: a snapshot is due
    assert (acc.tree.share("lab/a"), acc.tree.share("lab/b")) == (0.5, 0.5)
    assert acc.apply(move) is False  # the same event again: de-duplicated
    bad = _batch(("lab/a", 0.9))
    assert acc.apply(bad) is False and acc.tree.share("lab/a") == 0.5  # invalid as a whole: skipped whole
    snap = acc.snapshot()
    assert snap is not None
    _, rows = acc_logic.read_model(snap, acc.tree, {})
    assert {p: r["share"] for p, r in rows.items()} == {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}


def test_nodes_registering_at_one_instant_across_two_polls_never_reuse_a_snapshot_id():
    # One agent's simulated nodes register with one time stamp T. Polled in two batches, accounting publishes a
    # snapshot at T after each: same capacity integral up to T (0 GPU-s), same rows, 8 then 16 capacity GPUs.
    # They used to share an event id, and the policy (every reader of apportion.usage) dead-lettered the second
    # as "event_id reused" (a fresh stack's one dead letter).
    svc, published, _ = make_accounting(ManualClock(from_us(h(0))))
    first, second = records(LOG[:3] + [node("n0", 8, at=h(0))]), records([node("n1", 8, at=h(0))])
    svc.bootstrap(first)
    second = [Rec(r.topic, r.partition, r.offset + 10, r.key, r.value) for r in second]  # later in the log
    svc.ingest(second)
    svc.snapshot_now()
    snaps = [e for e in published if isinstance(e, OccupancySnapshot)]
    assert [(s.at, s.capacity_gpus, s.capacity_gpu_s) for s in snaps] == [
        (from_us(h(0)), 8, 0.0),
        (from_us(h(0)), 16, 0.0),
    ]
    assert snaps[0].event_id != snaps[1].event_id
    letters: list = []
    policy = PolicyService(ManualClock(from_us(h(0))), letters.append)
    policy.fold(records(snaps, partitions=1))
    assert [e for e in letters if isinstance(e, DeadLetter)] == []
    # and a re-derived snapshot (a restart evaluating the same state at the same instant) keeps its id
    assert svc.acc.snapshot(h(0)).event_id == snaps[1].event_id


def test_accounting_ignores_node_reports_their_node_did_not_sign():
    """A fake 64-GPU node and a forged completion of j1 (signed by eve's key): capacity and occupancy unchanged."""
    from apportion.domain.admission import UNAUTHENTICATED_NODE
    from tests.kit.signing import identity, node_identity

    svc, published, _ = make_accounting()
    fake = events.NodeRegistered(node_id="n9", gpu_count=64, ts=from_us(h(1)), producer="x")
    done = events.JobCompleted(job_id="j1", attempt=1, node_id="n0", ts=from_us(h(2)), producer="node-agent")
    forged = [
        Rec("apportion.nodes", 0, 99, b"n9", node_identity("n1").signed_value(fake)),
        Rec("apportion.jobs", 0, 99, b"j1", identity("eve").signed_value(done)),
    ]
    snap = svc.bootstrap(records(LOG) + forged)
    assert bare(snap) == bulk(LOG, h(6))  # as if the forgeries were not in the log
    letters = [e for e in published if isinstance(e, DeadLetter)]
    assert sorted(e.error.split(":")[0] for e in letters) == [UNAUTHENTICATED_NODE] * 2
    assert svc.intake.stats.unauthenticated_node == 2


def test_the_policy_rejects_a_default_time_limit_above_the_max_in_force():
    t0 = fold_budget_log(LOG[:3])
    bad = budget_set("lab/b", 0.25, at=h(1)).model_copy(
        update={"default_time_limit_s": 7200.0, "max_time_limit_s": 3600.0}
    )
    t1, rej = pol_logic.check_budget_event(t0, bad)
    assert rej is not None and t1 == t0
    assert (rej.reason, rej.message) == (
        "bad_time_limit",
        "default time limit 2h of 'lab/b' is above its max time limit 1h: every job that gives no time limit "
        "would be refused; lower the default or raise the maximum",
    )
    assert fold_budget_log([*LOG[:3], bad]) == t0  # every reader skips it
