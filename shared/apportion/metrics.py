"""Prometheus metric families of every service, in one place (``docs/metrics.md`` lists them all).

Conventions (Prometheus' own): base units in the name (``_seconds``,
``_gpu_seconds``, ``_gpus``, ``_records``, ``_bytes``), counters end in
``_total`` (``prometheus_client`` appends it to the names given here),
ratios are plain numbers in [0, 1] (``share``) or >= 0 (``usage_ratio``,
``+Inf`` when E = 0 < O). Labels are bounded: ``budget`` (a path of the budget
tree), ``node`` (a node id), ``state`` (the five node states), ``reason``
(a preemption reason or rule), ``topic``/``partition`` (the registry's
topics), ``model`` (a GPU model), ``type`` (an event or command type),
``user`` (a user with usage in the trailing window: one who has none left
drops out), ``kind`` (``allocated`` or ``unallocated``). No label ever carries
a job id.

Three kinds of families:

* **per service**, updated as the service works: counters and histograms
  (``*_metrics(registry)`` below, one function per service, so each
  family is defined once); the reader-edge counters and consumer lag of
  :class:`ReaderCollector`; the process metrics of ``prometheus_client``'s
  default collectors (:func:`add_process_collectors`).
* **per budget**, from the rows accounting writes to ``apportion:rm:budgets``
  (:class:`BudgetCollector`, samples by :func:`budget_samples`) and from the
  rows the dispatcher writes to ``apportion:rm:jobs`` (:class:`QueueCollector`,
  :func:`queue_samples`): a scrape reports exactly what the read model holds,
  so ``apportion share --json`` and ``/metrics`` cannot disagree;
* **per user**, from accounting's per-user fold
  (:class:`apportion.domain.user_usage.UserUsageFold`, samples by
  :func:`user_samples`) at the time of the budget rows: the figures of
  ``apportion share --users``.
* **per node**, from the dispatcher's ``apportion:rm:nodes`` rows
  (:func:`node_samples`), the heartbeat age measured on the service's clock.

The sample functions are pure (rows in, ``(name, labels, value)`` out) so the
tests check them with hand-computed values; the collectors only hold the
latest rows and turn them into families at scrape time. Nothing here runs or
connects at import time.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, NamedTuple

from apportion.domain.budgets import ancestors_of

log = logging.getLogger(__name__)

__all__ = [
    "Sample",
    "budget_samples",
    "user_samples",
    "queue_samples",
    "node_samples",
    "BudgetCollector",
    "QueueCollector",
    "ReaderCollector",
    "add_process_collectors",
    "accounting_metrics",
    "dispatcher_metrics",
    "policy_metrics",
    "node_agent_metrics",
    "preemption_metrics",
    "count_preemptions",
]

#: Job states whose GPUs count as held by the job (the dispatcher's read model ``state`` field).
HOLDING_STATES = ("placed", "running", "stopping", "preempting")


class Sample(NamedTuple):
    """One sample of a gauge family: ``name{labels} value`` (a tuple: scrapes of large clusters build many)."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


#: name -> help of the per-budget and per-node gauges (the collectors describe them with it).
HELP: dict[str, str] = {
    "apportion_budget_share": "Share of the budget, a fraction of its parent (0, 1]",
    "apportion_budget_abs_share": "Absolute share: product of the shares on the budget's path",
    "apportion_budget_occupancy_gpu_seconds": "Allocated occupancy O over the trailing window (budget and below)",
    "apportion_budget_unallocated_occupancy_gpu_seconds": "Unallocated occupancy U over the trailing window",
    "apportion_budget_entitlement_gpu_seconds": "Entitlement E = abs_share x capacity integral over the window",
    "apportion_budget_usage_ratio": "Usage ratio r = O / E (0 when both are 0, +Inf when E = 0 < O)",
    "apportion_budget_rank": "Fair-share rank of a leaf budget (0 is served first)",
    "apportion_user_occupancy_gpu_seconds": (
        "GPU-seconds a user's runs held under a leaf budget over the trailing window, by kind (allocated: the "
        "user's part of the budget's O; unallocated: of its U); users with usage in the window only"
    ),
    "apportion_usage_window_seconds": "Length W of the trailing occupancy window",
    "apportion_cluster_capacity_gpus": "GPUs on ready and draining nodes at the last snapshot",
    "apportion_cluster_capacity_gpu_seconds": "Capacity integral K over the trailing window at the last snapshot",
    "apportion_usage_snapshot_timestamp_seconds": "Event time of the snapshot the budget rows are from (Unix)",
    "apportion_budget_pending_jobs": "Pending jobs charged to the budget or below",
    "apportion_budget_pending_gpus": "GPUs asked for by the pending jobs of the budget or below (g x k)",
    "apportion_budget_running_jobs": "Jobs of the budget or below holding GPUs (placed, running, stopping)",
    "apportion_budget_running_gpus": "GPUs held by the jobs of the budget or below",
    "apportion_node_state": "1, labelled with the node's current state (ready, cordoned, draining, drained, lost)",
    "apportion_node_gpus": "GPUs of the node",
    "apportion_node_free_gpus": "GPUs of the node not held by any run",
    "apportion_node_info": "1 per node, with its GPU model as a label",
    "apportion_node_heartbeat_age_seconds": "Event seconds since the node's last heartbeat (or registration)",
}


