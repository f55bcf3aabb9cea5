"""The preemption rules of design D3, as small typed functions (the engine's search calls them).

* :func:`victim_rule`: may a run be preempted for a job of leaf B? Candidates
  1 (unallocated runs), idle allocated runs past their protection
  (:func:`idle_rule`, D3.idle-runs) and 2 (allocated runs past their
  protection whose branch is behind by delta at the lowest common ancestor,
  with the after-move test and no same-cycle reversal, :func:`branch_rule`).
* :func:`backfill_rule`: may a lower-ranked job use a waiting reservation's
  free GPUs ("a reservation never idles GPUs")?
* :func:`charge_of`: the provisional in-cycle charge of a placed allocated
  job (rule D2.provisional-charge).
* :func:`patience_rule`: is the least-cost victim set worth the work it
  throws away now, or should a job of a budget at or over its share wait?
* :func:`checkpoint_rule`: would waiting for the victims' next checkpoint
  cost the job fewer GPU-seconds than the work it saves?

Pure: functions of the run, the cycle's :class:`ShareView` and event time.
The table tests in ``tests/unit/test_preemption_rules.py`` name each rule id.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, Protocol

from apportion.domain.cluster import Run
from apportion.domain.fairshare import branches_at_lca
from apportion.timeutil import Micros, s_to_us

__all__ = [
    "ALLOWING_RULES",
    "Move",
    "RULE_EXPIRED_BEHIND",
    "RULE_IDLE",
    "RULE_UNALLOCATED",
    "ShareView",
    "VictimVerdict",
    "backfill_rule",
    "branch_rule",
    "branches_of",
    "charge_of",
    "CheckpointVerdict",
    "checkpoint_rule",
    "gang_bound_us",
    "gang_rule",
    "idle_rule",
    "patience_rule",
    "ran_us",
    "victim_rule",
]


#: Rule ids of :func:`victim_rule` (rule D3.victims). The two that allow a preemption:
RULE_UNALLOCATED: Final = "unallocated"  # pragma: no mutate (a rule id: tests compare with the constant)
"""Candidate class 1: an unallocated run (any budget), preemptible at any time."""
RULE_EXPIRED_BEHIND: Final = "expired_behind"  # pragma: no mutate (a rule id: tests compare with the constant)
"""Candidate class 2: an allocated run past its protection whose branch is behind by delta."""
RULE_IDLE: Final = "idle"  # pragma: no mutate (a rule id: tests compare with the constant)
"""D3.idle-runs: an allocated run past its protection whose GPUs its node agents report idle for at least its
budget's ``preempt_idle_after_s`` (:func:`idle_rule`), for any job that fits."""
#: ... and the refusals, first that applies in this order:
REFUSED_STOPPING = "stopping"  # pragma: no mutate (a rule id: tests compare with the constant)
REFUSED_PROTECTED = "protected"  # pragma: no mutate (a rule id: tests compare with the constant)
REFUSED_GANG_FRACTION = "gang_fraction"  # pragma: no mutate (a rule id: tests compare with the constant)
REFUSED_SAME_LEAF = "same_leaf"  # pragma: no mutate (a rule id: tests compare with the constant)
REFUSED_ONE_LINE = "one_line"  # pragma: no mutate (a rule id: tests compare with the constant)
REFUSED_REVERSAL = "same_cycle_reversal"  # pragma: no mutate (a rule id: tests compare with the constant)
REFUSED_NOT_BEHIND = "not_behind"  # pragma: no mutate (a rule id: tests compare with the constant)
REFUSED_AFTER_MOVE = "after_move_inversion"  # pragma: no mutate (a rule id: tests compare with the constant)
ALLOWING_RULES = frozenset({RULE_UNALLOCATED, RULE_IDLE, RULE_EXPIRED_BEHIND})

#: Rule ids of :func:`patience_rule`, in the order it applies them. Allowed:
PATIENCE_OFF = "patience_off"  # pragma: no mutate (a rule id: tests compare with the constant)
"""``patience_s == 0``: every least-cost plan is taken at once (the baselines, and logs decided before it)."""
PATIENCE_UNDER_SHARE = "under_share"  # pragma: no mutate (a rule id: tests compare with the constant)
"""The preemptor's leaf is under its share (r < 1): fair share is owed now, whatever the cost."""
PATIENCE_NOTHING_LOST = "nothing_lost"  # pragma: no mutate (a rule id: tests compare with the constant)
"""The victims lose no work (each at its checkpoint or just started)."""
PATIENCE_REPAID = "repaid"  # pragma: no mutate (a rule id: tests compare with the constant)
"""The GPU-seconds the job has waited cover the work the victims would lose."""
PATIENCE_SPENT = "patience_spent"  # pragma: no mutate (a rule id: tests compare with the constant)
"""The job has waited ``patience_s``: it preempts whatever the cost."""
#: ... and the refusal:
PATIENCE_WAIT = "not_worth_yet"  # pragma: no mutate (a rule id: tests compare with the constant)
"""A job at or over its share would throw away more work than it has waited for: it waits (GPUs may free up)."""

