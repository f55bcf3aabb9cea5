"""Why a job is still pending after a cycle (rule D3.scheduling-cycle), from the cycle's own indices.

:func:`~apportion.domain.engine.cycle.run_cycle` with ``explain=True`` ends
with :func:`explain_pending`: for every job of the snapshot that the cycle
did not place, one typed reason, judged on the indices the cycle left
(free GPUs after its placements, its reservation, the runs it preempted,
its view of r with every provisional charge, its moves). Only when asked:
a cycle that decides (the dispatcher's, the simulator's) never pays for it.

The first of these that applies is the reason (``kind``, stable for scripts):

1. :class:`BudgetUnknown` (``budget_unknown``): the job's budget is not a
   leaf of the tree, so no cycle looks at it.
2. :class:`NoNodeShape` (``no_node_shape``): fewer than k ``ready`` nodes of
   the job's model have g GPUs at all.
3. :class:`ReservedBy` (``reserved_by``): the job would fit on free GPUs
   if the nodes of another job's reservation were not held for that job.
4. :class:`NoFreeGpus` (``no_free_gpus``): for an unallocated job (they run
   on idle GPUs only) or with preemption off: fewer than k nodes have g
   free GPUs.
5. :class:`BudgetAhead` (``budget_ahead``): an allocated job, and runs past
   their protection on the nodes it could use belong to leaves that
   :func:`~apportion.domain.preemption.branch_rule` refuses (not behind the
   job's branch by delta at the LCA, the after-move test, or a same-cycle
   reversal); the one closest to being behind is named.
6. :class:`ProtectedUntil` (``protected_until``): an allocated job, and the
   allocated runs of other leaves on those nodes are all protected; the
   earliest protection end among the runs whose leaves are behind the job's
   by delta (:func:`branch_rule` with no charge) is named. When none of them would be (their leaves
   are not behind), :class:`BudgetAhead` names the first such leaf instead.
7. :class:`Patience` (``patience``): the cycle found a preemption plan and
   :func:`~apportion.domain.preemption.patience_rule` made the job wait (its
   budget has its share, and the work the plan would throw away is more
   than the job has waited for); it names the work and when the wait ends.
   Judged from the cycle's own refusal, so it comes right after 4.
8. :class:`CheckpointSoon` (``checkpoint_soon``): the cycle found a
   preemption plan and :func:`~apportion.domain.preemption.checkpoint_rule`
   made the job wait for its victims' next checkpoint (waiting costs it
   fewer GPU-seconds than the work it saves); it names the work saved and
   the time. Also the cycle's own refusal, so it comes right after 7.
9. :class:`NoFreeGpus` otherwise (the GPUs are held by its own leaf, or too
   few preemptible runs free enough of them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field, fields
from typing import ClassVar

from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import UNTIL_STARTED, ClusterSnapshot, RunKey
from apportion.domain.engine.inputs import EngineConfig, PendingJob
from apportion.domain.engine.placement import CycleFree
from apportion.domain.preemption import (
    RULE_EXPIRED_BEHIND,
    CheckpointVerdict,
    Move,
    ShareView,
    branch_rule,
    branches_of,
    charge_of,
)
from apportion.timeutil import Micros, from_us, s_to_us, us_to_s, utc_text

__all__ = [
    "ArrayLimit",
    "BudgetAhead",
    "BudgetUnknown",
    "CheckpointSoon",
    "CycleLeft",
    "Held",
    "NoFreeGpus",
    "NoNodeShape",
    "Patience",
    "PendingReason",
    "ProtectedUntil",
    "RefusedBackoff",
    "ReservedBy",
    "explain_pending",
    "reason_dict",
]


def _shape(g: int, k: int, model: str | None) -> str:
    return f"{k} node(s) with {g} GPU(s)" + (f" of model {model}" if model else "")


@dataclass(frozen=True, slots=True)
class BudgetUnknown:
    """The job's budget is not a leaf of the budget tree (removed, or given children): no cycle looks at it."""

    kind: ClassVar[str] = "budget_unknown"
    budget: str

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        return f"{self.kind}: {self.budget} is not a leaf budget of the tree (removed, or given children)"