def _ratio(v: Any) -> float:
    if v in ("Infinity", "inf"):
        return math.inf
    return float(v or 0.0)


def budget_samples(meta: Mapping[str, Any] | None, rows: Mapping[str, Mapping[str, Any]]) -> list[Sample]:
    """Per-budget gauges from accounting's read model (``apportion:rm:usage`` meta and ``apportion:rm:budgets``).

    Args:
        meta: the usage meta row (``at`` ISO time, ``window_s``, ``capacity_gpus``, ``capacity_gpu_s``),
            or None before the first snapshot.
        rows: path -> row (``share``, ``abs_share``, ``occupancy_gpu_s``, ``unallocated_gpu_s``,
            ``entitlement_gpu_s``, ``ratio``, ``rank``), as :mod:`apportion.readmodel` names them.

    Returns:
        samples in path order; ``apportion_budget_rank`` only for budgets with a rank (leaves).
    """
    out: list[Sample] = []
    if meta:
        if meta.get("window_s") is not None:
            out.append(Sample("apportion_usage_window_seconds", (), float(meta["window_s"])))
        out.append(Sample("apportion_cluster_capacity_gpus", (), float(meta.get("capacity_gpus", 0))))
        out.append(Sample("apportion_cluster_capacity_gpu_seconds", (), float(meta.get("capacity_gpu_s", 0.0))))
        if meta.get("at"):
            at = datetime.fromisoformat(str(meta["at"]))
            out.append(Sample("apportion_usage_snapshot_timestamp_seconds", (), at.timestamp()))
    fields = (
        ("apportion_budget_share", "share"),
        ("apportion_budget_abs_share", "abs_share"),
        ("apportion_budget_occupancy_gpu_seconds", "occupancy_gpu_s"),
        ("apportion_budget_unallocated_occupancy_gpu_seconds", "unallocated_gpu_s"),
        ("apportion_budget_entitlement_gpu_seconds", "entitlement_gpu_s"),
    )
    for path in sorted(rows):
        row = rows[path]
        lab = (("budget", path),)
        out += [Sample(name, lab, float(row.get(key) or 0.0)) for name, key in fields]
        out.append(Sample("apportion_budget_usage_ratio", lab, _ratio(row.get("ratio"))))
        if row.get("rank") is not None:
            out.append(Sample("apportion_budget_rank", lab, float(row["rank"])))
    return out


def user_samples(parts: Mapping[str, Mapping[str, tuple[int, int]]]) -> list[Sample]:
    """Per-user gauges from :meth:`apportion.domain.user_usage.UserUsageFold.parts`.

    Args:
        parts: leaf budget -> user -> (allocated, unallocated) GPU-µs over the window.

    Returns:
        per (budget, user) with usage in the window (either kind above 0), in budget then user order, two
        samples of ``apportion_user_occupancy_gpu_seconds``: ``kind="allocated"``, then ``"unallocated"``.
        A user whose runs all left the window has none (the family's size is bounded by the window).
    """
    out: list[Sample] = []
    for budget in sorted(parts):
        users = parts[budget]
        for user in sorted(users):
            alloc, unalloc = users[user]
            if alloc or unalloc:
                for kind, us in (("allocated", alloc), ("unallocated", unalloc)):
                    lab = (("budget", budget), ("user", user), ("kind", kind))
                    out.append(Sample("apportion_user_occupancy_gpu_seconds", lab, us / 1e6))
    return out