#: Rule ids of :func:`checkpoint_rule`. The plan is taken now:
CHECKPOINT_OFF = "checkpoint_off"  # pragma: no mutate (a rule id: tests compare with the constant)
"""``wait_s == 0``: no preemption waits for a checkpoint (the baselines, and logs decided before fairtree-4)."""
CHECKPOINT_NONE_DUE = "none_due"  # pragma: no mutate (a rule id: tests compare with the constant)
"""No victim that would lose work is expected to checkpoint within ``wait_s``: waiting saves nothing."""
CHECKPOINT_NOT_WORTH = "not_worth_waiting"  # pragma: no mutate (a rule id: tests compare with the constant)
"""Waiting for the checkpoints would cost the job at least the GPU-seconds it saves."""
#: ... or it waits:
CHECKPOINT_WAIT = "checkpoint_soon"  # pragma: no mutate (a rule id: tests compare with the constant)
"""The victims checkpoint soon: the job waits for them, fewer GPU-seconds than the work it saves."""

Move = tuple[str, str, str]  # pragma: no mutate (a type alias)
"""A preemption of work of one branch for another, ``(lca, victim_branch, preemptor_branch)``."""


class ShareView(Protocol):
    """The one view of r a cycle decides on (:class:`~apportion.domain.fairshare.FairShareQueue`).

    Both methods include every provisional charge of the cycle so far, for
    every budget (rule D3.consistent-view: "the r of both branches includes the
    same in-cycle provisional charges").
    """

    def ratio(self, path: str) -> float:
        """r of ``path`` now."""
        ...

    def ratio_after(self, path: str, gpu_s: float) -> float:
        """r of ``path`` with ``gpu_s`` more GPU-seconds of occupancy."""
        ...


@dataclass(frozen=True, slots=True)  # pragma: no mutate (flags: no behaviour)
class VictimVerdict:
    """What :func:`victim_rule` says about one run.

    Attributes:
        rule: a rule id: :data:`RULE_UNALLOCATED`, :data:`RULE_IDLE` or :data:`RULE_EXPIRED_BEHIND`
            when allowed, else the refusal (``REFUSED_*``).
        lca: lowest common ancestor of the two leaves (allocated runs of
            another line of the tree only).
        victim_ratio, preemptor_ratio: r of the victim's and the preemptor's
            branch at the LCA, with the cycle's provisional charges.
        preemptor_ratio_after: the preemptor's branch r with the job charged.
    """

    rule: str
    lca: str | None = None  # pragma: no mutate (annotations are inert here)
    victim_ratio: float | None = None  # pragma: no mutate (annotations are inert here)
    preemptor_ratio: float | None = None  # pragma: no mutate (annotations are inert here)
    preemptor_ratio_after: float | None = None  # pragma: no mutate (annotations are inert here)

    @property
    def allowed(self) -> bool:
        """True for :data:`RULE_UNALLOCATED`, :data:`RULE_IDLE` and :data:`RULE_EXPIRED_BEHIND`."""
        return self.rule in ALLOWING_RULES