@dataclass(frozen=True, slots=True)
class NoNodeShape:
    """Fewer than ``replicas`` ready nodes of the model have ``gpus_per_replica`` GPUs at all.

    Attributes:
        ready: ready nodes of that shape (model, at least g GPUs).
        total: nodes of that shape in any state (the rest are cordoned, draining, drained or lost).
    """

    kind: ClassVar[str] = "no_node_shape"
    gpus_per_replica: int
    replicas: int
    gpu_model: str | None
    ready: int
    total: int

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        rest = (
            f" ({self.total} in all, the rest cordoned, draining, drained or lost)" if self.total > self.ready else ""
        )
        return (
            f"{self.kind}: needs {_shape(self.gpus_per_replica, self.replicas, self.gpu_model)}; "
            f"the cluster has {self.ready} ready node(s) of this shape{rest}"
        )


@dataclass(frozen=True, slots=True)
class ReservedBy:
    """The job would fit on free GPUs but for the nodes reserved for ``holder`` (its ``nodes``)."""

    kind: ClassVar[str] = "reserved_by"
    holder: str
    nodes: tuple[str, ...]

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        return (
            f"{self.kind}: the free GPUs it fits are reserved for {self.holder} on {', '.join(self.nodes)} "
            "(the highest-ranked allocated job waiting past reservation_after)"
        )


@dataclass(frozen=True, slots=True)
class NoFreeGpus:
    """Fewer than ``replicas`` usable nodes have ``gpus_per_replica`` free GPUs, and nothing else applies.

    Attributes:
        free_nodes: usable nodes (ready, the model, not reserved for another job) with g free GPUs now.
        allocated: the job is allocated (``min_runtime > 0``); unallocated jobs never preempt.
        preemption: the engine's preemption is on.
    """

    kind: ClassVar[str] = "no_free_gpus"
    gpus_per_replica: int
    replicas: int
    gpu_model: str | None
    free_nodes: int
    allocated: bool
    preemption: bool

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        if not self.allocated:
            why = "unallocated jobs run only on idle GPUs"
        elif not self.preemption:
            why = "preemption is off"
        else:
            why = "no run there may be preempted for it (its own budget's, or too few GPUs)"
        return (
            f"{self.kind}: needs {_shape(self.gpus_per_replica, self.replicas, self.gpu_model)} free, "
            f"{self.free_nodes} node(s) have them now; {why}"
        )


@dataclass(frozen=True, slots=True)
class BudgetAhead:
    """Runs past their protection could make room, but their leaves are not behind the job's by the rule.

    Attributes:
        budget: the job's leaf; ``budget_rank`` its place in the cycle's budget order (0 first),
            ``ratio`` its r after the cycle's provisional charges.
        holder: the leaf with expired runs there that comes closest to being behind (or, when all runs
            there are protected, the first leaf holding them that is not behind) (largest
            ``holder_ratio - preemptor_ratio``, ties by path).
        lca: their lowest common ancestor; ``holder_ratio``, ``preemptor_ratio``: r of the two
            branches there; ``delta``: the hysteresis the rule asks for.
        rule: the refusal of :func:`~apportion.domain.preemption.branch_rule` (``not_behind``,
            ``after_move_inversion`` or ``same_cycle_reversal``).
    """

    kind: ClassVar[str] = "budget_ahead"
    budget: str
    budget_rank: int
    ratio: float
    holder: str
    lca: str
    holder_ratio: float
    preemptor_ratio: float
    delta: float
    rule: str

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        return (
            f"{self.kind}: {self.budget} (budget rank {self.budget_rank}, r {self.ratio:.3f}) may not preempt "
            f"the runs there ({self.rule}): the closest, {self.holder}, has r {self.holder_ratio:.3f} "
            f"at {self.lca or '/'} against {self.preemptor_ratio:.3f} + delta {self.delta:g}"
        )


