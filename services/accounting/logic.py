"""Accounting projection: occupancy windows + budget tree -> snapshots and read-model rows.

Pure (no Kafka, Redis or wall clock). The window arithmetic is
:class:`apportion.domain.occupancy.OccupancyLedger`; the tree is
:func:`apportion.domain.budgets.fold_budget_log` of the budgets log; the
snapshot is :func:`apportion.domain.usage.usage_snapshot`. This module only
routes events to them and decides *when* a snapshot is due:

* **on change** - after events that change the ledger or the tree, at the
  ledger clock (the largest event time applied), debounced by the caller;
* **periodic** - at each multiple of ``interval_s`` of event time that the
  service clock has passed (:func:`periodic_due`), so windows that slide
  with nothing happening are still published.

Both are deterministic functions of the log and the evaluation time, so a
snapshot published live equals :func:`rebuild` of the same log evaluated at
the same ``at``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from apportion.domain.budgets import BUDGET_CHANGES, BudgetTree, fold_budget_log
from apportion.domain.fairshare import budget_order
from apportion.domain.occupancy import LEDGER_EVENT_TYPES, OccupancyLedger
from apportion.domain.occupancy import rebuild as rebuild_ledger
from apportion.domain.usage import usage_snapshot
from apportion.domain.user_usage import UserUsageFold
from apportion.events import (
    BudgetRejected,
    Event,
    OccupancySnapshot,
)
from apportion.identity.registry import KeyRegistry
from apportion.timeutil import WEEK_S, Micros, from_us, s_to_us, to_us

PRODUCER = "accounting"

#: Event types that can change the windows (others on the topics are ignored): the ledger's own list.
LEDGER_TYPES = LEDGER_EVENT_TYPES
BUDGET_TYPES = (*BUDGET_CHANGES, BudgetRejected)
#: Every event type that can change the state (the rest are read and skipped).
STATE_TYPES = LEDGER_TYPES + BUDGET_TYPES


class Accounting:
    """The accounting service's state: ledger, budget log and tree.

    Args:
        window_s: occupancy window W in seconds.
        ledger: a prebuilt ledger (from :func:`rebuild`), default empty.
        keys: the key registry (keys and placed runs) to start from, default empty.
    """

    def __init__(
        self, window_s: float = WEEK_S, ledger: OccupancyLedger | None = None, keys: KeyRegistry | None = None
    ) -> None:
        self.window_s = window_s
        self.ledger = ledger if ledger is not None else OccupancyLedger(window_s)
        #: per leaf budget and user, the same windows (``apportion_user_occupancy_gpu_seconds``); no decision reads it
        self.users = UserUsageFold(window_s)
        self.budget_log: list[Event] = []
        self._budget_ids: set[uuid.UUID] = set()
        self.tree: BudgetTree = BudgetTree.empty()
        #: the node keys in force and the runs placed (rule D10.authentication): the reader edge checks node reports
        #: with them and places each run it authenticated (:class:`apportion.identity.gates.ReportGate`)
        self.keys = keys if keys is not None else KeyRegistry()

    def apply(self, event: Event) -> bool:
        """Fold one event; True when it may change a snapshot.

        Ledger events are idempotent by the ledger's own rules (duplicate
        placements and node events within W are ignored; ends are
        idempotent); budget events are de-duplicated by ``event_id``. Every
        event also goes to the per-user fold (:attr:`users`).
        """
        self.users.apply(event)
        if isinstance(event, LEDGER_TYPES):
            self.ledger.apply(event)
            return True
        if self.keys.apply(event):
            return False
        if isinstance(event, BUDGET_TYPES):
            if event.event_id in self._budget_ids:
                return False
            self._budget_ids.add(event.event_id)
            self.budget_log.append(event)
            tree = fold_budget_log(self.budget_log)
            changed = tree != self.tree
            self.tree = tree
            return changed
        return False

    @property
    def clock_us(self) -> Micros | None:
        """Largest event time folded into the ledger (µs), ``None`` before any."""
        return self.ledger.clock

    def snapshot(self, at_us: Micros | None = None) -> OccupancySnapshot | None:
        """``OccupancySnapshot`` at ``at_us`` (default the ledger clock); ``None`` before any event.

        Raises:
            ValueError: ``at_us`` precedes the ledger clock.
        """
        at = self.ledger.clock if at_us is None else at_us
        if at is None:
            return None
        return usage_snapshot(self.tree, self.ledger, at, producer=PRODUCER)


def rebuild(events: Iterable[Event], window_s: float = WEEK_S, keys: KeyRegistry | None = None) -> Accounting:
    """Bulk-build the projection from events in log order (the start-up path).

    Ledger events go through :func:`apportion.domain.occupancy.rebuild`
    (buffered, sorted merges); budget events are folded as in
    :meth:`Accounting.apply`. The result accepts further ``apply`` calls.

    Args:
        keys: the registry the reader edge authenticated ``events`` with (their
            keys, and the runs it placed), kept as the state's so that a later
            report of such a run is checked against its placement, as by a
            service that read the placement live; default: a new one, folded
            from ``events`` here (keys only: no run is placed without a gate).
    """
    evs = list(events)
    fold_keys = keys is None
    acc = Accounting(window_s, rebuild_ledger((e for e in evs if isinstance(e, LEDGER_TYPES)), window_s), keys)
    acc.users = UserUsageFold.rebuild(evs, window_s)
    for e in evs:
        if fold_keys:
            acc.keys.apply(e)
        if isinstance(e, BUDGET_TYPES) and e.event_id not in acc._budget_ids:
            acc._budget_ids.add(e.event_id)
            acc.budget_log.append(e)
    acc.tree = fold_budget_log(acc.budget_log)
    return acc


def periodic_due(
    last_at_us: Micros | None, now_us: Micros, clock_us: Micros | None, interval_s: float
) -> Micros | None:
    """Event time of the periodic snapshot due now, or ``None``.

    The periodic grid is the multiples of ``interval_s`` since the epoch.
    A snapshot is due at the latest grid point ``<= now_us`` when it is after
    the last snapshot (``last_at_us``) and not before the ledger clock (the
    windows cannot be evaluated in the past).
    """
    step = s_to_us(interval_s)
    if step <= 0 or clock_us is None:
        return None
    at = now_us - now_us % step
    if at < clock_us or (last_at_us is not None and at <= last_at_us):
        return None
    return at


def read_model(
    snapshot: OccupancySnapshot, tree: BudgetTree, offsets: Mapping[str, int]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Rows for the Redis read model (:mod:`apportion.readmodel`) from a snapshot.

    Returns:
        ``(meta, budgets)``: ``meta`` for ``apportion:rm:usage`` field
        ``meta`` ({at, window_s, capacity_gpus, capacity_gpu_s, offsets,
        snapshot_id}); ``budgets`` path -> {path, share, abs_share,
        occupancy_gpu_s, unallocated_gpu_s, entitlement_gpu_s, ratio, rank}
        where ``rank`` is the leaf's fair-share position (``None`` for inner
        budgets).
    """
    occ = {u.path: u.occupancy_gpu_s for u in snapshot.budgets}
    ranks = {p: i for i, p in enumerate(budget_order(tree, occ, snapshot.capacity_gpu_s))}
    rows = {
        u.path: {
            "path": u.path,
            "share": tree.share(u.path) if u.path in tree else 0.0,
            "abs_share": u.abs_share,
            "occupancy_gpu_s": u.occupancy_gpu_s,
            "unallocated_gpu_s": u.unallocated_gpu_s,
            "entitlement_gpu_s": u.entitlement_gpu_s,
            "ratio": u.ratio,
            "rank": ranks.get(u.path),
        }
        for u in snapshot.budgets
    }
    meta = {
        "at": snapshot.at.isoformat(),
        "window_s": snapshot.window_s,
        "capacity_gpus": snapshot.capacity_gpus,
        "capacity_gpu_s": snapshot.capacity_gpu_s,
        "offsets": dict(sorted(offsets.items())),
        "snapshot_id": str(snapshot.event_id),
    }
    return meta, rows


def at_of(snapshot: OccupancySnapshot) -> Micros:
    """Snapshot event time in µs."""
    return to_us(snapshot.at)


__all__ = ["Accounting", "rebuild", "periodic_due", "read_model", "at_of", "from_us"]