def branch_rule(
    lca: str,
    victim_branch: str,
    preemptor_branch: str,
    view: ShareView,
    delta: float,
    charge_gpu_s: float,
    moves: frozenset[Move] | set[Move] = frozenset(),
) -> tuple[str, float, float, float]:
    """The branch comparison of candidate 2 of rule D3.victims, at the LCA: ``(rule id, r_V, r_B, r_B_after)``.

    Allowed (:data:`RULE_EXPIRED_BEHIND`) when all hold, in this order of
    refusal:

    1. no same-cycle reversal: the cycle has not already preempted work of
       the preemptor's branch for the victim's (``(lca, preemptor_branch,
       victim_branch)`` not in ``moves``) -> else :data:`REFUSED_REVERSAL`;
    2. hysteresis: ``r_V >= r_B + delta`` -> else :data:`REFUSED_NOT_BEHIND`;
    3. after the move the preemptor's branch is not ahead of the victim's:
       ``r_B_after <= r_V``, with ``r_B_after`` the preemptor's branch r with
       the job's provisional charge ``charge_gpu_s`` added (Kueue's
       LessThanOrEqualToFinalShare; the victim's past occupancy stays in the
       window, so "V without the victim" is ``r_V``) -> else
       :data:`REFUSED_AFTER_MOVE`.

    Every r comes from ``view``: the same provisional charges on both sides.
    With 2 and 3 the pair cannot swap back in the cycle on its own (B, once
    charged, is at most at V's r, and charges only grow); 1 forbids it when
    B's later placements on free GPUs would otherwise push it past V + delta.

    Args:
        lca: the lowest common ancestor.
        victim_branch, preemptor_branch: the children of ``lca`` on each path.
        view: the cycle's ratios.
        delta: hysteresis (``EngineConfig.delta``).
        charge_gpu_s: the job's provisional charge ``g * k * min(min_runtime, W)``, GPU-s.
        moves: this cycle's preemptions of allocated work so far.
    """
    rv = view.ratio(victim_branch)
    rb = view.ratio(preemptor_branch)
    if (lca, preemptor_branch, victim_branch) in moves:
        return (REFUSED_REVERSAL, rv, rb, rb)
    if not rv >= rb + delta:
        return (REFUSED_NOT_BEHIND, rv, rb, rb)
    after = view.ratio_after(preemptor_branch, charge_gpu_s)
    if after > rv:
        return (REFUSED_AFTER_MOVE, rv, rb, after)
    return (RULE_EXPIRED_BEHIND, rv, rb, after)


def idle_rule(idle_s: float | None, idle_after_s: float | None) -> bool:
    """Is a run idle long enough to be preempted for being idle? D3.idle-runs, the one home of the test.

    True when its budget sets ``preempt_idle_after_s`` (inherited; ``idle_after_s``) and its node agents report
    its GPUs idle (``idle_s``: the shortest over its replicas, as of their nodes' latest heartbeats,
    :func:`apportion.domain.idle.run_idle`) for at least that long: at exactly the setting it may go. ``None``
    for either (no setting, or no report): never. Protection is :func:`victim_rule`'s to check first.
    """
    return idle_after_s is not None and idle_s is not None and idle_s >= idle_after_s


def victim_rule(
    run: Run,
    preemptor_leaf: str,
    now_us: Micros,
    view: ShareView,
    delta: float,
    charge_gpu_s: float = 0.0,
    moves: frozenset[Move] | set[Move] = frozenset(),
    job_gpus: int | None = None,
    *,
    ignore_protection: bool = False,
    gang_cap_us: Micros | None = None,
    gang_least_gpus: int | None = None,
    gang_times: float | None = None,
    idle_s: float | None = None,
    idle_after_s: float | None = None,
) -> VictimVerdict:
    """May ``run`` be preempted for a job of ``preemptor_leaf``? rule D3.victims, candidates 1 and 2,
    and idle runs (D3.idle-runs).

    The one home of the candidate rule: the engine's search takes its
    expired-behind leaves from :func:`branch_rule` (which this calls) and
    every victim it picks is checked by this function, whose verdict is the
    audit record (:class:`~apportion.events.Victim`).

    In order: a stopping run never (:data:`REFUSED_STOPPING`); an
    unallocated run always (:data:`RULE_UNALLOCATED`); an allocated run
    not while protected, ``now_us < started_at + protection``
    (:data:`REFUSED_PROTECTED`: at exactly the end it may go); past its protection, an allocated run idle
    for its budget's setting (:func:`idle_rule`) for any job (:data:`RULE_IDLE`); else not a gang
    larger than the job (:func:`gang_rule`, :data:`REFUSED_GANG_FRACTION`;
    only when ``job_gpus`` is given), never of the same leaf (:data:`REFUSED_SAME_LEAF`) or of an ancestor or descendant
    path (:data:`REFUSED_ONE_LINE`), else as :func:`branch_rule` says at the
    LCA.

    Args:
        run: the candidate.
        preemptor_leaf: leaf budget B of the job J to place.
        now_us: cycle event time, µs UTC.
        view: the cycle's ratios (with provisional charges).
        delta: hysteresis.
        charge_gpu_s: J's provisional charge, GPU-seconds.
        moves: this cycle's preemptions so far (:data:`Move`).
        job_gpus: g * k of J (:func:`gang_rule`); ``None``: the rule is not applied.
        ignore_protection: judge the run as if its protection had ended at ``now_us`` (a reservation
            asks which runs its holder could take back once their protection ends).
        gang_cap_us: the protection cap of the run's budget, µs (:func:`gang_rule`'s bound); ``None``: none.
        gang_least_gpus: the least GPUs of a gang :func:`gang_rule` spares (``EngineConfig.gang_min_gpus``).
        gang_times: the bound as a multiple of the run's own protection, where lower than the cap
            (:func:`gang_bound_us`, ``EngineConfig.gang_bound_x``).
        idle_s: seconds the run's GPUs have been idle as its node agents report (``None``: unknown).
        idle_after_s: its budget's ``preempt_idle_after_s`` (``None``: not set).
    """
    if run.stopping:
        return VictimVerdict(REFUSED_STOPPING)
    if not run.allocated:
        return VictimVerdict(RULE_UNALLOCATED)
    if not ignore_protection and run.protected(now_us):
        return VictimVerdict(REFUSED_PROTECTED)
    if idle_rule(idle_s, idle_after_s):
        return VictimVerdict(RULE_IDLE)
    if job_gpus is not None and not gang_rule(
        run.replicas,
        run.gpus,
        job_gpus,
        ran_us(run, now_us),
        gang_bound_us(run, gang_cap_us, gang_times),
        gang_least_gpus,
    ):
        return VictimVerdict(REFUSED_GANG_FRACTION)
    if run.budget == preemptor_leaf:
        return VictimVerdict(REFUSED_SAME_LEAF)
    br = branches_of(run.budget, preemptor_leaf)
    if br is None:
        return VictimVerdict(REFUSED_ONE_LINE)
    lca, vb, bb = br
    rule, rv, rb, after = branch_rule(lca, vb, bb, view, delta, charge_gpu_s, moves)
    return VictimVerdict(rule, lca, rv, rb, after)


