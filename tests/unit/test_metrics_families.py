"""Metric families from read-model rows (apportion.metrics): names, labels and hand-computed values.

The tree of the rows below::

    lab (1.0)
    ├── prior (0.6)
    │   └── robotics (0.5)   abs 0.30
    └── vision (0.4)         abs 0.40
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any, Literal

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from apportion import events
from apportion.bus.intake import IntakeStats
from apportion.metrics import (
    BudgetCollector,
    QueueCollector,
    ReaderCollector,
    budget_samples,
    count_preemptions,
    node_samples,
    preemption_metrics,
    queue_samples,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


META = {"at": "2026-01-01T00:00:00+00:00", "window_s": 604800.0, "capacity_gpus": 16, "capacity_gpu_s": 57600.0}
ROWS = {
    "lab": {"path": "lab", "share": 1.0, "abs_share": 1.0, "occupancy_gpu_s": 7200.0, "unallocated_gpu_s": 360.0,
            "entitlement_gpu_s": 57600.0, "ratio": 0.125, "rank": None},
    "lab/vision": {"path": "lab/vision", "share": 0.4, "abs_share": 0.4, "occupancy_gpu_s": 0.0,
                   "unallocated_gpu_s": 0.0, "entitlement_gpu_s": 0.0, "ratio": "Infinity", "rank": 1},
}  # fmt: skip


def test_budget_rows_become_gauges_labelled_by_budget() -> None:
    got = {(s.name, s.labels): s.value for s in budget_samples(META, ROWS)}
    assert got[("apportion_budget_share", (("budget", "lab/vision"),))] == 0.4
    assert got[("apportion_budget_occupancy_gpu_seconds", (("budget", "lab"),))] == 7200.0
    assert got[("apportion_budget_unallocated_occupancy_gpu_seconds", (("budget", "lab"),))] == 360.0
    assert got[("apportion_budget_entitlement_gpu_seconds", (("budget", "lab"),))] == 57600.0
    assert got[("apportion_budget_usage_ratio", (("budget", "lab"),))] == 0.125
    assert math.isinf(got[("apportion_budget_usage_ratio", (("budget", "lab/vision"),))])  # E = 0 < O stored as text
    assert got[("apportion_budget_rank", (("budget", "lab/vision"),))] == 1.0
    assert ("apportion_budget_rank", (("budget", "lab"),)) not in got  # inner budgets have no rank
    assert got[("apportion_cluster_capacity_gpus", ())] == 16.0
    assert got[("apportion_usage_window_seconds", ())] == 604800.0
    assert got[("apportion_usage_snapshot_timestamp_seconds", ())] == T0.timestamp()


def test_no_snapshot_yet_gives_no_cluster_gauges() -> None:
    assert budget_samples(None, {}) == []


def test_budget_collector_reports_the_latest_rows_and_forgets_removed_budgets() -> None:
    reg = CollectorRegistry()
    c = BudgetCollector()
    reg.register(c)
    c.update(META, ROWS)
    assert _scrape(reg)[("apportion_budget_share", (("budget", "lab/vision"),))] == 0.4
    c.update(META, {"lab": ROWS["lab"]})
    c.update({"at": "yesterday"}, ROWS)  # unreadable: logged, the previous rows stay
    got = _scrape(reg)
    assert ("apportion_budget_share", (("budget", "lab/vision"),)) not in got
    assert got[("apportion_budget_usage_ratio", (("budget", "lab"),))] == 0.125


JOBS = [
    {"budget": "lab/prior/robotics", "state": "pending", "gpus_per_replica": 4, "replicas": 2},
    {"budget": "lab/prior/robotics", "state": "running", "gpus_per_replica": 2, "replicas": 1},
    {"budget": "lab/vision", "state": "placed", "gpus_per_replica": 8, "replicas": 1},
    {"budget": "lab/vision", "state": "completed", "gpus_per_replica": 8, "replicas": 1},
]


@pytest.mark.parametrize(
    ("budget", "pending_jobs", "pending_gpus", "running_jobs", "running_gpus"),
    [
        pytest.param("lab/prior/robotics", 1, 8, 1, 2, id="leaf: a 2x4 gang pending, a 1x2 running"),
        pytest.param("lab/prior", 1, 8, 1, 2, id="parent counts its leaf"),
        pytest.param("lab", 1, 8, 2, 10, id="root counts everything; placed holds GPUs"),
        pytest.param("lab/vision", 0, 0, 1, 8, id="a completed job counts nowhere"),
        pytest.param("lab/idle", 0, 0, 0, 0, id="a budget without jobs is reported as 0"),
    ],
)
def test_queue_gauges_count_jobs_and_gpus_of_the_budget_and_below(
    budget: str, pending_jobs: int, pending_gpus: int, running_jobs: int, running_gpus: int
) -> None:
    got = {(s.name, s.labels): s.value for s in queue_samples(JOBS, ["lab/idle"])}
    lab = (("budget", budget),)
    assert (
        got[("apportion_budget_pending_jobs", lab)],
        got[("apportion_budget_pending_gpus", lab)],
        got[("apportion_budget_running_jobs", lab)],
        got[("apportion_budget_running_gpus", lab)],
    ) == (pending_jobs, pending_gpus, running_jobs, running_gpus)


NODES: list[dict[str, Any]] = [
    {"node_id": "n2", "state": "cordoned", "gpu_count": 8, "free_gpus": 3, "gpu_model": "a100",
     "last_heartbeat": "2026-01-01T00:00:00+00:00"},
    {"node_id": "n1", "state": "ready", "gpu_count": 4, "free_gpus": 4, "gpu_model": None, "last_heartbeat": None},
]  # fmt: skip


def test_node_gauges_the_current_state_gpus_model_and_the_heartbeat_age() -> None:
    from datetime import timedelta

    got = {(s.name, s.labels): s.value for s in node_samples(NODES, T0 + timedelta(seconds=12.5))}
    states = {lab: v for (name, lab), v in got.items() if name == "apportion_node_state"}
    assert states == {(("node", "n1"), ("state", "ready")): 1.0, (("node", "n2"), ("state", "cordoned")): 1.0}
    assert got[("apportion_node_gpus", (("node", "n2"),))] == 8.0
    assert got[("apportion_node_free_gpus", (("node", "n2"),))] == 3.0
    assert got[("apportion_node_info", (("node", "n2"), ("model", "a100")))] == 1.0
    assert got[("apportion_node_info", (("node", "n1"), ("model", "")))] == 1.0
    assert got[("apportion_node_heartbeat_age_seconds", (("node", "n2"),))] == 12.5
    assert ("apportion_node_heartbeat_age_seconds", (("node", "n1"),)) not in got  # never heard from
    early = {(s.name, s.labels): s.value for s in node_samples(NODES, T0 - timedelta(seconds=3))}
    assert early[("apportion_node_heartbeat_age_seconds", (("node", "n2"),))] == 0.0  # never negative


def test_queue_collector_takes_fresher_heartbeats_than_its_rows() -> None:
    from datetime import timedelta

    reg = CollectorRegistry()
    c = QueueCollector(lambda: T0 + timedelta(seconds=30))
    reg.register(c)
    c.update({}, {n["node_id"]: n for n in NODES}, ["lab"])
    assert _scrape(reg)[("apportion_node_heartbeat_age_seconds", (("node", "n2"),))] == 30.0
    c.heartbeats({"n2": "2026-01-01T00:00:25+00:00"})
    assert _scrape(reg)[("apportion_node_heartbeat_age_seconds", (("node", "n2"),))] == 5.0


def test_reader_collector_sums_its_sources_and_reports_lag_per_partition() -> None:
    from apportion.bus.consumer import Stats

    reg = CollectorRegistry()
    a = IntakeStats(events=5, duplicates=1, dead_lettered=2)
    b = Stats(handled=3, duplicates=0, dead_lettered=1)
    c = ReaderCollector(lambda: a)
    c.watch(lambda: b)
    reg.register(c)
    c.set_lag({("apportion.jobs", 0): 7, ("apportion.jobs", 1): 0})
    got = _scrape(reg)
    assert got[("apportion_events_handled_total", ())] == 8.0
    assert got[("apportion_duplicates_total", ())] == 1.0
    assert got[("apportion_dead_letters_total", ())] == 3.0
    assert got[("apportion_consumer_lag_records", (("partition", "0"), ("topic", "apportion.jobs")))] == 7.0
    assert got[("apportion_consumer_lag_records", (("partition", "1"), ("topic", "apportion.jobs")))] == 0.0


def _preempted(
    budget: str,
    lost: float | None,
    victim_rule: Literal["unallocated", "expired_behind"] | None,
    reason: str = "preempted",
) -> events.Event:
    victim = (
        events.Victim(job_id="v", attempt=1, budget=budget, allocated=True, gpus=4, rule=victim_rule)
        if victim_rule
        else None
    )
    return events.JobPreempted(
        ts=T0, producer="dispatcher", job_id="v", attempt=1, budget=budget, allocated=True,
        by_job_id="p" if victim else None, victim=victim, reason=reason, lost_gpu_s=lost,
    )  # fmt: skip


def test_preemptions_are_counted_by_budget_and_reason_with_their_work_lost() -> None:
    reg = CollectorRegistry()
    m = preemption_metrics(reg)
    count_preemptions(
        m,
        [
            _preempted("lab/vision", 120.0, "expired_behind"),
            _preempted("lab/vision", 30.0, "expired_behind"),
            _preempted("lab/vision", None, None, reason="drain"),
            _preempted("lab/prior/robotics", 0.0, "unallocated"),
            events.JobRequeued(ts=T0, producer="dispatcher", job_id="v", attempt=2, submitted_at=T0, reason="x"),
        ],
    )
    got = _scrape(reg)
    assert got[("apportion_budget_preemptions_total", (("budget", "lab/vision"), ("reason", "expired_behind")))] == 2
    assert got[("apportion_budget_preemptions_total", (("budget", "lab/vision"), ("reason", "drain")))] == 1
    assert (
        got[("apportion_budget_preemptions_total", (("budget", "lab/prior/robotics"), ("reason", "unallocated")))] == 1
    )
    assert got[("apportion_budget_work_lost_gpu_seconds_total", (("budget", "lab/vision"),))] == 150.0


class _FakeKafka:
    """A kafka-python consumer as partition_lag sees it: high watermarks and positions."""

    def __init__(
        self, hw: dict[Any, int | None], pos: dict[Any, int], fail: bool = False, validating: bool = False
    ) -> None:
        self.hw, self.pos, self.fail, self.validating = hw, pos, fail, validating
        self.timeouts: list[int | None] = []

    def highwater(self, tp: Any) -> int | None:
        return self.hw[tp]

    def position(self, tp: Any, timeout_ms: int | None = None) -> int:
        self.timeouts.append(timeout_ms)
        if self.fail:
            raise RuntimeError("partition is being reassigned")
        if self.validating and timeout_ms != 0:
            # kafka-python 3 with a position awaiting KIP-320 validation and the broker away: without a
            # timeout, position() waits for the validation (seen live: the dispatcher's poll thread held
            # there through a 120 s outage and after it, issue 18)
            raise AssertionError(f"position(timeout_ms={timeout_ms}) would wait on the broker")
        return self.pos[tp]


def test_lag_is_high_watermark_minus_position_and_a_failed_measurement_never_fails_the_poll() -> None:
    from kafka import TopicPartition

    from apportion.bus.consumer import LagMeter, partition_lag

    a, b, c = TopicPartition("t", 0), TopicPartition("t", 1), TopicPartition("u", 0)
    kc = _FakeKafka({a: 10, b: None, c: 5}, {a: 7, b: 0, c: 5})
    assert partition_lag(kc, [a, b, c]) == {("t", 0): 3, ("u", 0): 0}  # b: no fetch answered yet
    got: list[dict[tuple[str, int], int]] = []
    meter = LagMeter(every_s=0.0)
    meter.after_poll(kc, lambda: [a])  # no sink yet: nothing measured
    meter.sink = got.append
    meter.after_poll(kc, lambda: [a])
    meter.after_poll(_FakeKafka({a: 1}, {a: 0}, fail=True), lambda: [a])
    assert got == [{("t", 0): 3}]


def test_the_lag_measurement_never_waits_on_the_broker() -> None:
    """The dispatcher measures its lag after every poll (``AssignedConsumer.poll``): a position asked with
    a timeout other than 0 held its loop, so a term that polled on through a broker outage gave no verdict
    after it. Positions are asked with ``timeout_ms=0``; ``commit`` takes the positions known the same way."""
    from kafka import TopicPartition

    from apportion.bus.consumer import AssignedConsumer, partition_lag

    a, b = TopicPartition("t", 0), TopicPartition("t", 1)
    kc = _FakeKafka({a: 10, b: 4}, {a: 7, b: 4}, validating=True)
    assert partition_lag(kc, [a, b]) == {("t", 0): 3, ("t", 1): 0}
    assert kc.timeouts == [0, 0]

    class Committing(_FakeKafka):
        def commit(self, offsets: dict[Any, Any]) -> None:
            self.committed = {tp: o.offset for tp, o in offsets.items()}

    consumer = object.__new__(AssignedConsumer)  # no broker: only the wrapped consumer and its partitions
    consumer._kc = Committing({}, {a: 7, b: 4}, validating=True)
    consumer.partitions = [a, b]
    consumer.commit()
    assert consumer._kc.committed == {a: 7, b: 4} and consumer._kc.timeouts == [0, 0]