def queue_samples(jobs: Iterable[Mapping[str, Any]], budgets: Iterable[str] = ()) -> list[Sample]:
    """Per-budget queue gauges from the dispatcher's ``apportion:rm:jobs`` rows.

    A job counts for its budget and every ancestor (as occupancy does). A
    job's GPUs are ``gpus_per_replica x replicas``; pending means state
    ``pending``; running means one of :data:`HOLDING_STATES` (it holds GPUs).

    Args:
        jobs: read-model rows (``budget``, ``state``, ``gpus_per_replica``, ``replicas``).
        budgets: paths always reported (0 when they have no job), e.g. the tree's.

    Returns:
        four samples per budget, in path order.
    """
    leaves: dict[str, list[float]] = {}  # per budget named by a job first, then onto its ancestors
    for j in jobs:
        state = j.get("state")
        if state == "pending":
            at = 0
        elif state in HOLDING_STATES:
            at = 2
        else:
            continue
        budget = str(j.get("budget", ""))
        c = leaves.get(budget)
        if c is None:
            c = leaves[budget] = [0.0, 0.0, 0.0, 0.0]
        c[at] += 1
        c[at + 1] += float(j.get("gpus_per_replica", 0)) * float(j.get("replicas", 1))
    counts: dict[str, list[float]] = {b: [0.0, 0.0, 0.0, 0.0] for b in budgets}
    for budget, c in leaves.items():
        for path in ancestors_of(budget):
            total = counts.setdefault(path, [0.0, 0.0, 0.0, 0.0])
            for i in range(4):
                total[i] += c[i]
    names = (
        "apportion_budget_pending_jobs",
        "apportion_budget_pending_gpus",
        "apportion_budget_running_jobs",
        "apportion_budget_running_gpus",
    )
    return [
        Sample(name, (("budget", path),), counts[path][i]) for path in sorted(counts) for i, name in enumerate(names)
    ]


def node_samples(nodes: Iterable[Mapping[str, Any]], now: datetime | None) -> list[Sample]:
    """Per-node gauges from the dispatcher's ``apportion:rm:nodes`` rows.

    Args:
        nodes: rows (``node_id``, ``state``, ``gpu_count``, ``free_gpus``, ``gpu_model``, ``last_heartbeat`` ISO).
        now: event time the heartbeat age is measured at; None leaves the age out.

    Returns:
        per node: ``apportion_node_state`` = 1 labelled with its current state (one series per node, so a
        state change ends the old series; count by state with ``sum by (state)``), GPUs, free GPUs, info, and
        the heartbeat age in seconds (never negative) when the row has a heartbeat.
    """
    out: list[Sample] = []
    for n in sorted(nodes, key=lambda n: str(n.get("node_id", ""))):
        node = str(n.get("node_id", ""))
        lab = (("node", node),)
        out.append(Sample("apportion_node_state", (("node", node), ("state", str(n.get("state", "")))), 1.0))
        out.append(Sample("apportion_node_gpus", lab, float(n.get("gpu_count", 0))))
        out.append(Sample("apportion_node_free_gpus", lab, float(n.get("free_gpus", 0))))
        out.append(Sample("apportion_node_info", (("node", node), ("model", str(n.get("gpu_model") or ""))), 1.0))
        if now is not None and n.get("last_heartbeat"):
            age = (now - datetime.fromisoformat(str(n["last_heartbeat"]))).total_seconds()
            out.append(Sample("apportion_node_heartbeat_age_seconds", lab, max(0.0, age)))
    return out


def _families(samples: list[Sample]) -> Iterator[Any]:
    """Gauge families of ``samples``, one per name, in first-seen order."""
    from prometheus_client.core import GaugeMetricFamily

    fams: dict[str, Any] = {}
    for s in samples:
        fam = fams.get(s.name)
        if fam is None:
            fam = fams[s.name] = GaugeMetricFamily(s.name, HELP[s.name], labels=[k for k, _ in s.labels])
        fam.add_metric([v for _, v in s.labels], s.value)
    yield from fams.values()