def gang_rule(
    replicas: int,
    gpus: int,
    job_gpus: int,
    ran_us: Micros = 0,
    cap_us: Micros | None = None,
    least_gpus: int | None = None,
) -> bool:
    """May an allocated run of ``replicas`` x (``gpus`` / ``replicas``) GPUs be preempted for a job of ``job_gpus``?

    A gang (``replicas >= 2``) is not preempted for a job smaller than it
    (``gpus > job_gpus``) until it has run for the protection cap; a
    single-node run, or a gang no larger than the job, may be (rule D3.gangs: a gang is not preempted whole for a job
    a fraction of its
    size). The cost order alone counts a gang as large as it is, but when it
    is the only feasible victim it still went: on Philly weeks 39-45 a
    16-GPU gang of a budget under its share was preempted for 1- and 2-GPU
    jobs, and its requeued attempt, which needs two whole nodes, then
    waited up to 58 h while its budget's window share fell from 15.4% to
    9.0% of a 17.8% share (``docs/simulation.md``). The small job waits
    instead for other victims.

    Bounded like every protection (rule D3.gangs: "no rule protects any
    run past the protection cap"): once the gang has run ``ran_us >=
    cap_us`` since its latest start, where ``cap_us`` is the cap of its
    budget's protections (:func:`~apportion.domain.engine.protection_cap_us`:
    W x ``protection_cap_w``, or the budget's ``max_min_runtime`` when
    lower), it is a victim like any other run, least cost first. Without
    the bound a 7-day 2 x 8 gang of a budget at share 0.5 kept the other
    budget (r = 0) waiting 167.5 h. ``cap_us=None``: no cap (the rule
    without a bound). :func:`gang_bound_us` gives the bound of one run.

    Scoped by size (``least_gpus``, ``EngineConfig.gang_min_gpus``): a gang of
    fewer GPUs than ``least_gpus`` is not concerned (a victim like a
    single-node run); ``None``: every gang.
    """
    return (
        replicas < 2
        or gpus <= job_gpus
        or (least_gpus is not None and gpus < least_gpus)
        or (cap_us is not None and ran_us >= cap_us)
    )


def gang_bound_us(run: Run, cap_us: Micros | None, times: float | None) -> Micros | None:
    """The bound of :func:`gang_rule` for ``run``, µs: ``cap_us`` (its budget's protection cap), or ``times`` x
    the run's own protection (:attr:`~apportion.domain.cluster.Run.protection_us`, its minimum runtime when
    unrecorded) when that is lower (``EngineConfig.gang_bound_x``; ``None``: the cap alone)."""
    if times is None:
        return cap_us
    own = run.min_runtime_us if run.protection_us is None else run.protection_us
    bound = int(own * times)
    return bound if cap_us is None or bound < cap_us else cap_us


