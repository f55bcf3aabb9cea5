"""One scheduling cycle, the one entry point: :func:`run_cycle` (DESIGN section 3).

:func:`run_cycle` takes an immutable :class:`CycleSnapshot` (cluster, pending
jobs per leaf budget, budget tree, window occupancy) and the cycle's event
time, and returns the decision events (:attr:`CycleResult.events`). It
never mutates its input: a cycle works on its own scratch indices built
from the snapshot.

The cycle, exactly as DESIGN section 3 says:

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
4. Unallocated jobs only go on free GPUs.
5. A job that cannot be placed does not block the ones behind it
   (backfill), except: the highest-ranked blocked allocated job that has
   waited (since it was queued) at least ``reservation_after`` reserves k
   nodes (those with the most free GPUs, ties by id); no job ranked below it
   lands there in this cycle, except as :func:`backfill_rule` allows (a
   reservation never idles GPUs): unallocated work, and allocated work the
   holder could take back whose protection ends by the holder's earliest
   fit (:func:`earliest_fit_us`, which counts only the runs the holder may
   take back). A holder with no known fit time (it waits on runs it may not
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
  (:meth:`FairShareQueue.drop_leaf`); the next cycle looks again;
* the preemption search looks only at nodes holding candidate victims.

Event ids come from :func:`det_id`, times from ``now_us``: the same snapshot
and time always give the same events, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import islice
from operator import attrgetter
from typing import Any

from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import UNTIL_STARTED, ClusterSnapshot, Run
from apportion.domain.engine.emit import (
    emit_placed,
    job_protection_s,
    pending_start_events,
    preempt_events,
    protection_cap_us,
)
from apportion.domain.engine.inputs import EngineConfig, PendingJob, allocated_count
from apportion.domain.engine.placement import CycleFree, FreeIndex, spare_models
from apportion.domain.engine.reasons import PendingReason, explain_pending
from apportion.domain.engine.reservation import earliest_fit_us, reservation_nodes
from apportion.domain.engine.search import plan_preemption
from apportion.domain.engine.shapes import CycleMemo, blocked_run, segment_floor
from apportion.domain.engine.victims import CycleVictims, VictimIndex
from apportion.domain.fairshare import FairShareQueue
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
from apportion.events import Event, JobPlaced, Placement
from apportion.timeutil import Micros, from_us, s_to_us

__all__ = ["CycleResult", "CycleSnapshot", "run_cycle"]

_MIN_RT = attrgetter("min_runtime_s")


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
    ``pending`` lists (floors and shape codes, and the shape table of the
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
    snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig | None = None, *, explain: bool = False
) -> CycleResult:
    """Run one scheduling cycle (DESIGN section 3); see the module docstring.

    Args:
        snapshot: the frozen inputs.
        now_us: cycle event time, µs since the epoch UTC.
        config: policy knobs (defaults when ``None``).
        explain: also say why each job left pending is still pending.

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
    else preemption, provisional charge, reservation), then the unallocated
    jobs on whatever is still free, in the budget order the first pass left
    (they are not charged, so that order no longer changes). A GPU that an
    allocated job can use in this cycle is not idle, so an unallocated job
    placed there would only be preempted in the next cycle: in the Philly
    replay this ordering removes that churn (docs/simulation.md).
    """
    cfg = config or EngineConfig()
    res = CycleResult()
    tree = snapshot.tree
    pending = {leaf: jobs for leaf, jobs in snapshot.pending.items() if jobs and tree.is_leaf(leaf)}
    if not pending:
        if explain:
            res.reasons = explain_pending(
                snapshot.pending, tree, snapshot.cluster, now_us, cfg, None, set(), None, {}, None, set(), set()
            )
        return res
    cluster = snapshot.cluster
    ts = from_us(now_us)
    reservation_after_us = s_to_us(cfg.reservation_after_s)
    # leaf -> end of its allocated jobs: pending[leaf][:allocated_end[leaf]] are allocated, the rest unallocated
    allocated_end = {leaf: allocated_count(jobs) for leaf, jobs in pending.items()}
    queue: FairShareQueue[int] = FairShareQueue(
        tree, snapshot.occupancy, snapshot.capacity_gpu_s, {leaf: range(b) for leaf, b in allocated_end.items() if b}
    )
    budget_rank = {leaf: i for i, leaf in enumerate(queue.initial_order)}
    free = CycleFree(cluster, snapshot.free)
    if len(free.buckets) > 1:
        free.prefer = spare_models(list(free.buckets), pending)
    victims: CycleVictims | None = None
    out = res.events
    free_fail: dict[str | None, list[tuple[int, int]]] = {}  # model -> shapes (g, k) that did not fit free GPUs
    # failure key (leaf, or leaf NUL model) -> (shapes whose preemption search failed for any charge,
    #   charges at record time, own charges at record time, (g, k, charge) failed for charges of at least that much)
    search_failures: dict[str, tuple[list[tuple[int, int]], int, int, list[tuple[int, int, float]]]] = {}
    moves: set[Move] = set()  # this cycle's preemptions of allocated work (no same-cycle reversal)
    hold_fit: Micros = 0  # earliest_fit_us of this cycle's reservation when its nodes have free GPUs
    hold_leaf, hold_charge = "", 0.0  # the reservation holder's leaf and provisional charge
    min_rt: dict[str, float] = {}  # leaf -> smallest min_runtime_s of its allocated jobs (while hold_fit)

    def may_backfill(leaf: str, g: int, model: str | None) -> bool:
        """Some job of ``leaf`` of at least ``g`` GPUs might still backfill the reservation: a reserved
        node fits ``g`` and the leaf's shortest minimum runtime (a lower bound of any protection)
        ends by the holder's fit time."""
        if not hold_fit or not free.reserved_fits(g, model):
            return False
        m = min_rt.get(leaf)
        if m is None:
            m = min_rt[leaf] = min(map(_MIN_RT, islice(pending[leaf], 0, allocated_end[leaf])), default=0.0)
        return backfill_rule(True, s_to_us(m), now_us, hold_fit)

    caps: dict[str, Micros | None] = {}

    def gang_cap(budget: str) -> Micros | None:
        """The protection cap of ``budget``'s runs (:func:`protection_cap_us`), once per cycle and budget."""
        if budget not in caps:
            caps[budget] = protection_cap_us(budget, tree, cfg)
        return caps[budget]

    charges = 0
    own_charges: dict[str, int] = {}
    floors: dict[tuple[str, int], tuple[int, int]] = {}
    reserved_for: str | None = None
    memo = snapshot.memo
    rank = -1
    ratio = queue.ratio

    def search_failed(leaf: str, g: int, k: int, charge: float | None = None) -> bool:
        """Known to fail: a search of a shape <= (g, k) failed for any charge, or (with ``charge``)
        for a charge <= this one (the after-move test only gets stricter as the charge grows)."""
        ent = search_failures.get(leaf)
        if ent is None:
            return False
        shapes, c0, o0, charged = ent
        if charges - c0 != own_charges.get(leaf, 0) - o0:
            del search_failures[leaf]  # another leaf was charged since: stale
            return False
        if _dominated(shapes, g, k):
            return True
        if charge is None or not charged:
            return False
        for fg, fk, fc in charged:
            if fg <= g and fk <= k and fc <= charge:
                return True
        return False

    def record_search_failure(leaf: str, g: int, k: int, charge: float | None = None) -> None:
        """Remember a failed search; ``charge``: it failed only for charges of at least this much."""
        ent = search_failures.get(leaf)
        if ent is None or charges - ent[1] != own_charges.get(leaf, 0) - ent[2]:
            ent = search_failures[leaf] = ([], charges, own_charges.get(leaf, 0), [])
        if charge is None:
            ent[0].append((g, k))
        else:
            ent[3].append((g, k, charge))

    def floor_shape(leaf: str, lo: int, hi: int) -> tuple[int, int]:
        """Smallest g and smallest k in pending[leaf][lo:hi]: a lower bound of any job left there."""
        key = (leaf, lo)
        f = floors.get(key)
        if f is None:
            f = floors[key] = segment_floor(memo, pending[leaf], lo, hi)
        return f

    def blocked_shape(leaf: str) -> Callable[[int, int, str | None], bool]:
        """Whether a job of ``leaf`` with shape (g, k, model), taken now, would be blocked with no effect.

        Pass 1 for such a job: the free GPUs are known not to fit it
        (``free_fail``), its preemption search is known to fail
        (``search_failed``, not stale), no reservation is left to take, and it
        does not end the leaf (``drop``). It then changes nothing but
        ``rank``. A stale entry is dropped, as the job itself would drop it.
        """
        ent = search_failures.get(leaf)
        drop = (
            ent is not None
            and charges - ent[1] == own_charges.get(leaf, 0) - ent[2]
            and ((1, 1) in ent[0] or _dominated(ent[0], *floor_shape(leaf, 0, allocated_end[leaf])))
        )

        def blocked(g: int, k: int, model: str | None) -> bool:
            if may_backfill(leaf, g, model):
                return False  # it may backfill the reservation's free GPUs (depending on its protection)
            fit_failures = free_fail.get(model)
            if not (
                (fit_failures and _dominated(fit_failures, g, k))
                or (model is not None and _dominated(free_fail.get(None, ()), g, k))
            ):
                return False
            if model is None:
                return not drop and leaf in search_failures and search_failed(leaf, g, k)
            failure_key = leaf + "\x00" + model
            return (failure_key in search_failures and search_failed(failure_key, g, k)) or (
                leaf in search_failures and search_failed(leaf, g, k)
            )

        return blocked

    # ---------------------------------------------------------------- pass 1: allocated jobs
    while True:
        item = queue.pop()
        if item is None:
            break
        leaf, idx = item
        job = pending[leaf][idx]
        rank += 1
        res.considered += 1
        g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
        nodes: list[str] | None = None
        fit_failures = free_fail.get(model)
        if not (
            (fit_failures and _dominated(fit_failures, g, k))
            or (model is not None and _dominated(free_fail.get(None, ()), g, k))
        ):
            nodes = free.fit(g, k, model)
            if nodes is None:
                if fit_failures is None:
                    free_fail[model] = [(g, k)]
                else:
                    fit_failures.append((g, k))
        if (
            nodes is None
            and hold_fit
            and now_us + s_to_us(job.min_runtime_s) <= hold_fit  # protection >= min_runtime: else no chance
            and free.reserved_fits(g, model)
        ):
            # backfill the waiting reservation's free GPUs (DESIGN section 3: a reservation never idles GPUs)
            prot = job_protection_s(job, tree, cfg)
            br = _branches(leaf, hold_leaf)
            may = br is not None and (
                branch_rule(br[0], br[1], br[2], queue, cfg.delta, hold_charge, moves)[0] == RULE_EXPIRED_BEHIND
            )
            if backfill_rule(True, s_to_us(prot), now_us, hold_fit, may):
                nodes = free.fit_with_reserved(g, k, model)
                if nodes is not None and not free.reserved_free():
                    hold_fit = 0  # the reservation's GPUs are all lent: nothing more to backfill
        holds_reservation = reserved_for is None and now_us - job.queued_at_us >= reservation_after_us
        failure_key = leaf if model is None else leaf + "\x00" + model
        charge = charge_of(g, k, job.min_runtime_s, cfg.window_s)
        if nodes is not None:
            placements = tuple(Placement(node_id=n, gpus=free.take(n, g)) for n in nodes)
            emit_placed(
                out, job, placements, (), leaf, rank, budget_rank, ratio(leaf), holds_reservation, ts, cfg, tree
            )
            out.extend(pending_start_events(job, placements, ts, cfg.producer))
        elif (
            cfg.preemption
            and not (failure_key in search_failures and search_failed(failure_key, g, k, charge))
            and (model is None or not (leaf in search_failures and search_failed(leaf, g, k, charge)))
        ):
            if victims is None:
                victims = CycleVictims(cluster, now_us, snapshot.victims, snapshot.idle, tree)
            res.searches += 1
            plan = plan_preemption(
                job,
                leaf,
                free,
                victims,
                now_us,
                queue,
                cfg.delta,
                charges,
                tree,
                charge,
                moves,
                cfg.patience_s,
                cfg.checkpoint_wait_s,
                cfg.gang_rule,
                gang_cap,
            )
            if plan is None:
                # (a refusal by patience_rule or checkpoint_rule depends on this job's wait or victims' timing)
                # (and one that spared a gang larger than the job says nothing about larger jobs: gang_rule)
                if (
                    job.job_id not in victims.waits
                    and job.job_id not in victims.checkpoint_waits
                    and not victims.spared
                ):
                    record_search_failure(failure_key, g, k, charge if victims.narrowed else None)
            else:
                placements, chosen = plan
                vics = []
                for run, vic in chosen:
                    victims.taken.add(run.key)
                    if vic.rule == RULE_EXPIRED_BEHIND:
                        br = _branches(run.budget, leaf)
                        if br is not None:
                            moves.add(br)
                    out.extend(
                        preempt_events(
                            run, ts, cfg.grace_s, cfg.producer, victim=vic, by_job_id=job.job_id, by_budget=leaf
                        )
                    )
                    vics.append(vic)
                emit_placed(
                    out,
                    job,
                    placements,
                    tuple(vics),
                    leaf,
                    rank,
                    budget_rank,
                    ratio(leaf),
                    holds_reservation,
                    ts,
                    cfg,
                    tree,
                )
                nodes = [p.node_id for p in placements]
        elif not cfg.preemption:
            record_search_failure(failure_key, g, k)
        if nodes is not None:
            queue.charge(leaf, charge)
            charges += 1
            own_charges[leaf] = own_charges.get(leaf, 0) + 1
            continue
        # blocked
        if holds_reservation:
            reserved_for = job.job_id
            unalloc_gpus: dict[str, int] | None = None
            if victims is not None:
                taken = victims.taken
                unalloc_gpus = {
                    n: sum(len(x[2]) for x in lst if x[1].key not in taken) for n, lst in victims.unalloc.items()
                }
            chosen_nodes = reservation_nodes(free, g, k, model, unalloc_gpus)
            for n in chosen_nodes:
                free.reserve(n)
            res.reservation = (job.job_id, tuple(chosen_nodes))
            if free.reserved_free():

                def may_take(
                    run: Run, at_us: Micros, leaf: str = leaf, charge: float = charge, gpus: int = g * k
                ) -> bool:
                    return victim_rule(
                        run,
                        leaf,
                        at_us,
                        queue,
                        cfg.delta,
                        charge,
                        moves,
                        gpus if cfg.gang_rule else None,
                        ignore_protection=True,
                        gang_cap_us=gang_cap(run.budget),
                    ).allowed

                hold_fit = earliest_fit_us(
                    cluster, chosen_nodes, g, now_us, victims.taken if victims else set(), may_take
                )
                if hold_fit >= UNTIL_STARTED:
                    # no known time to fit (it waits on runs it may not take back): it keeps no GPU free
                    # for itself (DESIGN section 3), lower-ranked work may use them as any other
                    free.unreserve_all()
                    hold_fit = 0
                else:
                    hold_leaf, hold_charge = leaf, charge
            continue  # the reservation changed free capacity: no bulk skip on its account
        if model is None:
            ent = search_failures.get(leaf)  # search_failed(leaf, 1, 1) or search_failed(leaf, *floor), inlined
            if ent is not None:
                if charges - ent[1] != own_charges.get(leaf, 0) - ent[2]:
                    del search_failures[leaf]  # another leaf was charged since: stale
                elif (
                    (1, 1) in ent[0] or _dominated(ent[0], *floor_shape(leaf, 0, allocated_end[leaf]))
                ) and not may_backfill(leaf, 1, None):
                    queue.drop_leaf(leaf)
                    continue
        if reserved_for is not None and cfg.preemption and idx + 1 < allocated_end[leaf]:
            # The leaf's next jobs come next (nothing was charged). Pass over those that
            # would be blocked exactly like this one, with no effect but their rank.
            jobs = pending[leaf]
            skipped = blocked_run(jobs, idx + 1, allocated_end[leaf], blocked_shape(leaf), memo)
            if skipped:
                queue.skip(leaf, skipped)
                rank += skipped
                res.considered += skipped
                res.passed_over += skipped

    # ---------------------------------------------------------------- pass 2: unallocated jobs
    if any(b < len(pending[leaf]) for leaf, b in allocated_end.items()):
        _place_unallocated(
            res, pending, allocated_end, queue, free, free_fail, floor_shape, memo, rank, budget_rank, ts, cfg, tree
        )
    if explain:
        res.reasons = _explain(snapshot, now_us, cfg, res, free, victims, queue, budget_rank, moves)
    return res


