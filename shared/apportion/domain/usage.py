"""Occupancy snapshot rows: the tree joined with the windows at event time t.

One pure function, :func:`usage_snapshot`, used by the accounting service
(to publish ``OccupancySnapshot``), by the CLI's read model and by the audit
(``audit occupancy --at T`` and ``audit verify`` compare against it), so the
three cannot disagree by construction.
"""

from __future__ import annotations

import hashlib
from datetime import datetime

from apportion.domain.budgets import BudgetTree
from apportion.domain.fairshare import budget_order, entitlement, ratios
from apportion.domain.occupancy import OccupancyLedger
from apportion.events import BudgetUsage, FairShareRanking, OccupancySnapshot, RankedBudget, det_id
from apportion.timeutil import Micros, from_us, us_to_s


def usage_snapshot(
    tree: BudgetTree, ledger: OccupancyLedger, at: Micros, *, producer: str = "accounting"
) -> OccupancySnapshot:
    """The ``OccupancySnapshot`` of every budget node at event time ``at``.

    Per budget b (rule D2.occupancy): O_b and U_b from the ledger (GPU-s,
    descendants included), ``E_b = abs(b) * K(at)``, ``r_b = O_b / E_b`` with
    the edge cases of :func:`apportion.domain.fairshare.usage_ratio`.
    Budgets the ledger has charged but the tree no longer holds are not
    listed (their occupancy still counts in their ancestors).

    Args:
        tree: the budget tree in force at ``at``.
        ledger: occupancy windows folded up to ``at``.
        at: event time in µs since epoch (UTC).

    Returns:
        A snapshot whose ``event_id`` is deterministic in ``at`` and every
        value it carries (window, capacity GPUs and GPU-seconds, each row), so
        re-publishing the same snapshot is de-duplicated and two snapshots
        that differ in anything never share an id.
    """
    occ = ledger.occupancy(at)
    unalloc = ledger.unallocated(at)
    cap_s = ledger.capacity_gpu_s(at)
    r = ratios(tree, occ, cap_s)
    rows = tuple(
        BudgetUsage(
            path=p,
            abs_share=tree.abs_share(p),
            occupancy_gpu_s=occ.get(p, 0.0),
            unallocated_gpu_s=unalloc.get(p, 0.0),
            entitlement_gpu_s=entitlement(tree, p, cap_s),
            ratio=r[p],
        )
        for p in tree.paths()
    )
    ts: datetime = from_us(at)
    window_s, gpus = us_to_s(ledger.window_us), ledger.capacity_gpus(at)
    # A stable digest (not hash(): str hashing is salted per process) of every field a reader compares
    # (events.payload_digest): the same id is then the same payload by construction. Capacity GPUs are in it:
    # nodes registering at the instant ``at`` (one agent's simulated nodes share a time stamp) change them and
    # not the capacity integral up to ``at``, and a snapshot taken between two polls of those registrations
    # reused the id of the one after them (a dead letter ``event_id reused`` at every reader of usage).
    digest = hashlib.sha256(repr((window_s, gpus, cap_s, [tuple(u.__dict__.values()) for u in rows])).encode())
    return OccupancySnapshot(
        event_id=det_id("OccupancySnapshot", at, digest.hexdigest()[:16]),
        ts=ts,
        at=ts,
        producer=producer,
        window_s=window_s,
        capacity_gpus=gpus,
        capacity_gpu_s=cap_s,
        budgets=rows,
    )


def ranking_of(
    tree: BudgetTree, snapshot: OccupancySnapshot, *, producer: str = "policy", policy_version: str = "fairtree-1"
) -> FairShareRanking:
    """Leaf budgets of ``tree`` in fair-share order from a snapshot's occupancy.

    The order is :func:`apportion.domain.fairshare.budget_order` over the
    snapshot's O values and capacity integral.
    """
    occ = {u.path: u.occupancy_gpu_s for u in snapshot.budgets}
    order = budget_order(tree, occ, snapshot.capacity_gpu_s)
    r = ratios(tree, occ, snapshot.capacity_gpu_s)
    ranked = tuple(RankedBudget(path=p, rank=i, ratio=r[p], abs_share=tree.abs_share(p)) for i, p in enumerate(order))
    return FairShareRanking(
        event_id=det_id("FairShareRanking", snapshot.event_id, tree.version),
        ts=snapshot.at,
        at=snapshot.at,
        policy_version=policy_version,
        budgets=ranked,
        producer=producer,
    )