def ran_us(run: Run, now_us: Micros) -> Micros:
    """How long ``run`` has run at ``now_us``, µs: since its latest replica start (its placement while none
    started), the clock every protection counts from (:attr:`~apportion.domain.cluster.Run.protected_until_us`)."""
    start = run.started_at_us if run.started_at_us is not None else run.placed_at_us
    return now_us - start


@lru_cache(maxsize=1 << 16)  # pragma: no mutate (a cache size)
def branches_of(v: str, b: str) -> tuple[str, str, str] | None:
    """:func:`branches_at_lca`, ``None`` when on one line; a pure function of two paths, memoised."""
    try:
        return branches_at_lca(v, b)
    except ValueError:
        return None


def backfill_rule(
    allocated: bool,
    protection_us: Micros,
    now_us: Micros,
    holder_fit_us: Micros,
    holder_may_preempt: bool = True,
) -> bool:
    """May a lower-ranked job use the free GPUs of a waiting reservation? rule D3.scheduling-cycle.

    "A reservation never idles GPUs": unallocated work always may (it is
    preempted the moment the holder can start); allocated work only when its
    protection ends no later than the holder can fit (``now + protection <=
    holder_fit_us``, :func:`earliest_fit_us`), so its protection never delays
    the holder, and only when the holder could then take its GPUs back under
    the ordinary rule (``holder_may_preempt``: :func:`branch_rule` allows the
    holder's branch to preempt the job's as the cycle stands; never the
    holder's own leaf). Without the last condition a job of the holder's own
    leaf, never preemptible by it, would hold the reservation's GPUs until
    it finished.

    Args:
        allocated: the candidate job is allocated (min_runtime > 0).
        protection_us: its protection, µs (:func:`~apportion.domain.cluster.protection_s`).
        now_us: cycle time, µs UTC.
        holder_fit_us: :func:`earliest_fit_us` of the reservation, µs UTC.
        holder_may_preempt: the holder could preempt the job once its protection ended.
    """
    return not allocated or (holder_may_preempt and now_us + protection_us <= holder_fit_us)


def charge_of(g: int, k: int, min_runtime_s: float, window_s: float) -> float:
    """Provisional charge of a placed allocated job, GPU-seconds: ``g * k * min(min_runtime, W)`` (rule D2.provisional-charge)."""
    return float(g * k) * min(min_runtime_s, window_s)


def patience_rule(lost_gpu_s: float, gpus: int, waited_s: float, ratio: float, patience_s: float) -> str:
    """Is a preemption plan worth the work it throws away now? Returns a ``PATIENCE_*`` rule id.

    The engine finds the least-cost victim set first (the cost order of rule D3.victims,
    unchanged) and then asks this rule; on :data:`PATIENCE_WAIT` the
    job stays queued this cycle and tries again in a later one, when GPUs may
    have freed up on their own (on Philly half the jobs end within 20 min) or
    its wait has grown. In this order:

    1. ``patience_s <= 0``: allowed (:data:`PATIENCE_OFF`);
    2. ``ratio < 1``, the preemptor's leaf is under its share (r with the
       cycle's provisional charges, :class:`ShareView`): allowed
       (:data:`PATIENCE_UNDER_SHARE`). An under-share budget never waits: the
       rule only slows budgets that already have their share;
    3. ``lost_gpu_s <= 0``: allowed (:data:`PATIENCE_NOTHING_LOST`);
    4. ``lost_gpu_s <= gpus * waited_s``, the GPU-seconds the job has spent
       waiting cover the work lost: allowed (:data:`PATIENCE_REPAID`);
    5. ``waited_s >= patience_s``: allowed (:data:`PATIENCE_SPENT`), so the
       wait is bounded;
    6. else :data:`PATIENCE_WAIT`.

    Why (simulator evidence in ``docs/simulation.md``): without it a job of a
    budget merely borrowing idle capacity killed an 8-GPU unallocated run 18 h
    into its work to start a 1-GPU job; the rule trades a bounded wait of
    jobs that already have their share for work that is not thrown away.

    Args:
        lost_gpu_s: work lost by the plan's victims now (sum of
            :func:`~apportion.domain.cluster.work_lost_gpu_s`), GPU-seconds.
        gpus: g * k of the job to place.
        waited_s: seconds since this attempt was queued (``PendingJob.queued_at_us``).
        ratio: r of the job's leaf budget in the cycle's view.
        patience_s: ``EngineConfig.patience_s``, seconds (0 turns the rule off).
    """
    if patience_s <= 0:
        return PATIENCE_OFF
    if ratio < 1.0:
        return PATIENCE_UNDER_SHARE
    if lost_gpu_s <= 0:
        return PATIENCE_NOTHING_LOST
    if lost_gpu_s <= gpus * waited_s:
        return PATIENCE_REPAID
    if waited_s >= patience_s:
        return PATIENCE_SPENT
    return PATIENCE_WAIT