def _place_unallocated(
    res: CycleResult,
    pending: Mapping[str, Sequence[PendingJob]],
    allocated_end: Mapping[str, int],
    queue: FairShareQueue[int],
    free: CycleFree,
    free_fail: dict[str | None, list[tuple[int, int]]],
    floor_shape: Callable[[str, int, int], tuple[int, int]],
    memo: CycleMemo | None,
    rank: int,
    budget_rank: Mapping[str, int],
    ts: datetime,
    cfg: EngineConfig,
    tree: BudgetTree,
) -> None:
    """Pass 2 of :func:`run_cycle`: the unallocated jobs on whatever is still free (DESIGN section 3, step 4).

    In the budget order pass 1 left (unallocated jobs are not charged, so it
    no longer changes); ``rank`` continues from pass 1. Jobs of a shape known
    not to fit are passed over in bulk.
    """
    out = res.events
    order = queue.order()  # = budget_order of the occupancy after the provisional charges
    if free.reserved and free.reserved_free():
        # unallocated work may use a waiting reservation's free GPUs: the holder's preemption
        # search evicts it the moment it can start (DESIGN section 3)
        free.unreserve_all()
        free_fail.clear()
    any_free = free_fail.get(None, [])
    if _dominated(any_free, 1, 1):
        return  # not even one GPU was free for a 1-GPU job: no unallocated job fits
    for leaf in order:
        jobs = pending.get(leaf)
        if not jobs or allocated_end[leaf] >= len(jobs):
            continue
        if _dominated(any_free, 1, 1):
            break  # not one GPU is left for a 1-GPU job
        r_leaf = queue.ratio(leaf)
        mg, mk = floor_shape(leaf, allocated_end[leaf], len(jobs))
        if _dominated(any_free, mg, mk):
            continue  # nothing of this leaf fits on what is free
        end = len(jobs)
        idx = allocated_end[leaf] - 1
        while idx + 1 < end:
            idx += 1
            job = jobs[idx]
            rank += 1
            res.considered += 1
            g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
            if _dominated(free_fail.get(model, ()), g, k) or (model is not None and _dominated(any_free, g, k)):
                # known not to fit, and so are the next jobs of a shape that does not fit: pass over them
                def still_blocked(
                    g2: int, k2: int, m2: str | None, ff_now: Any = free_fail, af_now: Any = any_free
                ) -> bool:
                    return _dominated(ff_now.get(m2, ()), g2, k2) or (m2 is not None and _dominated(af_now, g2, k2))

                n = blocked_run(jobs, idx + 1, end, still_blocked, memo)
                idx += n
                rank += n
                res.considered += n
                res.passed_over += n
                continue
            nodes = free.fit(g, k, model)
            if nodes is None:
                free_fail.setdefault(model, []).append((g, k))
                any_free = free_fail.get(None, [])
                if model is None and _dominated(any_free, mg, mk):
                    break
                continue
            placements = tuple(Placement(node_id=n, gpus=free.take(n, g)) for n in nodes)
            emit_placed(out, job, placements, (), leaf, rank, budget_rank, r_leaf, False, ts, cfg, tree)
            out.extend(pending_start_events(job, placements, ts, cfg.producer))


def _explain(
    snapshot: CycleSnapshot,
    now_us: Micros,
    cfg: EngineConfig,
    res: CycleResult,
    free: CycleFree,
    victims: CycleVictims | None,
    queue: FairShareQueue[int],
    budget_rank: Mapping[str, int],
    moves: set[Move],
) -> dict[str, PendingReason]:
    """:func:`explain_pending` on what the cycle left (its free index, preempted runs, view of r, reservation)."""
    placed = {e.job_id for e in res.events if type(e) is JobPlaced}
    taken = victims.taken if victims is not None else set()
    return explain_pending(
        snapshot.pending,
        snapshot.tree,
        snapshot.cluster,
        now_us,
        cfg,
        free,
        taken,
        queue,
        budget_rank,
        res.reservation,
        moves,
        placed,
        victims.waits if victims is not None else {},
        victims.checkpoint_waits if victims is not None else {},
    )