@dataclass(frozen=True, slots=True)
class ProtectedUntil:
    """The allocated runs of other leaves on the nodes the job could use are all protected.

    Attributes:
        until_us: the earliest protection end among them, µs UTC (``None``: none has started yet).
        job_id, budget: the run whose protection ends first.
    """

    kind: ClassVar[str] = "protected_until"
    until_us: Micros | None
    job_id: str
    budget: str

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        if self.until_us is None:
            return f"{self.kind}: the runs it could preempt are protected until they have started ({self.job_id})"
        return (
            f"{self.kind}: the runs it could preempt are protected; the first protection ends "
            f"{utc_text(self.until_us)} ({self.job_id} of {self.budget})"
        )


@dataclass(frozen=True, slots=True)
class Patience:
    """The job's budget has its share and the cheapest preemption would throw away more work than it has waited.

    Attributes:
        lost_gpu_s: work the refused plan's victims would lose, GPU-seconds.
        gpus: g * k of the job.
        waited_s: seconds since the attempt was queued.
        until_us: when the wait ends whatever the loss (queued + ``patience_s``), µs UTC.
    """

    kind: ClassVar[str] = "patience"
    lost_gpu_s: float
    gpus: int
    waited_s: float
    until_us: Micros

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        return (
            f"{self.kind}: its budget has its share and the cheapest preemption would throw away "
            f"{self.lost_gpu_s / 3600:.1f} GPU-h of work for a job that has waited {self.waited_s / 3600:.2f} h on "
            f"{self.gpus} GPU(s); it preempts once its wait covers that, at the latest "
            f"{utc_text(self.until_us)}"
        )


@dataclass(frozen=True, slots=True)
class CheckpointSoon:
    """The cheapest preemption's victims checkpoint soon: the job waits for that rather than throw their work away.

    Attributes:
        saved_gpu_s: work the wait keeps (the victims' work since their last checkpoint), GPU-seconds.
        gpus: g * k of the job.
        until_us: the last of those victims' next checkpoints, when the job preempts, µs UTC.
    """

    kind: ClassVar[str] = "checkpoint_soon"
    saved_gpu_s: float
    gpus: int
    until_us: Micros

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        return (
            f"{self.kind}: the cheapest preemption's victims save {self.saved_gpu_s / 3600:.1f} GPU-h of work at "
            f"their next checkpoint; the job ({self.gpus} GPU(s)) waits for it and preempts at "
            f"{utc_text(self.until_us)}"
        )


@dataclass(frozen=True, slots=True)
class RefusedBackoff:
    """A node refused the job's latest start: it backs off before a cycle may place it again (rule D3.refused-starts).
    Not a cycle's judgement: the dispatcher leaves the job out of its cycles until ``until_us``
    (``domain.dispatch.DispatchState.pending_now``), and says so ahead of anything a cycle would say.

    Attributes:
        node_id: the node that refused the start; ``refusal``: the requeue's reason (``start refused: <code>``).
        refusals: starts of the job refused so far.
        until_us: when the backoff ends and a cycle may place it again, µs UTC.
    """

    kind: ClassVar[str] = "refused_backoff"
    node_id: str
    refusal: str
    refusals: int
    until_us: Micros

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        return (
            f"{self.kind}: node {self.node_id} refused its start ({self.refusal}; {self.refusals} refused so far); "
            f"it may be placed again from {utc_text(self.until_us)}"
        )


@dataclass(frozen=True, slots=True)
class Held:
    """The job is on hold (``apportion hold``, ``submit --hold``): it keeps its place in its budget's queue
    order, and no cycle places it until it is released. Not a cycle's judgement: the dispatcher leaves held
    jobs out of its cycles (``domain.dispatch.DispatchState.pending_now``) and says so ahead of anything else.

    Attributes:
        by: the user who held it; ``note``: the hold's reason.
        since_us: when it was held, µs UTC.
    """

    kind: ClassVar[str] = "held"
    by: str
    note: str
    since_us: Micros

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        return (
            f"{self.kind}: held by {self.by} at {utc_text(self.since_us)} ({self.note}); "
            "never placed until released (apportion release JOB)"
        )


