"""One scheduling cycle, the one entry point: :func:`run_cycle` (rule D3.scheduling-cycle).

:func:`run_cycle` takes an immutable :class:`CycleSnapshot` (cluster, pending
jobs per leaf budget, budget tree, window occupancy) and the cycle's event
time, and returns the decision events (:attr:`CycleResult.events`). It
never mutates its input: a cycle works on its own scratch indices built
from the snapshot.

The cycle, exactly as rule D3.scheduling-cycle says:

1. Walk pending jobs in fair-share order (:class:`FairShareQueue`: leaf
   budgets by Fair-Tree order of r, jobs of one leaf by (submitted_at,
   job_id)). After each placement of an **allocated** job its budget gets the
   provisional charge ``g * k * min(min_runtime, W)`` before the rest are
   ranked (unallocated jobs are free and never charged).
2. Place a job on free GPUs if it fits: gang of k replicas on k *distinct*
   ``ready`` nodes of the right model with g free GPUs each. Best fit: nodes
   with the fewest free GPUs that fit, ties by node id; within a node the
   lowest free GPU indices. A job without a model constraint tries nodes of
   models no waiting job asks for first (:func:`spare_models`).
3. Else, for an **allocated** job J of leaf B, plan a preemption. Candidate
   victims (:func:`victim_rule`, the one home of the rule, with rule ids):
   (1) unallocated runs of any budget; idle runs (D3.idle-runs: allocated runs
   past their protection whose node agents report their GPUs idle for at least
   their budget's ``preempt_idle_after_s``, for any J that fits:
   :func:`~apportion.domain.preemption.idle_rule`); (2) allocated runs whose protection
   has expired (``now >= started_at + protection``, :func:`protection_s`:
   the minimum runtime doubled per earlier preemption of the job, capped)
   whose leaf V is *behind* B (:func:`branch_rule`): at the lowest common
   ancestor, ``r(V's branch) >= r(B's branch) + delta``, and after the move
   B's branch with J's provisional charge is still at or below V's
   (``r_B_after <= r_V``), and the cycle has not already preempted B's
   branch's work for V's (no same-cycle reversal); every r from the one view
   of the cycle (all provisional charges so far). Never V == B, never a
   protected run, never a run already stopping. Cost of a victim set is
   (busy allocated GPUs, idle allocated GPUs, unallocated GPUs, GPU-seconds of work lost since each
   victim's last checkpoint), compared lexicographically, with each
   victim's *whole-run* GPUs (so a gang counts as large as it is;
   :func:`order_key`, :func:`~apportion.domain.cluster.work_lost_gpu_s`).
   Per node we take the cheapest victims first and then drop any that
   turned out unnecessary (a minimal set per node); the k cheapest nodes
   (ties by node id) form the plan. Preempt only if J is then placed; J is
   placed at once on the freed GPUs (``JobPlaced`` with the victims in its
   :class:`Decision`), so they are reserved for it; its ``StartWorkload``
   follows when the victims have stopped (dispatch).
4. Unallocated jobs only go on free GPUs (with ``EngineConfig.free_order``, shared among the
   leaves by rule D3.free-order; with ``EngineConfig.free_las``, least attained service first,
   rule D3.free-las). With ``EngineConfig.owner_free`` (rule D3.owner-free), when the walk first
   reaches a leaf over its share, the leaves at or under theirs first place their unallocated
   jobs on free GPUs up to their headroom (:func:`_pass_owner_free`).
5. A job that cannot be placed does not block the ones behind it
   (backfill), except: the highest-ranked blocked allocated job that has
   waited (since it was queued) at least ``reservation_after`` reserves k
   nodes (those with the most free GPUs, ties by id); no job ranked below it
   lands there in this cycle, except as :func:`backfill_rule` allows (a
   reservation never idles GPUs): unallocated work, and allocated work the
   holder could take back whose protection ends by the holder's earliest
   fit (:func:`earliest_fit_us`, which counts only the runs the holder may
   take back, those placed earlier in the cycle among them). A holder with no known fit time (it waits on runs it may not
   take back) keeps no GPU free for itself: its nodes are unreserved for the
   rest of the cycle. Reservations are recomputed every cycle
   from the snapshot, so they need no events and replay identically.

No loop: within a cycle the after-move test and the reversal rule forbid
V->B and B->V; across cycles the preemptor's new run is protected (longer
each time the job was preempted), and B cannot preempt A back until A's run
has served its protection *and* the ratios have crossed by ``delta`` the
other way, with the move still not inverting the pair.

Speed (the benchmark is 10,000 GPUs, 20,000 pending jobs, 200 leaves):

* free capacity is indexed by (GPU model, free GPU count) -> sorted node
  ids, so a fit is a walk over at most 9 buckets, not all nodes;
* a failed shape (g, k, model) is remembered: a later job of at least that
  shape fails on free GPUs without looking (free capacity only shrinks
  within a cycle); preemption failures are remembered per leaf until
  another leaf is charged (a charge elsewhere can put more runs behind);
* when every remaining job of a leaf is at least as large as a remembered
  failure, the whole leaf is skipped for the rest of the cycle
  (:meth:`FairShareQueue.skip` of all it has left); the next cycle looks again;
* the preemption search looks only at nodes holding candidate victims;
* once pass 1 can place nothing more but by taking runs of a leaf behind (a reservation held that lends
  nothing, no free GPU for a 1 x 1 job, no node a search could free otherwise), a leaf with no leaf behind
  it has every job blocked: what taking them one by one adds to the counters (and to the rank) depends
  on its pending list alone, and is kept with the list in ``CycleSnapshot.memo``
  (:func:`~apportion.domain.engine.shapes.memo_tail`); a later cycle on the same list adds it without
  taking the jobs, and when every leaf left has such a tail, passes them all over at once.

Event ids come from :func:`det_id`, times from ``now_us``: the same snapshot
and time always give the same events, byte for byte.

The phases, each a function of one per-cycle context (:class:`_Cycle`, built by
:func:`_open`): :func:`_pass_allocated` takes each allocated job
(:func:`_take_allocated`: :func:`_fit_free`, :func:`_backfill_reservation`,
:func:`_preempt_for`, then :func:`_reserve` or :func:`_pass_over_blocked`);
:func:`_pass_unallocated` is step 4; :func:`_explain` answers ``explain``.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from itertools import islice
from operator import attrgetter, itemgetter
from typing import cast

from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import UNTIL_STARTED, ClusterSnapshot, Run, RunKey, placed_run
from apportion.domain.engine.aging import AgedQueue, age_terms
from apportion.domain.engine.emit import (
    emit_placed,
    job_protection_s,
    pending_start_events,
    placement,
    preempt_events,
    protection_cap_us,
)
from apportion.domain.engine.inputs import EngineConfig, PendingJob
from apportion.domain.engine.placement import CycleFree, FreeIndex, spare_models
from apportion.domain.engine.reasons import CycleLeft, PendingReason, explain_pending
from apportion.domain.engine.reservation import (
    earliest_fit_us,
    hero_sheltered,
    reservation_nodes,
    share_covers,
    soonest_nodes,
    untakable_nodes,
)
from apportion.domain.engine.search import PreemptionRequest, known_short, plan_preemption, short_test
from apportion.domain.engine.shapes import (
    CycleMemo,
    blocked_run,
    memo_allocated,
    memo_kept,
    memo_tail,
    segment_floor,
)
from apportion.domain.engine.victims import CycleVictims, VictimIndex
from apportion.domain.fairshare import FairShareQueue, free_order_key, owner_headroom
from apportion.domain.idle import IdleReports
from apportion.domain.preemption import (
    RULE_EXPIRED_BEHIND,
    Move,
    backfill_rule,
    branch_rule,
    charge_of,
    victim_rule,
)
from apportion.domain.preemption import (
    branches_of as _branches,
)
from apportion.events import Event, JobPlaced, Placement, Victim
from apportion.timeutil import Micros, from_us, s_to_us

__all__ = ["CycleResult", "CycleSnapshot", "run_cycle"]

_MIN_RT = attrgetter("min_runtime_s")
_ATTAINED = attrgetter("attained_gpu_s")
_FIRST = itemgetter(0)
_SUBMITTED = attrgetter("submitted_at_us")


@dataclass(frozen=True, slots=True)
class CycleSnapshot:
    """Everything one cycle reads, frozen.

    Attributes:
        cluster: nodes and runs.
        pending: leaf budget -> its pending jobs, allocated ones first, each
            class in (submitted_at, job_id) order (sort key
            :func:`pending_order`). Keys that are not leaves of ``tree`` are
            skipped.
        tree: the budget tree.
        occupancy: window occupancy O per budget path incl. descendants, GPU-s.
        capacity_gpu_s: capacity integral K over the window, GPU-s.
    """

    cluster: ClusterSnapshot
    pending: Mapping[str, Sequence[PendingJob]]
    tree: BudgetTree
    occupancy: Mapping[str, float]
    capacity_gpu_s: float
    memo: CycleMemo | None = field(default=None, compare=False, repr=False)
    """Optional :class:`CycleMemo` the caller keeps across cycles for the
    ``pending`` lists (floors, shape codes and blocked tails, and the shape table of the
    codes); only for callers whose pending sequences are never changed in
    place (``DispatchState``: copy-on-write, and it carries entries over to
    the list that replaces one)."""
    victims: VictimIndex | None = field(default=None, compare=False, repr=False)
    """Optional :class:`VictimIndex` of ``cluster.runs``, kept up to date across
    cycles by the caller (``DispatchState``); ``None``: the cycle indexes the
    runs itself. Either way the decisions are the same."""
    free: FreeIndex | None = field(default=None, compare=False, repr=False)
    """Optional :class:`FreeIndex` of ``cluster.nodes``, kept up to date the same way."""
    idle: IdleReports | None = field(default=None, compare=False, repr=False)
    """What the node agents' latest heartbeats say of the runs' GPU use (D3.idle-runs: an allocated run past
    its protection, idle for its budget's ``preempt_idle_after_s``, is a victim for any job that fits);
    ``None``: no reports (the simulator), no run is preempted for being idle."""


@dataclass(slots=True)
class CycleResult:
    """What a cycle decided.

    Attributes:
        events: decisions and commands in emission order.
        reservation: ``(job_id, node_ids)`` of this cycle's reservation, or ``None``.
        considered: jobs taken from the queue (the rest were skipped in bulk).
        searches: preemption searches run.
        passed_over: of ``considered``, jobs passed over in a run without
            being looked at one by one: their shape was already known to be
            blocked in this cycle (see :func:`~apportion.domain.engine.shapes.blocked_run`).
        reasons: with ``explain=True`` only: job id -> why each job the cycle did
            not place is still pending (:mod:`apportion.domain.engine.reasons`).
    """

    events: list[Event] = field(default_factory=list)
    reservation: tuple[str, tuple[str, ...]] | None = None
    considered: int = 0
    searches: int = 0
    passed_over: int = 0
    reasons: dict[str, PendingReason] = field(default_factory=dict)


def _dominated(shapes: Sequence[tuple[int, int]], g: int, k: int) -> bool:
    for fg, fk in shapes:
        if fg <= g and fk <= k:
            return True
    return False


def run_cycle(
    snapshot: CycleSnapshot,
    now_us: Micros,
    config: EngineConfig | None = None,
    *,
    explain: bool = False,
    explain_only: Set[str] | None = None,
) -> CycleResult:
    """Run one scheduling cycle (D3.scheduling-cycle); see the module docstring.

    Args:
        snapshot: the frozen inputs.
        now_us: cycle event time, µs since the epoch UTC.
        config: policy knobs (defaults when ``None``).
        explain: also say why each job left pending is still pending.
        explain_only: with ``explain``, only these jobs (each job's reason is the same either way).

    Returns:
        A :class:`CycleResult`: its ``events`` in order: for each placement,
        ``JobPreempted`` + ``StopWorkload`` per victim replica, then
        ``JobPlaced``, then (placements on free GPUs only) ``StartWorkload``
        per replica; with the cycle's reservation and counters (for audits,
        tests, benchmarks).

    With ``explain``, the result also says why each job it did not place is
    still pending (:attr:`CycleResult.reasons`, judged on the indices the
    cycle leaves: :func:`~apportion.domain.engine.reasons.explain_pending`);
    the decisions are the same either way.

    Two passes over the fair-share order: first the allocated jobs (free GPUs,
    else preemption, provisional charge, reservation: :func:`_pass_allocated`),
    then the unallocated jobs on whatever is still free, in the budget order the
    first pass left (they are not charged, so that order no longer changes), or by
    rule D3.free-order when ``EngineConfig.free_order`` is on (:func:`_pass_unallocated`). A GPU that an allocated job can use in this cycle
    is not idle, so an unallocated job placed there would only be preempted in
    the next cycle: in the Philly replay this ordering removes that churn
    (docs/simulation.md).
    """
    cfg = config or EngineConfig()
    res = CycleResult()
    tree = snapshot.tree
    pending = {leaf: jobs for leaf, jobs in snapshot.pending.items() if jobs and tree.is_leaf(leaf)}
    if not pending:
        if explain:
            res.reasons = explain_pending(
                snapshot.pending, tree, snapshot.cluster, now_us, cfg, CycleLeft(), explain_only
            )
        return res
    cx = _open(snapshot, now_us, cfg, res, pending)
    _pass_allocated(cx)
    if any(b < len(pending[leaf]) for leaf, b in cx.allocated_end.items()):
        _pass_unallocated(cx)
    if explain:
        res.reasons = _explain(cx, explain_only)
    return res


# shapes whose search failed for any charge, charges at record time, own charges at record time,
# (g, k, charge) whose search failed for charges of at least that much
_Failures = tuple[list[tuple[int, int]], int, int, list[tuple[int, int, float]]]


@dataclass(slots=True, eq=False)
class _Cycle:
    """One cycle's working state: built from the snapshot by :func:`_open`, read and changed by every phase.

    Only speed depends on the memo fields (``free_fail``, ``search_failures``,
    ``floors``, ``min_rt``, ``gang_cap``'s): they remember what the cycle already
    found out, so that a later job of at least the same shape is not looked at
    again; the decisions are those of the rules alone.
    """

    snapshot: CycleSnapshot
    now_us: Micros
    cfg: EngineConfig
    res: CycleResult
    tree: BudgetTree
    ts: datetime
    # leaf -> its pending jobs; pending[leaf][:allocated_end[leaf]] are allocated, the rest unallocated
    pending: dict[str, Sequence[PendingJob]]
    allocated_end: dict[str, int]
    queue: FairShareQueue[int]
    budget_rank: dict[str, int]
    free: CycleFree
    memo: CycleMemo | None
    reservation_after_us: Micros
    # budget -> the protection cap of its runs, once per cycle and budget (not a method: the search request
    # holds it, and a bound method would make the context a reference cycle)
    gang_cap: Callable[[str], Micros | None]
    victims: CycleVictims | None = None  # built by the first preemption search
    request: PreemptionRequest | None = None  # the searches' request: the job's fields change per search
    free_fail: dict[str | None, list[tuple[int, int]]] = field(default_factory=dict)  # model -> shapes (g, k)
    search_failures: dict[str, _Failures] = field(default_factory=dict)  # failure key (leaf, or leaf NUL model)
    moves: set[Move] = field(default_factory=set)  # preemptions of allocated work (no same-cycle reversal)
    charges: int = 0  # provisional charges so far
    own_charges: dict[str, int] = field(default_factory=dict)  # leaf -> its provisional charges so far
    rank: int = -1  # rank of the last job taken from the queue
    reserved_for: str | None = None  # the reservation holder's job id
    hold_fit: Micros = 0  # earliest_fit_us of the reservation while its nodes have free GPUs, else 0
    hold_leaf: str = ""  # the reservation holder's leaf
    hold_charge: float = 0.0  # and its provisional charge
    min_rt: dict[str, float] = field(default_factory=dict)  # leaf -> least min_runtime_s of its allocated jobs
    floors: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    capacity: int = -1  # GPUs of the ready nodes, C(t) of D3.hero-cover (-1: not counted yet)
    owner_placed: set[str] = field(default_factory=set)  # unallocated jobs placed by D3.owner-free or by age
    model_keyed: set[str] = field(default_factory=set)  # leaves with a search failure of a model-bound job
    blocked_at: tuple[int, int] = (-1, -1)  # (free log length, charges) when all_blocked last held

    def covers(self, leaf: str, gpus: int) -> bool:
        """D3.hero-cover: ``leaf``'s share covers a job of ``gpus`` GPUs (always below ``hero_min_gpus``, or below
        ``cover_min_gpus`` where that is lower)."""
        cfg = self.cfg
        least, wide = cfg.hero_min_gpus, cfg.cover_min_gpus
        if wide is not None and (least is None or wide < least):
            least = wide
        if least is None or gpus < least:
            return True
        if self.capacity < 0:
            self.capacity = sum(self.free.count.values())
        return share_covers(gpus, self.tree.abs_share(leaf), self.capacity)

    def floor_shape(self, leaf: str, lo: int, hi: int) -> tuple[int, int]:
        """Smallest g and smallest k in pending[leaf][lo:hi]: a lower bound of any job left there."""
        key = (leaf, lo)
        f = self.floors.get(key)
        if f is None:
            f = self.floors[key] = segment_floor(self.memo, self.pending[leaf], lo, hi)
        return f

    def fit_failed(self, g: int, k: int, model: str | None) -> bool:
        """Free GPUs are known not to fit (g, k, model): a shape at most as large failed (free only shrinks)."""
        ff = self.free_fail
        fit_failures = ff.get(model)
        return bool(fit_failures and _dominated(fit_failures, g, k)) or (
            model is not None and _dominated(ff.get(None, ()), g, k)
        )

    def may_backfill(self, leaf: str, g: int, model: str | None) -> bool:
        """Some job of ``leaf`` of at least ``g`` GPUs might still backfill the reservation: a reserved
        node fits ``g`` and the leaf's shortest minimum runtime (a lower bound of any protection)
        ends by the holder's fit time."""
        if not self.hold_fit or not self.free.reserved_fits(g, model):
            return False
        m = self.min_rt.get(leaf)
        if m is None:
            jobs = islice(self.pending[leaf], 0, self.allocated_end[leaf])
            m = self.min_rt[leaf] = min(map(_MIN_RT, jobs), default=0.0)
        return backfill_rule(True, s_to_us(m), self.now_us, self.hold_fit)

    def fresh(self, key: str, ent: _Failures) -> bool:
        """A remembered failure still holds: no other leaf was charged since it was recorded."""
        return self.charges - ent[1] == self.own_charges.get(key, 0) - ent[2]

    def covers_leaf(self, leaf: str, ent: _Failures) -> bool:
        """A failure for any charge of a shape at most the floor of ``leaf``'s allocated jobs: it holds for all."""
        return (1, 1) in ent[0] or _dominated(ent[0], *self.floor_shape(leaf, 0, self.allocated_end[leaf]))

    def search_failed(self, key: str, g: int, k: int, charge: float | None = None) -> bool:
        """Known to fail: a search of a shape <= (g, k) failed for any charge, or (with ``charge``)
        for a charge <= this one (the after-move test only gets stricter as the charge grows).
        A stale entry is dropped."""
        ent = self.search_failures.get(key)
        if ent is None:
            return False
        if not self.fresh(key, ent):
            del self.search_failures[key]
            return False
        if _dominated(ent[0], g, k):
            return True
        if charge is None:
            return False
        for fg, fk, fc in ent[3]:
            if fg <= g and fk <= k and fc <= charge:
                return True
        return False

    def known_to_fail(self, leaf: str, key: str, g: int, k: int, charge: float) -> bool:
        """The preemption search for (g, k) of ``leaf`` (failure ``key``: with its model) is known to fail."""
        sf = self.search_failures
        if key in sf and self.search_failed(key, g, k, charge):
            return True
        return key != leaf and leaf in sf and self.search_failed(leaf, g, k, charge)

    def record_search_failure(self, key: str, g: int, k: int, charge: float | None = None) -> None:
        """Remember a failed search; ``charge``: it failed only for charges of at least this much."""
        ent = self.search_failures.get(key)
        if ent is None or not self.fresh(key, ent):
            ent = self.search_failures[key] = ([], self.charges, self.own_charges.get(key, 0), [])
        if charge is None:
            ent[0].append((g, k))
        else:
            ent[3].append((g, k, charge))
        if key.find("\x00") >= 0:
            self.model_keyed.add(key.partition("\x00")[0])

    def all_blocked(self) -> bool:
        """Pass 1 can place nothing more, whatever the job, except by taking runs of a leaf behind (speed only):
        a reservation is held and lends nothing (D3.scheduling-cycle), free GPUs fit no 1 x 1 job (nor any
        larger one: free capacity only shrinks), and preemption is on. Nothing in pass 1 changes this but a
        placement or a reservation, which move the free log or the charges it is kept against."""
        req = self.request
        if req is None or self.reserved_for is None or not self.cfg.preemption:
            return False
        now = (len(req.free.log), self.charges)
        if self.blocked_at == now:
            return True
        ff = self.free_fail.get(None)
        if not ff or not _dominated(ff, 1, 1) or (self.hold_fit and self.free.reserved_fits(1, None)):
            return False
        self.blocked_at = now
        return True

    def blocked_tail(self, leaf: str) -> dict[int, tuple[int, int, int, int]] | None:
        """The memo of ``leaf``'s blocked tails (:func:`memo_tail`) when every job it has left is blocked and
        taking them depends on its pending list alone: :meth:`all_blocked`, a preemption search of a 1 x 1 job
        is known to fail for it (so is every search: no branch is behind it, and no node can be freed without
        such runs; :func:`known_short`), and it has no failure remembered from before that still holds."""
        if self.memo is None or leaf in self.model_keyed or not self.all_blocked():
            return None
        return self.leaf_tail(leaf)

    def leaf_tail(
        self, leaf: str, short: Callable[[str], bool] | None = None
    ) -> dict[int, tuple[int, int, int, int]] | None:
        """:meth:`blocked_tail` of ``leaf`` once the memo and :meth:`all_blocked` are known to hold (what the
        bulk pass asks of every leaf queued: nothing changes between its questions); ``short``: the 1 x 1
        search's :func:`short_test`, asked once for them all."""
        memo = self.memo
        if memo is None or leaf in self.model_keyed:
            return None
        ent = self.search_failures.get(leaf)
        if ent is not None and self.fresh(leaf, ent):
            return None
        req = self.request
        assert req is not None  # (all_blocked)
        if not (known_short(req, 1, 1, None, leaf, self.cfg.delta, self.charges) if short is None else short(leaf)):
            return None
        return memo_tail(memo, self.pending[leaf])


def _open(
    snapshot: CycleSnapshot,
    now_us: Micros,
    cfg: EngineConfig,
    res: CycleResult,
    pending: dict[str, Sequence[PendingJob]],
) -> _Cycle:
    """The cycle's context: the fair-share queue of the allocated jobs and the free index of the snapshot."""
    tree = snapshot.tree
    memo = snapshot.memo
    allocated_end: dict[str, int] = {}
    get = memo.get if memo is not None else None
    for leaf, jobs in pending.items():
        # memo_allocated(memo, jobs), its kept count read inline (once per leaf with pending jobs)
        ent = get(id(jobs)) if get is not None else None
        if ent is not None and ent[0] is jobs and len(ent) > 3 and ent[3] >= 0:
            allocated_end[leaf] = ent[3]
        else:
            allocated_end[leaf] = memo_allocated(memo, jobs)
    items = {leaf: range(b) for leaf, b in allocated_end.items() if b}
    queue: FairShareQueue[int]
    if cfg.age_weight is None:
        queue = FairShareQueue(tree, snapshot.occupancy, snapshot.capacity_gpu_s, items)
    else:  # a capped age weight on the walk (EngineConfig.age_weight)
        terms = {
            leaf: age_terms(pending[leaf], allocated_end[leaf], now_us, cfg.age_weight, cfg.age_max_s) for leaf in items
        }
        queue = AgedQueue(tree, snapshot.occupancy, snapshot.capacity_gpu_s, items, terms, cfg.age_floor_r)
    free = CycleFree(snapshot.cluster, snapshot.free)
    if len(free.buckets) > 1:
        free.prefer = spare_models(list(free.buckets), pending)
    return _Cycle(
        snapshot=snapshot,
        now_us=now_us,
        cfg=cfg,
        res=res,
        tree=tree,
        ts=from_us(now_us),
        pending=pending,
        allocated_end=allocated_end,
        queue=queue,
        budget_rank=dict(zip(queue.initial_order, range(len(queue.initial_order)))),
        free=free,
        memo=snapshot.memo,
        reservation_after_us=s_to_us(cfg.reservation_after_s),
        gang_cap=partial(_gang_cap, {}, tree, cfg),
    )


def _gang_cap(caps: dict[str, Micros | None], tree: BudgetTree, cfg: EngineConfig, budget: str) -> Micros | None:
    """The protection cap of ``budget``'s runs (:func:`protection_cap_us`), kept in ``caps``."""
    if budget not in caps:
        caps[budget] = protection_cap_us(budget, tree, cfg)
    return caps[budget]


# ---------------------------------------------------------------- pass 1: allocated jobs


def _pass_allocated(cx: _Cycle) -> None:
    """Pass 1 (D3.scheduling-cycle): the allocated jobs in fair-share order, each charged when placed
    (D2.provisional-charge) before the rest are ranked."""
    pop = cx.queue.pop
    aged = _take_aged(cx, cx.cfg.age_first_s) if cx.cfg.age_first_s is not None else None
    if cx.cfg.owner_free:
        # D3.owner-free: the leaves at or under their share come first, then their free work, then the rest
        peek, ratio = cx.queue.peek_leaf, cx.queue.ratio
        while (leaf := peek()) is not None and ratio(leaf) <= 1.0:
            item = pop()
            assert item is not None  # (peek found one)
            if not aged or item not in aged:
                _take_allocated(cx, item[0], item[1])
        _pass_owner_free(cx)
    if aged is not None or type(cx.queue) is AgedQueue:
        # the aged jobs placed first are passed over; no kept tail holds (it would take them again, and its
        # counters would depend on what the aged jobs' searches left remembered; with an age weight a leaf's jobs
        # need not come one after another)
        while (item := pop()) is not None:
            if not aged or item not in aged:
                _take_allocated(cx, item[0], item[1])
        return
    bulk = True
    while (item := pop()) is not None:
        leaf, idx = item
        tails = cx.blocked_tail(leaf)
        if tails is None:
            _take_allocated(cx, leaf, idx)
            continue
        _take_tail(cx, leaf, idx, tails)
        if bulk:  # the first leaf that ends blocked: the others that do so with a kept tail, at once
            bulk = False
            _pass_blocked_tails(cx)


def _take_aged(cx: _Cycle, age_s: float) -> set[tuple[str, int]] | None:
    """Aged allocated work first (``EngineConfig.age_first_s``; an age term as Slurm's multifactor priority and
    Tiresias's STARVELIMIT have, measured in ``docs/simulation.md``, "Levers measured"): before the fair-share
    walk, the allocated jobs of one node (of any size with ``EngineConfig.age_first_gangs``) whose attempt has
    waited at least ``age_s`` (since queued) are taken in the
    fair-share order among themselves (leaves by the cycle's current r, provisional charges included;
    (submitted_at, job_id) within a leaf), each placed on free GPUs or by a preemption under the usual rules
    (D3.victims), never reserving; a blocked one keeps its place in the walk. The (leaf, index) of those placed,
    which the walk passes over; ``None`` when no job has waited that long."""
    cutoff = cx.now_us - s_to_us(age_s)
    pending, gangs = cx.pending, cx.cfg.age_first_gangs
    aged: dict[str, list[int]] = {}
    for leaf, end in cx.allocated_end.items():
        jobs = pending[leaf]
        # queued_at >= submitted_at: the aged ones are among those submitted by the cutoff
        stop = bisect_right(jobs, cutoff, 0, end, key=_SUBMITTED)
        got = [i for i in range(stop) if jobs[i].queued_at_us <= cutoff and (gangs or jobs[i].replicas == 1)]
        if got:
            got.reverse()  # popped from the end: submission order
            aged[leaf] = got
    if not aged:
        return None
    placed: set[tuple[str, int]] = set()
    charges = -1
    order: list[str] = []
    while aged:
        if cx.charges != charges:  # the order changes only with a charge (D2.provisional-charge)
            charges = cx.charges
            order = [leaf for leaf in cx.queue.order() if leaf in aged]
            order.reverse()
        leaf = order[-1]
        left = aged[leaf]
        idx = left.pop()
        if not left:
            del aged[leaf]
            order.pop()
        if _take_allocated(cx, leaf, idx, aged=True):
            placed.add((leaf, idx))
    return placed


def _take_tail(cx: _Cycle, leaf: str, idx: int, tails: dict[int, tuple[int, int, int, int]]) -> None:
    """Pass 1 from ``leaf``'s job ``idx`` (just taken from the queue), all of whose jobs are blocked: what its
    kept tail says taking them adds (then its rest is passed over), else take them and keep the tail."""
    got = tails.get(idx)
    if got is None:
        tails[idx] = _take_leaf(cx, leaf, idx)
        return
    _add_tail(cx, got)
    cx.queue.skip(leaf, cx.allocated_end[leaf] - idx - 1)


def _add_tail(cx: _Cycle, got: tuple[int, int, int, int]) -> None:
    """Add a kept tail to the counters: what taking the leaf's jobs one by one did (nothing else changed)."""
    res = cx.res
    res.considered += got[0]
    cx.rank += got[1]
    res.searches += got[2]
    res.passed_over += got[3]


def _pass_blocked_tails(cx: _Cycle) -> None:
    """When every leaf still queued has all its jobs blocked and its tail kept, pass them over at once (speed
    only): nothing can be placed or charged any more in pass 1, so the order in which they would be taken
    matters to nothing but the order of the counters' sums. When one has not (it might still place a job, at
    a rank that counts the jobs taken before it), nothing is passed over here."""
    heads = cx.queue.heads()
    short = None
    if heads:
        if cx.memo is None or not cx.all_blocked():
            return  # (what blocked_tail would answer for the first one)
        assert cx.request is not None  # (all_blocked)
        short = short_test(cx.request, 1, 1, None, cx.cfg.delta, cx.charges)
        if short is None:
            return  # (known_short fails for every leaf)
    tails = []
    memo, pending, model_keyed, failures, fresh = cx.memo, cx.pending, cx.model_keyed, cx.search_failures, cx.fresh
    for leaf, idx in heads:
        assert memo is not None and short is not None  # (checked above for any heads)
        # cx.leaf_tail(leaf, short).get(idx), inlined (once per leaf queued)
        if leaf in model_keyed:
            return
        ent = failures.get(leaf)
        if (ent is not None and fresh(leaf, ent)) or not short(leaf):
            return
        jobs = pending[leaf]
        kept = memo.get(id(jobs))
        if kept is None or kept[0] is not jobs or len(kept) < 5:
            return  # (no tail kept for this list: memo_tail would start an empty one)
        got = kept[4].get(idx)
        if got is None:
            return
        tails.append(got)
    for got in tails:
        _add_tail(cx, got)
    cx.queue.clear()


def _take_leaf(cx: _Cycle, leaf: str, idx: int) -> tuple[int, int, int, int]:
    """Take ``leaf``'s allocated jobs from ``idx`` on while it heads the queue (every one blocked: nothing is
    charged); what that added to the counters (considered, rank, searches, passed over)."""
    res = cx.res
    before = (res.considered, cx.rank, res.searches, res.passed_over)
    queue = cx.queue
    _take_allocated(cx, leaf, idx)
    while queue.peek_leaf() == leaf:
        item = queue.pop()
        assert item is not None  # (peek found one)
        _take_allocated(cx, leaf, item[1])
    return (res.considered - before[0], cx.rank - before[1], res.searches - before[2], res.passed_over - before[3])


def _take_allocated(cx: _Cycle, leaf: str, idx: int, aged: bool = False) -> bool:
    """One allocated job: free GPUs (D3.placement), the reservation's free GPUs, else a preemption
    (D3.victims); placed: charged; blocked: it reserves or the jobs blocked like it are passed over (``aged``,
    taken ahead of the walk by :func:`_take_aged`: neither). True when placed."""
    job = cx.pending[leaf][idx]
    res = cx.res
    cx.rank += 1
    res.considered += 1
    g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
    bound = job.topology_bound
    nodes = _fit_free(cx, g, k, model, bound)
    now_us = cx.now_us
    if (
        nodes is None
        and cx.hold_fit
        and now_us + s_to_us(job.min_runtime_s) <= cx.hold_fit  # protection >= min_runtime: else no chance
        and cx.free.reserved_fits(g, model)
    ):
        nodes = _backfill_reservation(cx, job, leaf)
    cfg = cx.cfg
    gang_waits = k > 1 and cfg.gang_wait_s is not None and now_us - job.queued_at_us < s_to_us(cfg.gang_wait_s)
    holds_reservation = (  # (D3.gang-wait: a gang of several nodes takes only free GPUs while it waits)
        not gang_waits
        and not aged
        and cx.reserved_for is None
        and (now_us - job.queued_at_us >= cx.reservation_after_us or (cfg.hero_waits and _hero_waits(cx, job)))
        and cx.covers(leaf, job.gpus)  # D3.hero-cover: an uncovered job reserves nothing
    )
    failure_key = leaf if model is None else leaf + "\x00" + model
    charge = charge_of(g, k, job.min_runtime_s, cfg.window_s)
    if nodes is not None:
        _place_on_free(cx, job, leaf, nodes, holds_reservation)
    elif not cfg.preemption:
        cx.record_search_failure(failure_key, g, k)
    elif bound is None and not gang_waits and not cx.known_to_fail(leaf, failure_key, g, k, charge):
        nodes = _preempt_for(cx, job, leaf, failure_key, charge, holds_reservation)
    if nodes is not None:
        cx.queue.charge(leaf, charge)
        if cx.request is not None:
            cx.request.charged.append(leaf)
        cx.charges += 1
        own = cx.own_charges
        own[leaf] = own.get(leaf, 0) + 1
        return True
    if holds_reservation:
        _reserve(cx, job, leaf, charge)  # (it changed free capacity: no bulk skip on its account)
    elif not aged:
        _pass_over_blocked(cx, leaf, idx, model)
    return False


def _fit_free(cx: _Cycle, g: int, k: int, model: str | None, bound: str | None = None) -> list[str] | None:
    """Best-fit gang placement on free GPUs (D3.placement), unless a shape at most as large already failed;
    ``bound``: within one block or rack (D1.topology; its failure says nothing about unbound shapes)."""
    ff = cx.free_fail
    if ff:  # cx.fit_failed(g, k, model), inlined (once per job taken)
        failed = ff.get(model)
        if (failed and _dominated(failed, g, k)) or (model is not None and _dominated(ff.get(None, ()), g, k)):
            return None
    nodes = cx.free.fit(g, k, model, bound)
    if nodes is None and bound is None:
        ff.setdefault(model, []).append((g, k))
    return nodes


def _backfill_reservation(cx: _Cycle, job: PendingJob, leaf: str) -> list[str] | None:
    """The waiting reservation's free GPUs, for a job whose protection ends by the holder's fit time and
    that the holder could take back (D3.scheduling-cycle: a reservation never idles GPUs)."""
    prot = job_protection_s(job, cx.tree, cx.cfg, cx.queue.ratio(leaf))
    br = _branches(leaf, cx.hold_leaf)
    may = br is not None and (
        branch_rule(br[0], br[1], br[2], cx.queue, cx.cfg.delta, cx.hold_charge, cx.moves)[0] == RULE_EXPIRED_BEHIND
    )
    if not backfill_rule(True, s_to_us(prot), cx.now_us, cx.hold_fit, may):
        return None
    free = cx.free
    nodes = free.fit_with_reserved(job.gpus_per_replica, job.replicas, job.gpu_model, job.topology_bound)
    if nodes is not None and not free.reserved_free():
        cx.hold_fit = 0  # the reservation's GPUs are all lent: nothing more to backfill
    return nodes


def _emit_placed(
    cx: _Cycle, job: PendingJob, leaf: str, placements: tuple[Placement, ...], victims: tuple[Victim, ...], held: bool
) -> None:
    """The ``JobPlaced`` of ``job`` at the cycle's rank, with its budget's r in the cycle's view."""
    emit_placed(
        cx.res.events,
        job,
        placements,
        victims,
        leaf,
        cx.rank,
        cx.budget_rank,
        cx.queue.ratio(leaf),
        held,
        cx.ts,
        cx.cfg,
        cx.tree,
    )


def _place_on_free(cx: _Cycle, job: PendingJob, leaf: str, nodes: list[str], held: bool) -> None:
    """Take ``job``'s GPUs on ``nodes``; ``JobPlaced``, then its ``StartWorkload`` per replica."""
    g = job.gpus_per_replica
    take = cx.free.take
    placements = tuple([placement(n, take(n, g)) for n in nodes])
    _emit_placed(cx, job, leaf, placements, (), held)
    cx.res.events.extend(pending_start_events(job, placements, cx.ts, cx.cfg.producer))


def _preempt_for(
    cx: _Cycle, job: PendingJob, leaf: str, failure_key: str, charge: float, held: bool
) -> list[str] | None:
    """The least-cost preemption for ``job`` (D3.victims, D3.consistent-view): its victims' ``JobPreempted``
    and ``StopWorkload``, then its ``JobPlaced`` on the freed GPUs (reserved for it); the nodes, or ``None``."""
    cfg = cx.cfg
    req = cx.request
    if req is None:
        snap = cx.snapshot
        victims = cx.victims = CycleVictims(snap.cluster, cx.now_us, snap.victims, snap.idle, cx.tree)
        req = cx.request = PreemptionRequest(
            job=job,
            leaf=leaf,
            free=cx.free,
            victims=victims,
            now=cx.now_us,
            ratio=cx.queue,
            delta=cfg.delta,
            tree=cx.tree,
            moves=cx.moves,
            patience_s=cfg.patience_s,
            checkpoint_wait_s=cfg.checkpoint_wait_s,
            gangs=cfg.gang_rule,
            gang_cap=cx.gang_cap,
            gang_least_gpus=cfg.gang_min_gpus,
            gang_times=cfg.gang_bound_x,
            gang_last_resort=cfg.gang_last_resort,
            gang_last_resort_over_share=cfg.gang_last_resort_over_share,
            hero_min_gpus=cfg.hero_min_gpus,
            hero_waits=cfg.hero_waits,
        )
    victims = req.victims
    g, k = job.gpus_per_replica, job.replicas
    covered = cx.covers(leaf, g * k)
    # D3.hero-cover: an uncovered job takes no expired run of a budget behind it (no delta is large enough)
    delta = cfg.delta if covered else math.inf
    cx.res.searches += 1
    # (its first test is known_short: a search known to fail costs the request's five fields more, no more)
    req.job, req.leaf, req.charge_count, req.charge_gpu_s, req.delta = job, leaf, cx.charges, charge, delta
    plan = plan_preemption(req)
    if not covered:
        victims.behind.pop(leaf, None)  # found without the behind runs: not for the leaf's covered jobs
    if plan is None:
        # (a refusal by patience_rule or checkpoint_rule depends on this job's wait or victims' timing)
        # (and one that spared a gang larger than the job says nothing about larger jobs: gang_rule)
        if job.job_id not in victims.waits and job.job_id not in victims.checkpoint_waits and not victims.spared:
            cx.record_search_failure(failure_key, g, k, charge if victims.narrowed else None)
        return None
    placements, chosen = plan
    out = cx.res.events
    vics = []
    for run, vic in chosen:
        victims.taken.add(run.key)
        if vic.rule == RULE_EXPIRED_BEHIND:
            br = _branches(run.budget, leaf)
            if br is not None:
                cx.moves.add(br)
        out.extend(
            preempt_events(run, cx.ts, cfg.grace_s, cfg.producer, victim=vic, by_job_id=job.job_id, by_budget=leaf)
        )
        vics.append(vic)
    _emit_placed(cx, job, leaf, placements, tuple(vics), held)
    return [p.node_id for p in placements]


def _reserve(cx: _Cycle, job: PendingJob, leaf: str, charge: float) -> None:
    """The highest-ranked blocked allocated job that has waited ``reservation_after`` reserves k nodes
    (D3.scheduling-cycle). A holder with no known fit time (it waits on runs it may not take back) keeps
    no GPU free for itself: its nodes are unreserved for the rest of the cycle."""
    g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
    cx.reserved_for = job.job_id
    free, victims = cx.free, cx.victims
    unalloc_gpus: dict[str, int] | None = None
    taken_runs = victims.taken if victims is not None else set()
    if victims is not None:
        unalloc_gpus = {
            n: sum(len(x[2]) for x in lst if x[1].key not in taken_runs) for n, lst in victims.unalloc.items()
        }
    may_take = partial(_may_take_back, cx, leaf, charge, g * k)
    if _hero_waits(cx, job):  # D3.hero-waits: the nodes that fit it soonest, a covered hero's left out
        may_take = partial(_may_take_unsheltered, cx, may_take)
        placed = [placed_run(e) for e in cx.res.events if type(e) is JobPlaced and e.allocated]
        cluster = cx.snapshot.cluster
        chosen_nodes = soonest_nodes(
            cluster, free, g, k, model, cx.now_us, taken_runs, may_take, placed, job.topology_bound
        )
    elif cx.cfg.hero_reserve_takable and g * k >= (cx.cfg.hero_min_gpus or math.inf):
        chosen_nodes = _hero_reservation(cx, job, unalloc_gpus, taken_runs, may_take)
    else:
        chosen_nodes = reservation_nodes(free, g, k, model, unalloc_gpus, job.topology_bound)
    for n in chosen_nodes:
        free.reserve(n)
    cx.res.reservation = (job.job_id, tuple(chosen_nodes))
    if not free.reserved_free():
        return
    mine = set(chosen_nodes)
    placed = [  # the runs placed earlier in this cycle on its nodes hold their GPUs as any other
        placed_run(e)
        for e in cx.res.events
        if type(e) is JobPlaced and e.allocated and any(p.node_id in mine for p in e.placements)
    ]
    hold_fit = earliest_fit_us(cx.snapshot.cluster, chosen_nodes, g, cx.now_us, taken_runs, may_take, placed)
    if hold_fit >= UNTIL_STARTED:
        # no known time to fit: lower-ranked work may use its nodes as any other
        free.unreserve_all()
        cx.hold_fit = 0
    else:
        cx.hold_fit, cx.hold_leaf, cx.hold_charge = hold_fit, leaf, charge


def _hero_reservation(
    cx: _Cycle,
    job: PendingJob,
    unalloc_gpus: dict[str, int] | None,
    taken: Set[RunKey],
    may_take: Callable[[Run, Micros], bool],
) -> list[str]:
    """Rule D3.hero-cover's reservation clause (``EngineConfig.hero_reserve_takable``): a covered hero reserves
    only nodes whose allocated runs (those placed earlier in the cycle included) it may take back (``may_take``,
    the runs ``taken`` in this cycle aside)."""
    placed = [placed_run(e) for e in cx.res.events if type(e) is JobPlaced and e.allocated]
    away = untakable_nodes(cx.snapshot.cluster, cx.now_us, taken, may_take, placed)
    g, k = job.gpus_per_replica, job.replicas
    return reservation_nodes(cx.free, g, k, job.gpu_model, unalloc_gpus, job.topology_bound, away)


def _hero_waits(cx: _Cycle, job: PendingJob) -> bool:
    """D3.hero-waits: ``job`` is a hero (at least ``hero_min_gpus`` GPUs) that waits and reserves at once."""
    return cx.cfg.hero_waits and job.gpus >= (cx.cfg.hero_min_gpus or math.inf)


def _may_take_unsheltered(cx: _Cycle, may_take: Callable[[Run, Micros], bool], run: Run, at_us: Micros) -> bool:
    """D3.hero-waits: ``may_take``, and never a covered hero within its share (D3.hero-cover's ``hero_sheltered``)."""
    least = cx.cfg.hero_min_gpus
    if least is not None and run.gpus >= least:
        if cx.capacity < 0:
            cx.capacity = sum(cx.free.count.values())
        if hero_sheltered(run.gpus, cx.tree.abs_share(run.budget), cx.capacity, cx.queue.ratio(run.budget), least):
            return False
    return may_take(run, at_us)


def _may_take_back(cx: _Cycle, leaf: str, charge: float, gpus: int, run: Run, at_us: Micros) -> bool:
    """The reservation holder of ``leaf`` may take ``run`` back at ``at_us`` (:func:`victim_rule`, protection aside)."""
    return victim_rule(
        run,
        leaf,
        at_us,
        cx.queue,
        cx.cfg.delta,
        charge,
        cx.moves,
        gpus if cx.cfg.gang_rule else None,
        ignore_protection=True,
        gang_cap_us=cx.gang_cap(run.budget),
        gang_least_gpus=cx.cfg.gang_min_gpus,
        gang_times=cx.cfg.gang_bound_x,
    ).allowed


def _pass_over_blocked(cx: _Cycle, leaf: str, idx: int, model: str | None) -> None:
    """After a blocked job of ``leaf`` (speed only): drop the leaf when all its jobs are known to be blocked,
    else pass over its next jobs that would be blocked exactly like this one, with no effect but their rank."""
    sf = cx.search_failures
    ent = sf.get(leaf)
    covers = False  # a fresh failure of the leaf covers every job of it
    end = cx.allocated_end[leaf]
    queue = cx.queue
    # the leaf's next jobs come next only while they keep its key (EngineConfig.age_weight)
    steady = queue.steady_end(leaf, idx, end) if type(queue) is AgedQueue else end
    if ent is not None:
        if not cx.fresh(leaf, ent):
            del sf[leaf]  # another leaf was charged since: stale
            ent = None
        else:
            covers = cx.covers_leaf(leaf, ent)
            # search_failed(leaf, 1, 1) or search_failed(leaf, *floor), inlined
            if covers and model is None and not cx.may_backfill(leaf, 1, None):
                # drop the leaf: pass over all it has left (drop_leaf would also copy them out); with an age
                # weight, those that keep its key
                cx.queue.skip(leaf, steady - idx - 1)
                return
    if cx.reserved_for is None or not cx.cfg.preemption or idx + 1 >= steady:
        return
    # the leaf's next jobs come next (nothing was charged)
    drop = covers
    skipped = blocked_run(cx.pending[leaf], idx + 1, steady, partial(_blocked_like, cx, leaf, drop), cx.memo)
    if skipped:
        cx.queue.skip(leaf, skipped)
        cx.rank += skipped
        cx.res.considered += skipped
        cx.res.passed_over += skipped


def _blocked_like(cx: _Cycle, leaf: str, drop: bool, g: int, k: int, model: str | None) -> bool:
    """Whether a job of ``leaf`` with shape (g, k, model), taken now, would be blocked with no effect.

    Pass 1 for such a job: the free GPUs are known not to fit it, its preemption search is known to fail
    (not stale), no reservation is left to take, and it does not end the leaf (``drop``). It then changes
    nothing but ``rank``. A stale entry is dropped, as the job itself would drop it.
    """
    if cx.may_backfill(leaf, g, model):
        return False  # it may backfill the reservation's free GPUs (depending on its protection)
    if not cx.fit_failed(g, k, model):
        return False
    sf = cx.search_failures
    if model is None:
        return not drop and leaf in sf and cx.search_failed(leaf, g, k)
    failure_key = leaf + "\x00" + model
    return (failure_key in sf and cx.search_failed(failure_key, g, k)) or (leaf in sf and cx.search_failed(leaf, g, k))


def _pass_owner_free(cx: _Cycle) -> None:
    """Rule D3.owner-free: each leaf at or under its share (r <= 1 in the cycle's view) with unallocated work,
    in the current budget order, places its unallocated jobs on free GPUs (in their order) up to its headroom
    (:func:`~apportion.domain.fairshare.owner_headroom`), before the allocated jobs of leaves over their share.
    Not charged; preemptible as any unallocated run (D3.victims)."""
    q = cx.queue
    leaves = [
        leaf
        for leaf in q.order()
        if cx.allocated_end.get(leaf, 0) < len(cx.pending.get(leaf, ())) and q.ratio(leaf) <= 1.0
    ]
    if not leaves:
        return
    if cx.capacity < 0:
        cx.capacity = sum(cx.free.count.values())
    in_use = _gpus_in_use(cx)
    abs_share = cx.tree.abs_share
    for leaf in leaves:
        room = owner_headroom(abs_share(leaf), cx.capacity, in_use.get(leaf, 0))
        if room >= 1 and _place_unallocated(cx, leaf, cx.allocated_end.get(leaf, 0), False, room)[0] < 0:
            return  # not one GPU is left for a 1-GPU job


def _gpus_in_use(cx: _Cycle) -> dict[str, int]:
    """Leaf -> GPUs its runs hold (open replicas of runs not stopping, less those this cycle preempts) plus the
    GPUs placed for it so far in this cycle (rule D3.owner-free's headroom)."""
    taken = cx.victims.taken if cx.victims is not None else frozenset()
    out: dict[str, int] = {}
    for run in cx.snapshot.cluster.runs.values():
        if not run.stopping and run.key not in taken:
            placements = run.placements
            out[run.budget] = out.get(run.budget, 0) + sum(len(placements[r].gpus) for r in run.open_replicas)
    for e in cx.res.events:
        if type(e) is JobPlaced:
            out[e.budget] = out.get(e.budget, 0) + sum(len(p.gpus) for p in e.placements)
    return out


# ---------------------------------------------------------------- pass 2: unallocated jobs


def _pass_unallocated(cx: _Cycle) -> None:
    """Pass 2: the unallocated jobs on whatever is still free (D3.scheduling-cycle, D1.unallocated-job).

    Leaf by leaf in the budget order pass 1 left, every job of a leaf before the next leaf's; with
    ``EngineConfig.free_order``, by rule D3.free-order (:func:`~apportion.domain.fairshare.free_order_key`):
    one job at a time to the leaf with the fewest unallocated GPUs in use per unit of share, ties by that
    budget order; otherwise, with ``EngineConfig.free_las``, jobs not yet run first, by rule D3.free-las
    (:func:`_pass_least_attained`). The rank continues from pass 1. Jobs of a shape known not to fit
    are passed over in bulk.
    """
    free, free_fail = cx.free, cx.free_fail
    order = cx.queue.order()  # = budget_order of the occupancy after the provisional charges
    if free.reserved and free.reserved_free():
        # unallocated work may use a waiting reservation's free GPUs: the holder's preemption
        # search evicts it the moment it can start
        free.unreserve_all()
        free_fail.clear()
    if _dominated(free_fail.get(None, []), 1, 1):
        return  # not even one GPU was free for a 1-GPU job: no unallocated job fits
    todo = [leaf for leaf in order if cx.allocated_end.get(leaf, 0) < len(cx.pending.get(leaf, ()))]
    if cx.cfg.least_attained_free:
        _pass_least_attained(cx, todo)
        return
    if not cx.cfg.free_order:
        for leaf in todo:
            if _place_unallocated(cx, leaf, cx.allocated_end.get(leaf, 0), False)[0] < 0:
                break  # not one GPU is left for a 1-GPU job
        return
    in_use = _unallocated_in_use(cx)
    abs_share = cx.tree.abs_share
    heap = [
        (free_order_key(in_use.get(leaf, 0), abs_share(leaf)), pos, leaf, cx.allocated_end.get(leaf, 0))
        for pos, leaf in enumerate(todo)
    ]
    heapq.heapify(heap)
    while heap:
        _, pos, leaf, idx = heapq.heappop(heap)
        nxt, gpus = _place_unallocated(cx, leaf, idx, True)
        if nxt < 0:
            break  # not one GPU is left for a 1-GPU job
        if gpus and nxt < len(cx.pending[leaf]):
            used = in_use[leaf] = in_use.get(leaf, 0) + gpus
            heapq.heappush(heap, (free_order_key(used, abs_share(leaf)), pos, leaf, nxt))


def _pass_least_attained(cx: _Cycle, todo: list[str]) -> None:
    """Rule D3.free-las: the unallocated jobs by least attained service (``PendingJob.attained_gpu_s``), ties in
    the order without the rule. Every job that has not run yet (0 GPU-seconds) goes first, leaf by leaf in the
    budget order of ``todo`` as without the rule (the bulk passes over shapes that do not fit kept); then the
    requeued ones one at a time, fewest GPU-seconds first, ties by that order (sorted only when a GPU is left
    after the walk; a shape that did not fit is not tried again: free GPUs only shrink)."""
    pending, ends = cx.pending, cx.allocated_end
    if cx.cfg.free_age_s is not None and _place_aged_free(cx, todo, cx.cfg.free_age_s):
        return  # not one GPU is left for a 1-GPU job
    cfg = cx.cfg
    if cfg.free_starve_x is not None or cfg.free_starve_s is not None or cfg.free_las_levels_gpu_s is not None:
        _pass_starved_first(cx, todo)
        return
    for leaf in todo:  # (the walk passes over the requeued ones)
        if _place_unallocated(cx, leaf, ends.get(leaf, 0), False, fresh=True)[0] < 0:
            return  # not one GPU is left for a 1-GPU job
    if _dominated(cx.free_fail.get(None, ()), 1, 1):
        return
    placed = cx.owner_placed  # (placed by the aged pass)
    if not placed:
        _place_second_queue(cx, todo)
        return
    later: list[tuple[float, int, int, str]] = []
    queue_gpu_s = cx.cfg.free_las_queue_gpu_s
    for pos, leaf in enumerate(todo):
        start = ends.get(leaf, 0)
        for i, held in enumerate(map(_ATTAINED, islice(pending[leaf], start, None)), start):
            if held > 0 and not first_las_queue(held, queue_gpu_s) and pending[leaf][i].job_id not in placed:
                later.append((held, pos, i, leaf))
    later.sort()
    _place_in_turn(cx, ((leaf, pending[leaf][i]) for _, _, i, leaf in later))


_FreeShape = tuple[int, int, "str | None", "str | None"]
"""``(g, k, model, topology bound)`` of an unallocated job: what decides whether it fits on free GPUs."""

_free_shape = cast(
    Callable[[PendingJob], _FreeShape], attrgetter("gpus_per_replica", "replicas", "gpu_model", "topology_bound")
)
""":data:`_FreeShape` of a job."""

_LasEntry = tuple[float, int, str, PendingJob]
"""A job of rule D3.free-las's second queue: ``(attained GPU-s, submitted µs, job id, job)``. In a leaf's
unallocated jobs (submission order, ties by job id: :func:`~apportion.domain.engine.inputs.pending_order`) the
order of ``(attained, submitted, job id)`` is the order of ``(attained, index)``, and it stays so when jobs are
added to or removed from the list (no index to move)."""


def _las_entry(job: PendingJob) -> _LasEntry:
    """The second queue's entry of ``job``."""
    return (job.attained_gpu_s, job.submitted_at_us, job.job_id, job)


def _second_queue(
    jobs: Sequence[PendingJob], start: int, queue_gpu_s: float | None
) -> dict[_FreeShape, list[_LasEntry]]:
    """Rule D3.free-las's second queue in ``jobs[start:]`` (the requeued jobs not in :func:`first_las_queue`), per
    shape: :data:`_LasEntry` sorted. A leaf's jobs ordered as :func:`_pass_least_attained` orders them."""
    out: dict[_FreeShape, list[_LasEntry]] = {}
    for job in islice(jobs, start, None):
        held = job.attained_gpu_s
        if held > 0 and not first_las_queue(held, queue_gpu_s):
            lst = out.get(shape := _free_shape(job))
            if lst is None:
                out[shape] = [_las_entry(job)]
            else:
                lst.append(_las_entry(job))
    for lst in out.values():
        lst.sort()
    return out


def _kept_second_queue(
    memo: CycleMemo | None, jobs: Sequence[PendingJob], start: int, queue_gpu_s: float | None
) -> dict[_FreeShape, list[_LasEntry]]:
    """:func:`_second_queue`, kept with the list in ``memo`` and carried to the list that replaces it."""
    return memo_kept(
        memo, jobs, ("las", start, queue_gpu_s), partial(_second_queue, jobs, start, queue_gpu_s), _carry_second_queue
    )


def _carry_second_queue(
    key: Hashable,
    by_shape: dict[_FreeShape, list[_LasEntry]],
    job: PendingJob,
    added: bool,
    i: int,
    b_new: int,
) -> tuple[Hashable, dict[_FreeShape, list[_LasEntry]]] | None:
    """:func:`_second_queue` of the list that replaces one (``job`` added at or removed from index ``i``;
    :data:`~apportion.domain.engine.shapes.KeptCarry`) from the old list's, when it was made from the first
    unallocated job on (``key`` ``("las", start, queue_gpu_s)``, ``start`` the allocated count, as the cycle
    makes it): ``job`` joins or leaves its shape's list, the others are shared with the old list's queue (an
    entry holds no index: nothing else moves). Neither is changed in place."""
    _, start, queue_gpu_s = cast(tuple[str, int, "float | None"], key)
    if start + ((1 if added else -1) if job.allocated else 0) != b_new:
        return None  # (made from another start than the allocated count)
    new_key = ("las", b_new, queue_gpu_s)
    held = job.attained_gpu_s
    if job.allocated or held <= 0 or first_las_queue(held, queue_gpu_s):
        return new_key, by_shape  # not in the queue
    out = dict(by_shape)
    shape = _free_shape(job)
    lst = list(out.get(shape, ()))
    if added:
        insort(lst, _las_entry(job))
    else:
        at = bisect_left(lst, (held, job.submitted_at_us, job.job_id))
        if at == len(lst) or lst[at][3] is not job:
            return None  # (not the queue of the list ``job`` leaves: made again from the new list when read)
        del lst[at]
    if lst:
        out[shape] = lst
    else:
        del out[shape]
    return new_key, out


def _first_queue(jobs: Sequence[PendingJob], queue_gpu_s: float | None) -> list[int]:
    """The indices in ``jobs`` of the jobs in rule D3.free-las's first queue (:func:`first_las_queue`), ascending."""
    return [i for i, held in enumerate(map(_ATTAINED, jobs)) if first_las_queue(held, queue_gpu_s)]


def _kept_first_queue(memo: CycleMemo | None, jobs: Sequence[PendingJob], queue_gpu_s: float | None) -> list[int]:
    """:func:`_first_queue`, kept with the list in ``memo`` and carried to the list that replaces it."""
    return memo_kept(memo, jobs, ("first", queue_gpu_s), partial(_first_queue, jobs, queue_gpu_s), _carry_first_queue)


def _carry_first_queue(
    key: Hashable, firsts: list[int], job: PendingJob, added: bool, i: int, b_new: int
) -> tuple[Hashable, list[int]]:
    """:func:`_first_queue` of the list that replaces one (``job`` added at or removed from index ``i``;
    :data:`~apportion.domain.engine.shapes.KeptCarry`) from the old list's (``key`` ``("first",
    queue_gpu_s)``): the indices from ``i`` on move by one, ``i`` joins when ``job`` is in the first queue, or
    leaves."""
    queue_gpu_s = cast(tuple[str, "float | None"], key)[1]
    at = bisect_left(firsts, i)
    if added:
        mid = [i] if first_las_queue(job.attained_gpu_s, queue_gpu_s) else []
        return ("first", queue_gpu_s), firsts[:at] + mid + [j + 1 for j in islice(firsts, at, None)]
    past = at + 1 if at < len(firsts) and firsts[at] == i else at
    return ("first", queue_gpu_s), firsts[:at] + [j - 1 for j in islice(firsts, past, None)]


def _place_second_queue(cx: _Cycle, todo: list[str]) -> None:
    """Rule D3.free-las's second queue on free GPUs: the requeued jobs of ``todo``'s leaves, fewest GPU-seconds
    first, ties by budget order then place in the leaf, as :func:`_place_in_turn` on that order (the rank and the
    counters move by every job, tried or passed over) with ``owner_placed`` empty.

    Only the jobs of a shape not yet known not to fit are looked at: each leaf's jobs of one shape, sorted, are
    kept with its pending list (:func:`~apportion.domain.engine.shapes.memo_kept`) and merged across leaves, and
    a job's place in the whole order is counted by bisection. The queue grows with the run (the jobs a busy
    cluster preempts and cannot place again); a job per placement or failed shape is looked at, not the queue."""
    pending, ends, memo = cx.pending, cx.allocated_end, cx.memo
    queue_gpu_s = cx.cfg.free_las_queue_gpu_s
    lists: list[tuple[int, str, _FreeShape, list[_LasEntry]]] = []
    heap: list[tuple[float, int, int, str, int, int]] = []
    total = 0
    for pos, leaf in enumerate(todo):
        jobs, start = pending[leaf], ends.get(leaf, 0)
        by_shape = _kept_second_queue(memo, jobs, start, queue_gpu_s)
        for shape, lst in by_shape.items():
            total += len(lst)
            held, submitted, job_id, _ = lst[0]
            heap.append((held, pos, submitted, job_id, len(lists), 0))
            lists.append((pos, leaf, shape, lst))
    heapq.heapify(heap)
    res = cx.res
    rank0, considered0 = cx.rank, res.considered
    failed: set[_FreeShape] = set()
    while heap:
        held, pos, submitted, job_id, k, at = heapq.heappop(heap)
        _, leaf, shape, lst = lists[k]
        if shape in failed:
            continue
        nodes = _fit_free(cx, *shape)
        if nodes is None and shape != (1, 1, None, None):
            failed.add(shape)  # (the rank is not read: the next job's or the total replaces it)
            continue
        before = 0  # jobs ahead of this one in the order: (attained, budget order, place in the leaf)
        for pos2, _, _, lst2 in lists:
            if pos2 < pos:
                before += bisect_right(lst2, held, key=_FIRST)
            elif pos2 > pos:
                before += bisect_left(lst2, held, key=_FIRST)
            else:
                before += bisect_left(lst2, (held, submitted, job_id))
        cx.rank, res.considered = rank0 + before + 1, considered0 + before + 1
        if nodes is None:
            return  # not one GPU is left for a 1-GPU job
        _place_on_free(cx, lst[at][3], leaf, nodes, False)
        if at + 1 < len(lst):
            held, submitted, job_id, _ = lst[at + 1]
            heapq.heappush(heap, (held, pos, submitted, job_id, k, at + 1))
    cx.rank, res.considered = rank0 + total, considered0 + total


def first_las_queue(attained_gpu_s: float, queue_gpu_s: float | None) -> bool:
    """Is an unallocated job in rule D3.free-las's first queue, walked leaf by leaf in the budget order, each
    leaf's jobs in submission order? A job that has not run yet (0 GPU-seconds held) always is; with
    ``EngineConfig.free_las_queue_gpu_s`` (discretized least attained service, two queues as Tiresias's
    2D-LAS) so is a requeued job whose earlier attempts held fewer GPU-seconds than that, so a free job
    preempted early keeps its place among the jobs of its leaf. The others go after, fewest GPU-seconds first."""
    return attained_gpu_s <= 0 or (queue_gpu_s is not None and attained_gpu_s < queue_gpu_s)


def free_starved(attained_gpu_s: float, waited_s: float, starve_x: float | None, starve_s: float | None) -> bool:
    """Rule D3.free-starve: is a requeued unallocated job (``attained_gpu_s`` > 0) that has waited ``waited_s``
    since it was requeued promoted back to rule D3.free-las's first queue? When the wait exceeds ``starve_x``
    times its attained service (Tiresias's ``STARVELIMIT``: a job starved for longer than a multiple of the
    service it had goes back to the highest-priority queue), or exceeds ``starve_s``; ``None`` turns a test off."""
    return (starve_x is not None and waited_s > starve_x * attained_gpu_s) or (
        starve_s is not None and waited_s > starve_s
    )


def free_level(attained_gpu_s: float, levels_gpu_s: Sequence[float]) -> int:
    """Rule D3.free-starve's levels: how many of the ascending thresholds ``levels_gpu_s`` (GPU-seconds) a job's
    attained service has reached (a job at a threshold is in the level above it)."""
    return bisect_right(levels_gpu_s, attained_gpu_s)


def _pass_starved_first(cx: _Cycle, todo: list[str]) -> None:
    """Rule D3.free-starve on rule D3.free-las's order (``EngineConfig.free_starve_x``, ``free_starve_s``,
    ``free_las_levels_gpu_s``): a requeued free job starved past its limit (:func:`free_starved`, the wait since
    it was requeued) joins the jobs not yet run in its place in its leaf's submission order, walked leaf by leaf
    in the budget order; then the other requeued ones, fewest GPU-seconds first (ties by budget order, then
    place in the leaf), or with levels by (level, first submission, budget order, place in the leaf)."""
    pending, ends, cfg, now_us = cx.pending, cx.allocated_end, cx.cfg, cx.now_us
    queue_gpu_s, starve_x, starve_s = cfg.free_las_queue_gpu_s, cfg.free_starve_x, cfg.free_starve_s
    levels = cfg.free_las_levels_gpu_s
    placed = cx.owner_placed  # (placed by the aged pass)
    walks: list[tuple[str, int, list[int]]] = []
    later: list[tuple[float, float, int, int, str]] = []
    for pos, leaf in enumerate(todo):
        jobs, start = pending[leaf], ends.get(leaf, 0)
        up: list[int] = []
        index: dict[str, int] | None = None  # a job's place in the leaf (the queue's entries hold none)
        for lst in _kept_second_queue(cx.memo, jobs, start, queue_gpu_s).values():
            for held, _, job_id, job in lst:
                if index is None:
                    index = {j.job_id: n for n, j in enumerate(jobs)}
                i = index[job_id]
                if free_starved(held, (now_us - job.queued_at_us) / 1e6, starve_x, starve_s):
                    up.append(i)
                elif job.job_id not in placed:
                    if levels is None:
                        later.append((held, 0.0, pos, i, leaf))
                    else:
                        later.append((free_level(held, levels), job.submitted_at_us, pos, i, leaf))
        firsts = _kept_first_queue(cx.memo, jobs, queue_gpu_s)
        walks.append((leaf, start, sorted(firsts + up) if up else firsts))
    for leaf, start, firsts in walks:
        if _place_unallocated(cx, leaf, start, False, fresh=firsts)[0] < 0:
            return  # not one GPU is left for a 1-GPU job
    if _dominated(cx.free_fail.get(None, ()), 1, 1):
        return
    later.sort()
    _place_in_turn(cx, ((leaf, pending[leaf][i]) for _, _, _, i, leaf in later))


def _place_aged_free(cx: _Cycle, todo: list[str], age_s: float) -> bool:
    """Aged free work first (``EngineConfig.free_age_s``; a variant of rule D3.free-las measured in
    ``docs/simulation.md``, "Levers measured"): the unallocated jobs of ``todo``'s leaves submitted at least
    ``age_s`` ago, across all leaves oldest first (ties by job id), each on free GPUs if it fits; remembered in
    ``owner_placed``, so the rule's walk passes over them. A leaf's unallocated jobs are in submission order
    (:func:`~apportion.domain.engine.inputs.pending_order`), so its aged ones lead them. True when not one GPU
    is left for a 1-GPU job."""
    cutoff = cx.now_us - s_to_us(age_s)
    pending, ends = cx.pending, cx.allocated_end
    heads = []
    for leaf in todo:
        jobs, start = pending[leaf], ends.get(leaf, 0)
        stop = bisect_right(jobs, cutoff, start, key=_SUBMITTED)
        if stop > start:
            heads.append((j.submitted_at_us, j.job_id, leaf, j) for j in islice(jobs, start, stop))
    return _place_in_turn(cx, ((leaf, job) for _, _, leaf, job in heapq.merge(*heads)), cx.owner_placed)


def _place_in_turn(cx: _Cycle, jobs: Iterable[tuple[str, PendingJob]], placed: set[str] | None = None) -> bool:
    """Each (leaf, unallocated job) in turn on free GPUs if it fits (remembered in ``placed`` when given); a shape
    that did not fit is not tried again (free GPUs only shrink). True when not one GPU is left for a 1-GPU job."""
    res = cx.res
    failed: set[_FreeShape] = set()
    for leaf, job in jobs:
        shape = _free_shape(job)
        cx.rank += 1
        res.considered += 1
        if shape in failed:
            continue
        nodes = _fit_free(cx, *shape)
        if nodes is None:
            if shape == (1, 1, None, None):
                return True
            failed.add(shape)
            continue
        _place_on_free(cx, job, leaf, nodes, False)
        if placed is not None:
            placed.add(job.job_id)
    return False


def _unallocated_in_use(cx: _Cycle) -> dict[str, int]:
    """Leaf -> GPUs its unallocated runs hold (open replicas of runs not stopping) that this cycle does not
    preempt (D3.free-order); from the victim index when the caller keeps one (the same runs, fewer to walk)."""
    taken = cx.victims.taken if cx.victims is not None else frozenset()
    out: dict[str, int] = {}
    index = cx.snapshot.victims
    if index is not None:
        for lst in index.unalloc.values():
            for _, run, gpus in lst:
                if run.key not in taken:
                    out[run.budget] = out.get(run.budget, 0) + len(gpus)
        return out
    for run in cx.snapshot.cluster.runs.values():
        if not run.allocated and not run.stopping and run.key not in taken:
            placements = run.placements
            out[run.budget] = out.get(run.budget, 0) + sum(len(placements[r].gpus) for r in run.open_replicas)
    return out


def _place_unallocated(
    cx: _Cycle, leaf: str, start: int, one: bool, room: float | None = None, fresh: bool | list[int] = False
) -> tuple[int, int]:
    """Place ``leaf``'s unallocated jobs from ``pending[leaf][start]`` on free GPUs, in their order; with
    ``one``, stop after the first placed; with ``room``, only jobs of at most that many GPUs in all (rule
    D3.owner-free), remembered in ``owner_placed``. Jobs already placed that way are passed over, and with
    ``fresh`` the jobs that have run before (rule D3.free-las places them after; ``fresh`` a list: the indices
    of the jobs to walk instead, rule D3.free-starve's promoted ones among them). Returns
    (index of the next job to look at, GPUs placed), the index ``len(jobs)`` when nothing more of the leaf
    fits, -1 when not one GPU is free for a 1-GPU job."""
    free, free_fail, res = cx.free, cx.free_fail, cx.res
    jobs = cx.pending[leaf]
    end = len(jobs)
    any_free = free_fail.get(None, [])
    if _dominated(any_free, 1, 1):
        return -1, 0
    r_leaf = cx.queue.ratio(leaf)
    mg, mk = cx.floor_shape(leaf, cx.allocated_end.get(leaf, 0), end)
    if _dominated(any_free, mg, mk):
        return end, 0  # nothing of this leaf fits on what is free
    idx = start - 1
    owner = cx.owner_placed
    queue_gpu_s = cx.cfg.free_las_queue_gpu_s
    # with ``fresh``, the walk steps from one job of the first queue to the next (:func:`_first_queue`, kept with
    # the list), passing over the others uncounted
    firsts = fresh if isinstance(fresh, list) else _kept_first_queue(cx.memo, jobs, queue_gpu_s) if fresh else None
    while idx + 1 < end:
        if firsts is None:
            idx += 1
        else:
            at = bisect_right(firsts, idx)
            if at == len(firsts):
                break
            idx = firsts[at]
        job = jobs[idx]
        if (owner and job.job_id in owner) or (
            fresh is True and job.attained_gpu_s > 0 and not first_las_queue(job.attained_gpu_s, queue_gpu_s)
        ):
            continue
        cx.rank += 1
        res.considered += 1
        g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
        if room is not None and g * k > room:
            continue
        if _dominated(free_fail.get(model, ()), g, k) or (model is not None and _dominated(any_free, g, k)):
            # known not to fit, and so are the next jobs of a shape that does not fit: pass over them
            n = blocked_run(jobs, idx + 1, end, partial(_fits_nowhere, free_fail, any_free), cx.memo)
            idx += n
            cx.rank += n
            res.considered += n
            res.passed_over += n
            continue
        nodes = free.fit(g, k, model, job.topology_bound)
        if nodes is None and job.topology_bound is not None:
            continue  # (a bound's failure says nothing about unbound shapes)
        if nodes is None:
            free_fail.setdefault(model, []).append((g, k))
            any_free = free_fail.get(None, [])
            if model is None and _dominated(any_free, mg, mk):
                return end, 0
            continue
        placements = tuple([placement(n, free.take(n, g)) for n in nodes])
        emit_placed(
            res.events, job, placements, (), leaf, cx.rank, cx.budget_rank, r_leaf, False, cx.ts, cx.cfg, cx.tree
        )
        res.events.extend(pending_start_events(job, placements, cx.ts, cx.cfg.producer))
        if room is not None:
            owner.add(job.job_id)
            room -= g * k
            if room < 1:
                return idx + 1, 0
        if one:
            return idx + 1, g * k
    return end, 0


def _fits_nowhere(
    free_fail: Mapping[str | None, Sequence[tuple[int, int]]],
    any_free: Sequence[tuple[int, int]],
    g: int,
    k: int,
    model: str | None,
) -> bool:
    """Free GPUs are known not to fit an unallocated job of shape (g, k, model)."""
    return _dominated(free_fail.get(model, ()), g, k) or (model is not None and _dominated(any_free, g, k))


def _explain(cx: _Cycle, only: Set[str] | None = None) -> dict[str, PendingReason]:
    """:func:`explain_pending` on what the cycle left (its free index, preempted runs, view of r, reservation)."""
    res, victims, snap = cx.res, cx.victims, cx.snapshot
    left = CycleLeft(
        free=cx.free,
        view=cx.queue,
        taken=victims.taken if victims is not None else frozenset(),
        budget_rank=cx.budget_rank,
        reservation=res.reservation,
        moves=cx.moves,
        placed={e.job_id for e in res.events if type(e) is JobPlaced},
        waits=victims.waits if victims is not None else {},
        checkpoint_waits=victims.checkpoint_waits if victims is not None else {},
    )
    return explain_pending(snap.pending, snap.tree, snap.cluster, cx.now_us, cx.cfg, left, only)