class BudgetCollector:
    """Per-budget and per-user gauges of accounting: the rows it last wrote to the read model
    (:func:`budget_samples`) and its per-user fold at their time (:func:`user_samples`).

    Call :meth:`update` with the rows right after writing them; a scrape reports the latest.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: list[Sample] = []

    def update(
        self,
        meta: Mapping[str, Any] | None,
        rows: Mapping[str, Mapping[str, Any]],
        users: Mapping[str, Mapping[str, tuple[int, int]]] | None = None,
    ) -> None:
        """Replace the rows reported (any budget not in ``rows``, any user not in ``users`` or with nothing
        in the window, disappears from the scrape).

        Rows it cannot read are logged and the previous ones kept: metrics never stop a service.
        """
        try:
            samples = budget_samples(meta, rows) + user_samples(users or {})
        except (TypeError, ValueError, KeyError):
            log.exception("budget rows not turned into metrics; the previous ones stay")
            return
        with self._lock:
            self._samples = samples

    def describe(self) -> list[Any]:
        """No description ahead of the first collect (the families depend on the rows)."""
        return []

    def collect(self) -> Iterator[Any]:
        """Families of the latest rows (``prometheus_client`` calls this on each scrape)."""
        with self._lock:
            samples = list(self._samples)
        yield from _families(samples)


class QueueCollector:
    """Per-budget queue gauges and per-node gauges of the dispatcher, from the rows it last wrote.

    Args:
        now: event-time source for the heartbeat age (the service clock's ``now``).
    """

    def __init__(self, now: Callable[[], datetime]) -> None:
        self._lock = threading.Lock()
        self._now = now
        self._queue: list[Sample] = []
        self._nodes: list[Mapping[str, Any]] = []
        self._beats: dict[str, str] = {}

    def update(
        self, jobs: Mapping[str, Mapping[str, Any]], nodes: Mapping[str, Mapping[str, Any]], budgets: Iterable[str]
    ) -> None:
        """Replace the rows reported: ``jobs`` and ``nodes`` as written to Redis, ``budgets`` the tree's paths.

        Rows it cannot read are logged and the previous ones kept: metrics never stop a service.
        """
        try:
            queue = queue_samples(jobs.values(), budgets)
        except (TypeError, ValueError, KeyError):
            log.exception("job rows not turned into metrics; the previous ones stay")
            return
        with self._lock:
            self._queue, self._nodes = queue, list(nodes.values())

    def heartbeats(self, beats: Mapping[str, str]) -> None:
        """The newest heartbeat of each node (ISO), fresher than the rows: the read model is rewritten on
        news, and heartbeats are not news."""
        with self._lock:
            self._beats = dict(beats)

    def describe(self) -> list[Any]:
        """No description ahead of the first collect."""
        return []

    def collect(self) -> Iterator[Any]:
        """Families of the latest rows; the heartbeat age is measured now."""
        with self._lock:
            queue, beats = list(self._queue), self._beats
            nodes = [
                {**n, "last_heartbeat": beats.get(str(n.get("node_id")), n.get("last_heartbeat"))} for n in self._nodes
            ]
        yield from _families(queue + node_samples(nodes, self._now()))


class ReaderCollector:
    """What a service's reader edge did, and how far behind the log it is.

    * ``apportion_events_handled_total``: records turned into events (screened, not duplicates);
    * ``apportion_duplicates_total``: records dropped or passed as duplicates (same id and payload);
    * ``apportion_dead_letters_total``: records dead-lettered (undecodable, reused id, apply failed);
    * ``apportion_unauthenticated_node_reports_total``: node reports ignored (and dead-lettered) because no
      key registered for their node signed them, or their node does not hold the run (``unauthenticated_node``,
      rule D10.authentication);
    * ``apportion_unauthenticated_decisions_total``: decisions and commands ignored (and dead-lettered)
      because the dispatcher's key did not sign them (``unauthenticated``, a forgery); in the accounting also
      ops' requests on nodes no ops key signed (the dispatcher answers those with ``NodeRequestRefused``);
    * ``apportion_unknown_run_reports_total``: reports signed by their node's key of a run the reader knows no
      placement of (passed on; the folds change nothing; logged);
    * ``apportion_consumer_lag_records{topic,partition}``: records between the consumer's position and the
      partition's end (high watermark), as last measured by the poll thread (:meth:`set_lag`).

    Args:
        stats: callables returning objects with ``events``, ``duplicates`` and ``dead_lettered`` counts
            (:class:`apportion.bus.intake.IntakeStats`, :class:`apportion.bus.consumer.Stats`); summed.
    """

    def __init__(self, *stats: Callable[[], Any]) -> None:
        self._stats = list(stats)
        self._lock = threading.Lock()
        self._lag: dict[tuple[str, int], int] = {}

    def watch(self, stats: Callable[[], Any]) -> None:
        """Add a source of counts (e.g. a consumer made after the registry)."""
        self._stats.append(stats)

    def set_lag(self, lag: Mapping[tuple[str, int], int]) -> None:
        """Replace the lag per ``(topic, partition)`` (records behind the end)."""
        with self._lock:
            self._lag = dict(lag)

    def describe(self) -> list[Any]:
        """No description ahead of the first collect."""
        return []

    def collect(self) -> Iterator[Any]:
        """The counters (summed over the sources) and the lag gauges."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counts = ("duplicates", "dead_lettered", "unauthenticated_node", "unauthenticated", "unknown_run")
        totals = dict.fromkeys(("events", *counts), 0)
        for get in self._stats:
            s = get()
            if s is None:
                continue
            # IntakeStats counts ``events``; the EventConsumer's Stats counts them as ``handled``
            totals["events"] += int(getattr(s, "events", getattr(s, "handled", 0)) or 0)
            for name in counts:
                totals[name] += int(getattr(s, name, 0) or 0)
        yield CounterMetricFamily(
            "apportion_events_handled", "Records read and turned into events by the reader edge", totals["events"]
        )
        yield CounterMetricFamily(
            "apportion_duplicates",
            "Records that repeated an event already read (same id and payload)",
            totals["duplicates"],
        )
        yield CounterMetricFamily(
            "apportion_dead_letters",
            "Records dead-lettered by the reader edge (with their reason)",
            totals["dead_lettered"],
        )
        yield CounterMetricFamily(
            "apportion_unauthenticated_node_reports",
            "Node reports ignored because no key registered for their node signed them (unauthenticated_node)",
            totals["unauthenticated_node"],
        )
        yield CounterMetricFamily(
            "apportion_unauthenticated_decisions",
            "Decisions and commands ignored because the dispatcher's key did not sign them (unauthenticated)",
            totals["unauthenticated"],
        )
        yield CounterMetricFamily(
            "apportion_unknown_run_reports",
            "Node reports (signed by their node) of a run the reader knows no placement of; they change nothing",
            totals["unknown_run"],
        )
        lag = GaugeMetricFamily(
            "apportion_consumer_lag_records",
            "Records between the consumer's position and the partition's end (high watermark)",
            labels=["topic", "partition"],
        )
        with self._lock:
            items = sorted(self._lag.items())
        for (topic, partition), n in items:
            lag.add_metric([topic, str(partition)], float(n))
        yield lag


def add_process_collectors(registry: Any) -> None:
    """Register ``prometheus_client``'s default collectors on ``registry``: process (CPU seconds, resident
    memory, open file descriptors, start time), Python platform info and garbage-collector counts.

    Also turns off the ``*_created`` series of counters, process-wide (a timestamp per counter that
    dashboards do not use).
    """
    from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, disable_created_metrics

    disable_created_metrics()  # no ``*_created`` series beside every counter (process-wide)
    for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(c)


# ------------------------------------------------------------------ per-service families


def preemption_metrics(registry: Any) -> dict[str, Any]:
    """Per-budget preemption counters, counted by the dispatcher as it publishes ``JobPreempted`` decisions."""
    from prometheus_client import Counter

    return {
        "preemptions": Counter(
            "apportion_budget_preemptions",
            "Runs of the budget preempted, by reason (the victim rule, or drain, cancelled, ...)",
            ["budget", "reason"],
            registry=registry,
        ),
        "work_lost": Counter(
            "apportion_budget_work_lost_gpu_seconds",
            "Work lost by the budget's preempted runs: GPU-seconds since their last checkpoint",
            ["budget"],
            registry=registry,
        ),
    }


def count_preemptions(metrics: Mapping[str, Any], evts: Iterable[Any]) -> None:
    """Count the ``JobPreempted`` events of ``evts`` in ``metrics`` (from :func:`preemption_metrics`).

    The reason label is the victim's rule (``unallocated``, ``expired_behind``) when the event names a
    preemptor, else the event's ``reason`` (``drain``, ``cancelled``, ...); work lost is ``lost_gpu_s``.
    """
    from apportion.events import JobPreempted

    for e in evts:
        if not isinstance(e, JobPreempted):
            continue
        reason = e.victim.rule if e.victim is not None else e.reason
        metrics["preemptions"].labels(e.budget, reason).inc()
        if e.lost_gpu_s:
            metrics["work_lost"].labels(e.budget).inc(e.lost_gpu_s)


def dispatcher_metrics(registry: Any, now: Callable[[], datetime]) -> dict[str, Any]:
    """The dispatcher's families: its loop, the queue and nodes it writes, preemptions, its reader edge."""
    from prometheus_client import Counter, Gauge, Histogram

    m: dict[str, Any] = {
        "events": Counter("apportion_dispatcher_events", "Events folded", registry=registry),
        "decisions": Counter("apportion_dispatcher_decisions", "Events published", registry=registry),
        "cycle": Histogram(
            "apportion_dispatcher_cycle_seconds",
            "Scheduling cycle wall time",
            registry=registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
        ),
        "pending": Gauge("apportion_dispatcher_pending_jobs", "Jobs waiting in the queue", registry=registry),
        "leader": Gauge("apportion_dispatcher_leader", "1 while this instance holds the lease", registry=registry),
        "dead": Counter("apportion_dispatcher_dead_letters", "Records dead-lettered", registry=registry),
        "tick_errors": Counter(
            "apportion_dispatcher_tick_errors", "Scheduling cycles that raised (nothing decided)", registry=registry
        ),
        "queue": QueueCollector(now),
        "reader": ReaderCollector(),
    }
    m.update(preemption_metrics(registry))
    registry.register(m["queue"])
    registry.register(m["reader"])
    return m


def accounting_metrics(registry: Any) -> dict[str, Any]:
    """Accounting's families: its fold, snapshots and checkpoints, the budget rows it writes, its reader edge."""
    from prometheus_client import Counter, Gauge, Histogram

    m: dict[str, Any] = {
        "events": Counter("apportion_accounting_events", "Events folded", registry=registry),
        "dead": Counter("apportion_accounting_dead_letters", "Records dead-lettered", registry=registry),
        "snapshots": Counter("apportion_accounting_snapshots", "Snapshots published", registry=registry),
        "at": Gauge("apportion_accounting_snapshot_at_seconds", "Event time of the last snapshot", registry=registry),
        "late": Counter(
            "apportion_accounting_late_events",
            "State-changing records folded after a newer one (late; folded at their own time)",
            registry=registry,
        ),
        "checkpoints": Counter("apportion_accounting_checkpoints", "Checkpoints written", registry=registry),
        "checkpoint_bytes": Gauge(
            "apportion_accounting_checkpoint_bytes", "Size of the last checkpoint state", registry=registry
        ),
        "start_records": Gauge(
            "apportion_accounting_start_records",
            "Records read at the last start to catch up (resume or rebuild)",
            registry=registry,
        ),
        "resumed": Gauge(
            "apportion_accounting_resumed", "1 when the last start resumed from the checkpoint", registry=registry
        ),
        "snapshot_seconds": Histogram(
            "apportion_accounting_snapshot_seconds",
            "Wall time of one snapshot cycle: evaluate the windows, write the read model (and checkpoint)",
            registry=registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
        ),
        "budgets": BudgetCollector(),
        "reader": ReaderCollector(),
    }
    registry.register(m["budgets"])
    registry.register(m["reader"])
    return m


def policy_metrics(registry: Any) -> dict[str, Any]:
    """The policy's families: what it published, by event type, its decision time, and its reader edge."""
    from prometheus_client import Counter, Histogram

    m: dict[str, Any] = {
        "published": Counter("apportion_policy_published", "Events published", ["type"], registry=registry),
        "decide": Histogram(
            "apportion_policy_decide_seconds",
            "Wall time of one decision that published something (validate budget changes, rank the leaves)",
            registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
        ),
        "reader": ReaderCollector(),
    }
    registry.register(m["reader"])
    return m


def node_agent_metrics(registry: Any) -> dict[str, Any]:
    """The node agent's families: commands, refusals, workloads, heartbeats, checkpoints, its reader edge."""
    from prometheus_client import Counter, Gauge

    m: dict[str, Any] = {
        "commands": Counter("apportion_node_agent_commands", "Commands for hosted nodes", ["type"], registry=registry),
        "refused": Counter("apportion_node_agent_refused", "Commands refused", ["reason"], registry=registry),
        "running": Gauge("apportion_node_agent_running", "Workload replicas running", registry=registry),
        "heartbeats": Counter("apportion_node_agent_heartbeats", "Heartbeats sent", registry=registry),
        "checkpoints": Counter(
            "apportion_node_agent_checkpoints", "JobCheckpointed events published", registry=registry
        ),
        "checkpoint_problems": Counter(
            "apportion_node_agent_checkpoint_problems", "Progress reports ignored (invalid content)", registry=registry
        ),
        "send_errors": Counter(
            "apportion_node_agent_send_errors", "Events the producer failed to deliver", registry=registry
        ),
        "reader": ReaderCollector(),
    }
    registry.register(m["reader"])
    return m