@dataclass(frozen=True, slots=True)
class ArrayLimit:
    """The job is an element of a job array whose ``%N`` limit is reached (rule D1.job: ``--array 0-99%8``
    runs at most 8 elements at once): the elements running, with the lower pending indices the limit lets
    through, fill it. Not a cycle's judgement: the dispatcher leaves it out of its cycles
    (``domain.dispatch.DispatchState.pending_now``) until an element ends.

    Attributes:
        array_id: the array; ``limit``: its ``%N``; ``running``: its elements running (or stopping) now.
    """

    kind: ClassVar[str] = "array_limit"
    array_id: str
    limit: int
    running: int

    def text(self) -> str:
        """One line for people, ``kind: facts``."""
        return (
            f"{self.kind}: array {self.array_id} runs at most {self.limit} element(s) at once, "
            f"{self.running} of {self.limit} running; lower indices start first, the rest as elements end"
        )


PendingReason = (
    BudgetUnknown
    | NoNodeShape
    | ReservedBy
    | NoFreeGpus
    | BudgetAhead
    | ProtectedUntil
    | Patience
    | CheckpointSoon
    | RefusedBackoff
    | Held
    | ArrayLimit
)
"""One reason a job is pending (the ``kind`` of each class is stable for scripts)."""


def reason_dict(reason: PendingReason) -> dict[str, object]:
    """``{"kind": ..., "text": ..., <fields>}`` of a reason, for JSON (times as ISO 8601 UTC)."""
    out: dict[str, object] = {"kind": reason.kind, "text": reason.text()}
    for f in fields(reason):
        v = getattr(reason, f.name)
        if f.name in ("until_us", "since_us"):
            out[f.name.removesuffix("_us")] = from_us(v).isoformat() if v is not None else None
        else:
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


@dataclass(frozen=True, slots=True)
class CycleLeft:
    """What a cycle left, for :func:`explain_pending`.

    Attributes:
        free: the cycle's free index as the cycle left it (``None``: the cycle had no leaf to look at).
        view: its r (``None`` with ``free``).
        taken: runs the cycle preempted.
        budget_rank: leaf -> place in the cycle's first budget order.
        reservation: ``(holder job id, node ids)`` of the cycle's reservation.
        moves: the cycle's preemptions of allocated work, ``(lca, victim branch, preemptor branch)``.
        placed: job ids the cycle placed.
        waits: job id -> work lost (GPU-s) of the plan :func:`~apportion.domain.preemption.patience_rule`
            refused for it in the cycle.
        checkpoint_waits: job id -> the :func:`~apportion.domain.preemption.checkpoint_rule` verdict
            that made it wait for its victims' checkpoint in the cycle.
    """

    free: CycleFree | None = None
    view: ShareView | None = None
    taken: Set[RunKey] = frozenset()
    budget_rank: Mapping[str, int] = field(default_factory=dict)
    reservation: tuple[str, tuple[str, ...]] | None = None
    moves: frozenset[Move] | set[Move] = frozenset()
    placed: Set[str] = frozenset()
    waits: Mapping[str, float] = field(default_factory=dict)
    checkpoint_waits: Mapping[str, CheckpointVerdict] = field(default_factory=dict)


