"""Policy decisions: the authoritative budget tree and the fair-share ranking.

Pure: events and event time in, tree / events out.

The skip rule (who decides what the budget tree is)
----------------------------------------------------
Writers (the ops CLI) and the policy share ``apportion.budgets`` (one
partition, so the log has a total order). The authoritative tree is
:func:`apportion.domain.budgets.fold_budget_log` of that log: the fold in
offset order of ``BudgetSet``/``BudgetRemoved``/``BudgetBatch`` (a batch
validated on the tree after all of its changes, applied whole or not at
all), skipping a change that a
``BudgetRejected`` names and a change ``BudgetTree.apply`` refuses against
the tree folded so far. This policy rejects exactly the changes of the
second kind (:func:`check_budget_event`, checked against the same fold, with
``in_use`` empty: jobs are not in the budgets log), so its rejections never
change the tree a reader computes, whether the reader saw them or not, and
every reader (accounting, dispatcher, CLI, audit) reaches the same tree.
Repeated event ids are folded once, and the ids remembered for that are
bounded by the window W as the dispatcher's are (:mod:`apportion.domain.seen`):
a budget event older than the newest one folded minus W is not folded (the
dispatcher does not fold it either), and ids older than that are forgotten.
A refused batch gets one
``BudgetRejected`` whose ``failures`` name every failing path.

Ranking
-------
On a new ``OccupancySnapshot`` (the newest by ``at``) or a change of the
tree, the policy publishes ``FairShareRanking``: leaves in Fair-Tree order
(:func:`apportion.domain.fairshare.budget_order`) with their r computed from
the snapshot's occupancy (incl. descendants) and capacity integral and the
policy's tree. With no snapshot yet, every r is 0 (order by path). Event
ids are derived from the inputs, so a restarted policy re-publishing the
same ranking is de-duplicated by readers.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from apportion.domain.budgets import BUDGET_CHANGES, BudgetBatchError, BudgetError, BudgetTree, fold_budget_log
from apportion.domain.fairshare import budget_order, ratios
from apportion.domain.seen import forget_older, older_than_window, sweep_due
from apportion.domain.usage import ranking_of
from apportion.events import (
    BudgetBatch,
    BudgetFailure,
    BudgetRejected,
    BudgetRemoved,
    BudgetSet,
    Event,
    FairShareRanking,
    OccupancySnapshot,
    RankedBudget,
    det_id,
)
from apportion.timeutil import WEEK_S, s_to_us, to_us

PRODUCER = "policy"
POLICY_VERSION = "fairtree-1"


# --------------------------------------------------------------------------- the skip rule


@dataclass(frozen=True, slots=True)
class Rejection:
    """A budget change the fold skipped, and why (``failures``: each failing path of a batch)."""

    event: BudgetSet | BudgetRemoved | BudgetBatch
    reason: str
    message: str
    failures: tuple[BudgetFailure, ...] = ()


def check_budget_event(tree: BudgetTree, event: Event) -> tuple[BudgetTree, Rejection | None]:
    """Apply one budgets-topic event under the skip rule.

    Args:
        tree: the tree so far.
        event: any event; only ``BudgetSet``/``BudgetRemoved``/``BudgetBatch`` change the tree.

    Returns:
        ``(new_tree, None)`` when applied or not a change; ``(tree, Rejection)``
        when ``BudgetTree.apply`` refused it (the tree is unchanged).
    """
    if not isinstance(event, BUDGET_CHANGES):
        return tree, None
    try:
        return tree.apply(event), None
    except BudgetBatchError as exc:
        return tree, Rejection(event, exc.reason, exc.message, exc.failures)
    except BudgetError as exc:
        return tree, Rejection(event, exc.reason, exc.message)


def rejected_event(rej: Rejection, now: datetime) -> BudgetRejected:
    """The ``BudgetRejected`` for a skipped change (id derived from the change's id).

    A batch's names its first failing path as ``path`` and every failure in ``failures``.
    """
    path = rej.failures[0].path if rej.failures else getattr(rej.event, "path", "")
    return BudgetRejected(
        event_id=det_id("BudgetRejected", rej.event.event_id),
        ts=now,
        producer=PRODUCER,
        path=path,
        reason=rej.reason,
        message=rej.message,
        rejected_event_id=rej.event.event_id,
        failures=rej.failures,
    )


# --------------------------------------------------------------------------- ranking


def tree_fingerprint(tree: BudgetTree) -> str:
    """Stable short digest of the tree's content (not its version counter)."""
    return hashlib.sha256(repr(sorted(tree.to_mapping().items())).encode()).hexdigest()[:16]


def ranking(tree: BudgetTree, snapshot: OccupancySnapshot | None, now: datetime) -> FairShareRanking:
    """Leaves of ``tree`` in fair-share order given ``snapshot``'s occupancy.

    With a snapshot this is :func:`apportion.domain.usage.ranking_of`; with
    none, every r is 0 and the order is by path, at event time ``now``.

    Returns:
        A ``FairShareRanking`` whose ``budgets`` are the leaves, rank 0 first.
    """
    if snapshot is not None:
        return ranking_of(tree, snapshot, producer=PRODUCER, policy_version=POLICY_VERSION)
    order = budget_order(tree, {}, 0.0)
    r = ratios(tree, {}, 0.0)
    return FairShareRanking(
        event_id=det_id("FairShareRanking", "-", tree_fingerprint(tree)),
        ts=now,
        producer=PRODUCER,
        at=now,
        policy_version=POLICY_VERSION,
        budgets=tuple(
            RankedBudget(path=p, rank=i, ratio=r[p], abs_share=tree.abs_share(p)) for i, p in enumerate(order)
        ),
    )


# --------------------------------------------------------------------------- decide / evolve


@dataclass(frozen=True, slots=True)
class PolicyState:
    """The policy's view.

    Attributes:
        tree: authoritative budget tree (``fold_budget_log`` of ``log``).
        log: budgets-topic events folded so far, in log order, each id once.
        seen: their event ids -> event time (µs), those older than the window forgotten
            (:func:`apportion.domain.seen.forget_older`).
        clock_us: the newest budget event time folded (µs), ``None`` before any.
        kept: ids left by the last sweep of ``seen``.
        window_us: the window W (µs); budget events older than ``clock_us - window_us`` are not folded.
        rejected_ids: ids of changes a ``BudgetRejected`` already exists for.
        pending_rejections: skipped changes not yet announced.
        snapshot: newest occupancy snapshot (by ``at``), or ``None``.
        published: id of the last ranking published (or due), ``None`` before.
    """

    tree: BudgetTree = field(default_factory=BudgetTree.empty)
    log: tuple[Event, ...] = ()
    seen: Mapping[uuid.UUID, int] = field(default_factory=dict)
    clock_us: int | None = None
    kept: int = 0
    window_us: int = s_to_us(WEEK_S)
    rejected_ids: frozenset[uuid.UUID] = frozenset()
    pending_rejections: tuple[Rejection, ...] = ()
    snapshot: OccupancySnapshot | None = None
    published: uuid.UUID | None = None


def evolve(state: PolicyState, event: Event) -> PolicyState:
    """Fold one event from ``apportion.budgets`` or ``apportion.usage``."""
    if isinstance(event, (*BUDGET_CHANGES, BudgetRejected)):
        t = to_us(event.ts)
        if older_than_window(t, state.clock_us, state.window_us):  # as the dispatcher: not folded
            return state
        if event.event_id in state.seen:
            return state
        clock = t if state.clock_us is None or t > state.clock_us else state.clock_us
        seen, kept = {**state.seen, event.event_id: t}, state.kept
        if sweep_due(len(seen), kept):
            seen = forget_older(seen, clock, state.window_us)
            kept = len(seen)
        state = replace(state, log=state.log + (event,), seen=seen, clock_us=clock, kept=kept)
    if isinstance(event, BudgetRejected):
        if event.rejected_event_id is None:
            return state
        pend = tuple(p for p in state.pending_rejections if p.event.event_id != event.rejected_event_id)
        return replace(
            state,
            rejected_ids=state.rejected_ids | {event.rejected_event_id},
            pending_rejections=pend,
            tree=fold_budget_log(state.log),
        )
    if isinstance(event, BUDGET_CHANGES):
        _, rej = check_budget_event(state.tree, event)
        pend = state.pending_rejections
        if rej is not None and event.event_id not in state.rejected_ids:
            pend = pend + (rej,)
        return replace(state, tree=fold_budget_log(state.log), pending_rejections=pend)
    if isinstance(event, OccupancySnapshot):
        if state.snapshot is None or event.at >= state.snapshot.at:
            return replace(state, snapshot=event)
    return state


def decide(state: PolicyState, now: datetime) -> tuple[PolicyState, list[Event]]:
    """Events the policy owes given ``state``: pending rejections, then a ranking if it changed.

    Call after a batch of :func:`evolve` once caught up with the log (during
    a rebuild from offset 0 the policy's own earlier ``BudgetRejected``
    events are still ahead in the log, so deciding early would repeat them).

    Returns:
        ``(new_state, events_to_publish)``; publishing them twice is harmless
        (deterministic ids).
    """
    out: list[Event] = [rejected_event(r, now) for r in state.pending_rejections]
    rejected_ids = state.rejected_ids | {r.event.event_id for r in state.pending_rejections}
    rank = ranking(state.tree, state.snapshot, now)
    if rank.event_id != state.published and len(state.tree):
        out.append(rank)
        state = replace(state, published=rank.event_id)
    return replace(state, rejected_ids=rejected_ids, pending_rejections=()), out