@dataclass(frozen=True, slots=True)  # pragma: no mutate (flags: no behaviour)
class CheckpointVerdict:
    """What :func:`checkpoint_rule` says about a preemption plan.

    Attributes:
        rule: a ``CHECKPOINT_*`` rule id; only :data:`CHECKPOINT_WAIT` makes the job wait.
        saved_gpu_s: work the wait saves (the victims checkpointing within the wait), GPU-seconds.
        until_us: the last of those victims' next checkpoints, µs UTC (``None`` when none is due).
    """

    rule: str
    saved_gpu_s: float = 0.0  # pragma: no mutate (annotations are inert here)
    until_us: Micros | None = None  # pragma: no mutate (annotations are inert here)

    @property
    def wait(self) -> bool:
        """True for :data:`CHECKPOINT_WAIT`."""
        return self.rule == CHECKPOINT_WAIT


def checkpoint_rule(
    victims: Iterable[tuple[float, Micros | None]], gpus: int, now_us: Micros, wait_s: float
) -> CheckpointVerdict:
    """Should a preemption plan wait for its victims' next checkpoint? (goodput, the cost order of rule D3.victims).

    The engine finds the least-cost victim set first (the cost order is
    unchanged) and then asks this rule when to take it. A victim stopped
    just before its next checkpoint throws away almost a whole interval of
    work; stopped just after, almost none. So the job waits for the
    checkpoints when that costs it fewer GPU-seconds than the work it saves:

    * ``saved`` = sum of the work lost now by the victims whose next
      checkpoint falls in ``(now, now + wait_s]``; ``until`` = the last of
      those checkpoints;
    * wait iff ``gpus * (until - now) < saved`` (GPU-seconds the job spends
      waiting, against GPU-seconds of work kept). While it waits the victims
      run, so no GPU idles: the cost is the preemptor's delay, bounded by
      ``wait_s`` and by one checkpoint interval of each victim.

    In this order: ``wait_s <= 0``: :data:`CHECKPOINT_OFF`; nothing saved
    (no victim losing work has a checkpoint due in the wait):
    :data:`CHECKPOINT_NONE_DUE`; ``gpus * (until - now) >= saved``:
    :data:`CHECKPOINT_NOT_WORTH`; else :data:`CHECKPOINT_WAIT`. A victim that
    misses its predicted checkpoint is overdue (its time is past) and is not
    waited for again, so a workload cannot extend its own protection by
    never checkpointing; declaring a long interval buys at most ``wait_s``.

    Why (simulator evidence, ``docs/simulation.md``): on Philly week 44 the
    rule halves the work lost (1.32% -> 0.61% of GPU-hours held) and the share
    deficit does not grow (0.34 -> 0.31 pp).

    Args:
        victims: per victim of the plan, ``(work lost now, GPU-seconds;
            next checkpoint, µs UTC or None)`` (:func:`~apportion.domain.cluster.work_lost_gpu_s`,
            :func:`~apportion.domain.cluster.next_checkpoint_us`).
        gpus: g * k of the job to place.
        now_us: event time of the cycle, µs UTC.
        wait_s: ``EngineConfig.checkpoint_wait_s``, seconds (0 turns the rule off).
    """
    if wait_s <= 0:
        return CheckpointVerdict(CHECKPOINT_OFF)
    horizon = now_us + s_to_us(wait_s)
    saved = 0.0
    until: Micros | None = None
    for lost, nxt in victims:
        if lost > 0 and nxt is not None and now_us < nxt <= horizon:
            saved += lost
            until = nxt if until is None or nxt > until else until
    if until is None:
        return CheckpointVerdict(CHECKPOINT_NONE_DUE)
    if gpus * (until - now_us) / 1e6 >= saved:
        return CheckpointVerdict(CHECKPOINT_NOT_WORTH, saved, until)
    return CheckpointVerdict(CHECKPOINT_WAIT, saved, until)