def explain_pending(
    pending: Mapping[str, Sequence[PendingJob]],
    tree: BudgetTree,
    cluster: ClusterSnapshot,
    now_us: Micros,
    cfg: EngineConfig,
    left: CycleLeft,
    only: Set[str] | None = None,
) -> dict[str, PendingReason]:
    """Job id -> :data:`PendingReason` for each job of ``pending`` not in ``left.placed`` (see the module doc);
    ``only``: for these jobs alone (a job's reason depends on its own fields and the cycle's indices, never on
    the other jobs asked about, so it is the same either way).

    ``pending`` is the snapshot's pending lists (leaf -> jobs; keys that are not leaves too); ``left``, what
    the cycle left (:class:`CycleLeft`).

    Cost: one pass over the usable nodes' runs per distinct (g, model), one
    :func:`branch_rule` per leaf with expired runs there per distinct (leaf,
    shape, minimum runtime): only for the caller that asks.
    """
    out: dict[str, PendingReason] = {}
    free, view, placed, waits, checkpoint_waits = left.free, left.view, left.placed, left.waits, left.checkpoint_waits
    holder, res_nodes = left.reservation if left.reservation is not None else (None, ())
    # pass 2 gives a waiting reservation's free GPUs to unallocated work: then they are not held from it
    lent = free is not None and not free.reserved
    cache: dict[tuple[str, int, int, str | None, float, bool], PendingReason] = {}
    scans: dict[tuple[int, str | None, bool], _Scan] = {}
    ctx: _Explain | None = None
    for leaf, jobs in pending.items():
        for job in jobs:
            if job.job_id in placed or (only is not None and job.job_id not in only):
                continue
            if free is None or view is None or not tree.is_leaf(leaf):
                out[job.job_id] = BudgetUnknown(leaf)
                continue
            if job.job_id in waits:
                out[job.job_id] = Patience(
                    waits[job.job_id],
                    job.gpus,
                    us_to_s(now_us - job.queued_at_us),
                    job.queued_at_us + s_to_us(cfg.patience_s),
                )
                continue
            soon = checkpoint_waits.get(job.job_id)
            if soon is not None and soon.until_us is not None:
                out[job.job_id] = CheckpointSoon(soon.saved_gpu_s, job.gpus, soon.until_us)
                continue
            own = job.job_id == holder
            key = (leaf, job.gpus_per_replica, job.replicas, job.gpu_model, job.min_runtime_s, own)
            got = cache.get(key)
            if got is None:
                if ctx is None:
                    ctx = _Explain(cluster, free, view, now_us, cfg, left, holder, res_nodes)
                skip = () if own or (lent and not job.allocated) else res_nodes
                sk = (job.gpus_per_replica, job.gpu_model, bool(skip))
                scan = scans.get(sk)
                if scan is None:
                    scan = scans[sk] = _Scan(ctx, job.gpus_per_replica, job.gpu_model, skip)
                got = cache[key] = _classify(job, leaf, scan, ctx)
            out[job.job_id] = got
    return out


@dataclass(slots=True, eq=False)
class _Explain:
    """What every :class:`_Scan` and :func:`_classify` of one :func:`explain_pending` read."""

    cluster: ClusterSnapshot
    free: CycleFree
    view: ShareView
    now_us: Micros
    cfg: EngineConfig
    left: CycleLeft
    holder: str | None
    res_nodes: tuple[str, ...]
    # the cache of :meth:`_Scan.pairs_of`, shared by the scans
    pairs: dict[tuple[frozenset[str], str], list[tuple[float, str, str, str, str]]] = field(default_factory=dict)


class _Scan:
    """What the usable nodes of one (g, model) hold, for :func:`_classify` (leaf-independent).

    ``shape``: ready nodes of the model with at least g GPUs; ``usable``: those
    not in ``skip`` (another job's reservation); ``fitting``: usable ones with
    g free GPUs; ``in_reserved``: nodes of ``skip`` of the shape with g free
    GPUs; ``expired``: leaf -> allocated runs past protection on usable nodes
    (not taken, not stopping); ``protected``: ``(until, job id, leaf)`` of the
    protected allocated runs there, sorted. ``pairs``: the cache of
    :meth:`pairs_of`, shared by the scans (keyed by the set of leaves with
    expired runs, which scans of other shapes often share).
    """

    __slots__ = ("shape", "usable", "fitting", "in_reserved", "expired", "protected", "_cluster", "_pairs", "_holders")

    def __init__(self, ctx: _Explain, g: int, model: str | None, skip: tuple[str, ...]) -> None:
        cluster, free, taken, now_us = ctx.cluster, ctx.free, ctx.left.taken, ctx.now_us
        self.shape = [n for n, m in free.model.items() if free.count[n] >= g and (model is None or m == model)]
        held = set(skip)
        self.usable = [n for n in self.shape if n not in held]
        self.fitting = sum(1 for n in self.usable if len(free.free[n]) >= g)
        self.in_reserved = sum(1 for n in skip if n in free.free and n in self.shape and len(free.free[n]) >= g)
        self.expired: dict[str, int] = {}
        protected: set[tuple[Micros, str, str]] = set()
        runs = cluster.runs
        for nid in self.usable:
            for key in cluster.node_runs.get(nid, ()):
                run = runs.get(key)
                if run is None or run.stopping or not run.allocated or key in taken:
                    continue
                until = run.protected_until_us
                if until is not None and now_us < until:
                    protected.add((until, run.job_id, run.budget))
                else:
                    self.expired[run.budget] = self.expired.get(run.budget, 0) + 1
        self.protected = sorted(protected)
        self._cluster = cluster
        self._pairs = ctx.pairs
        self._holders = frozenset(self.expired)

    def pairs_of(self, leaf: str, view: ShareView) -> list[tuple[float, str, str, str, str]]:
        """``(-(r_V - r_B), V, lca, V's branch, leaf's branch)`` per branch pair at the LCA of ``leaf`` and
        the other leaves with expired runs here, sorted (largest gap first, then V's path; V: the first
        leaf of the pair). Every leaf of one pair gets the same :func:`branch_rule` answer."""
        key = (self._holders, leaf)
        got = self._pairs.get(key)
        if got is None:
            seen: dict[tuple[str, str, str], str] = {}
            for v in sorted(self.expired):
                br = branches_of(v, leaf) if v != leaf else None
                if br is not None and br not in seen:
                    seen[br] = v
            ratio = view.ratio
            got = self._pairs[key] = sorted(
                (ratio(bb) - ratio(vb), v, *br) for br, v in seen.items() for _, vb, bb in [br]
            )
        return got

    def total(self, g: int, model: str | None) -> int:
        """Nodes of the shape in any state (ready or not)."""
        return sum(
            1 for n in self._cluster.nodes.values() if n.gpu_count >= g and (model is None or n.gpu_model == model)
        )


def _classify(job: PendingJob, leaf: str, scan: _Scan, ctx: _Explain) -> PendingReason:
    cfg, view, holder, res_nodes = ctx.cfg, ctx.view, ctx.holder, ctx.res_nodes
    budget_rank, moves = ctx.left.budget_rank, ctx.left.moves
    g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
    if len(scan.shape) < k:
        return NoNodeShape(g, k, model, len(scan.shape), scan.total(g, model))
    if holder is not None and scan.fitting < k <= scan.fitting + scan.in_reserved:
        return ReservedBy(holder, res_nodes)
    if not job.allocated or not cfg.preemption:
        return NoFreeGpus(g, k, model, scan.fitting, job.allocated, cfg.preemption)
    charge = charge_of(g, k, job.min_runtime_s, cfg.window_s)
    # the refused branch pair closest to being behind (largest r_V - r_B, ties by the leaf's path)
    for _, v, lca, vb, bb in scan.pairs_of(leaf, view):
        rule, rv, rb, _ = branch_rule(lca, vb, bb, view, cfg.delta, charge, moves)
        if rule != RULE_EXPIRED_BEHIND:
            return BudgetAhead(leaf, budget_rank.get(leaf, -1), view.ratio(leaf), v, lca, rv, rb, cfg.delta, rule)
    # a protected run names the wait only if its leaf is behind this one's by delta (branch_rule without the
    # job's charge: the after-move test moves with the window, the order of r is what decides): else it
    # would not be a victim once expired either, and the budget is what blocks
    ahead: BudgetAhead | None = None
    for until, job_id, budget in scan.protected:
        br = branches_of(budget, leaf) if budget != leaf else None
        if br is None:
            continue
        lca, vb, bb = br
        rule, rv, rb, _ = branch_rule(lca, vb, bb, view, cfg.delta, 0.0, moves)
        if rule == RULE_EXPIRED_BEHIND:
            return ProtectedUntil(until if until < UNTIL_STARTED else None, job_id, budget)
        if ahead is None:
            ahead = BudgetAhead(leaf, budget_rank.get(leaf, -1), view.ratio(leaf), budget, lca, rv, rb, cfg.delta, rule)
    if ahead is not None:
        return ahead
    return NoFreeGpus(g, k, model, scan.fitting, True, True)
