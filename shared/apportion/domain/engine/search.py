"""The least-cost preemption search (rule D3.victims): :func:`plan_preemption`.

Candidates come from :class:`~apportion.domain.engine.victims.CycleVictims`
(unallocated runs per node; idle allocated runs past their protection, D3.idle-runs; expired allocated runs
of the leaves behind the preemptor by :func:`~apportion.domain.preemption.branch_rule`); every victim
of a returned plan is checked again by
:func:`~apportion.domain.preemption.victim_rule`, the one home of the rule,
whose verdict (rule id, LCA, the two r) goes into the audit record
(:class:`~apportion.events.Victim`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar

from apportion.domain.budgets import BudgetTree, ancestors_of
from apportion.domain.cluster import Run, RunKey, next_checkpoint_us, work_lost_gpu_s
from apportion.domain.engine.emit import built, placement, real_or_none, utc_time
from apportion.domain.engine.inputs import PendingJob
from apportion.domain.engine.placement import CycleFree
from apportion.domain.engine.reservation import hero_sheltered
from apportion.domain.engine.victims import Candidate, CycleVictims, Option, order_lost_gpu_s
from apportion.domain.preemption import (
    PATIENCE_WAIT,
    RULE_EXPIRED_BEHIND,
    RULE_IDLE,
    RULE_UNALLOCATED,
    Move,
    ShareView,
    VictimVerdict,
    checkpoint_rule,
    gang_bound_us,
    gang_rule,
    patience_rule,
    ran_us,
    victim_rule,
)
from apportion.events import Placement, Victim
from apportion.timeutil import Micros, from_us, us_to_s

__all__ = ["Plan", "PreemptionRequest", "known_short", "plan_preemption"]


def _no_ratio(path: str) -> float:
    return 0.0


@dataclass(slots=True, eq=False)
class PreemptionRequest:
    """What a preemption search is asked (:func:`plan_preemption`, which never changes it). Not frozen: a cycle
    makes one and changes only the job's fields (``job``, ``leaf``, ``charge_count``, ``charge_gpu_s``)
    from one search to the next, which costs less than building one per search.

    Attributes:
        job: the allocated job J to place.
        leaf: J's leaf budget B.
        free: the cycle's free index (J's GPUs are taken from it when a plan is returned).
        victims: the cycle's candidate index (its ``taken``, ``waits``, ... are updated).
        now: event time, µs.
        ratio: the cycle's :class:`ShareView`, or a plain ``path -> r`` callable, for which a charge
            changes no r (the baselines; default: 0 for every path).
        delta: the hysteresis of D3.victims.
        charge_count: provisional charges of the cycle so far (keys the behind-leaves memo).
        tree: the budget tree (``None``: the baselines, no expired-behind candidates by branch).
        charge_gpu_s: J's provisional charge (D2.provisional-charge), for the after-move test.
        moves: this cycle's preemptions of allocated work (no same-cycle reversal, D3.consistent-view).
        patience_s: :func:`patience_rule`'s setting (0: off).
        checkpoint_wait_s: :func:`checkpoint_rule`'s setting (0: off).
        gangs: apply :func:`gang_rule` (D3.gangs).
        gang_cap: budget -> its protection cap, µs, or ``None`` (the gang rule's bound).
        gang_least_gpus, gang_times: ``EngineConfig.gang_min_gpus`` and ``gang_bound_x`` (the gang rule's scope,
            :func:`gang_rule`, :func:`gang_bound_us`).
        gang_last_resort: ``EngineConfig.gang_last_resort``: a gang the rule spares is a victim when no
            feasible set without one exists (:func:`_last_resort_options`).
        gang_last_resort_over_share: ``EngineConfig.gang_last_resort_over_share``: the last resort takes only
            the gangs of a budget over its share (r > 1 in the cycle's view); a gang of a budget at or under it
            stays spared until its bound.
        hero_min_gpus: the least GPUs of a hero run (D3.hero-cover's victims' clause: a covered hero within
            its share is taken only when no victim set without one exists); ``None``: no such clause.
        hero_waits: ``EngineConfig.hero_waits`` (D3.hero-waits): a job of at least ``hero_min_gpus`` GPUs never
            takes a covered hero within its share, not even where no victim set without one exists.
    """

    job: PendingJob
    leaf: str
    free: CycleFree
    victims: CycleVictims
    now: Micros
    ratio: ShareView | Callable[[str], float] = _no_ratio
    delta: float = 0.0
    charge_count: int = 0
    tree: BudgetTree | None = None
    charge_gpu_s: float = 0.0
    moves: frozenset[Move] | set[Move] = frozenset()
    patience_s: float = 0.0
    checkpoint_wait_s: float = 0.0
    gangs: bool = False
    gang_cap: Callable[[str], Micros | None] | None = None
    gang_least_gpus: int | None = None
    gang_times: float | None = None
    gang_last_resort: bool = False
    gang_last_resort_over_share: bool = False
    hero_min_gpus: int | None = None
    hero_waits: bool = False
    sparing_within: bool = False
    """Set while the last resort searches with ``gang_last_resort_over_share``: the gang rule applies to the gangs
    of a budget at or under its share only (:func:`_node_list`)."""
    charged: list[str] = field(default_factory=list)
    """The leaves provisionally charged since the request was made, in order (one entry per charge): the
    only budgets whose r moved (speed only, for :func:`_nothing_behind`)."""
    memo: dict[Any, Any] = field(default_factory=dict)
    """What the searches of this request found out that a later one may reuse (speed only): kept while the
    request lives, so one request serves one cycle's free index and candidates."""


Plan = tuple[tuple[Placement, ...], list[tuple[Run, Victim]]]


def plan_preemption(req: PreemptionRequest) -> Plan | None:
    """Least-cost preemption plan for allocated ``req.job`` of ``req.leaf``, or ``None`` (D3.victims).

    After the call, ``victims.narrowed`` tells whether the expired-behind
    candidates depended on the job's charge (see :meth:`CycleVictims.behind_of`):
    a failure then says nothing about a job with a smaller charge.

    Cost of a set: (busy allocated GPUs, idle allocated GPUs, unallocated GPUs, GPU-s of work lost),
    lexicographic, where idle runs are those of ``victims.idle_runs`` (D3.idle-runs: past their protection,
    idle for their budget's ``preempt_idle_after_s``; any job may take them, whatever its leaf). Any node
    that needs no allocated victim is cheaper than one that does, and one that needs only idle ones cheaper
    than one that needs a busy one, so nodes reachable with unallocated victims alone are tried first
    (:func:`_unallocated_options`, :func:`_free_options`), then with idle ones too (:func:`_idle_options`),
    and the expired-behind runs are looked at only when fewer than k such nodes exist
    (:func:`_behind_options`). Per node the cheapest victims are taken first (unallocated, then idle, then
    busy allocated runs), then unnecessary ones dropped (most expensive first); the k cheapest nodes (ties
    by node id) form the plan.

    The least-cost plan is then judged by :func:`patience_rule` (idle victims count as losing no work: their
    GPUs did none for their budget's setting; off with
    ``patience_s == 0``, the default for the baselines): when it refuses,
    ``None`` is returned and the job is entered in ``victims.waits`` (the failure depends
    on the job's wait, so it says nothing about other jobs of the shape). Then by
    :func:`checkpoint_rule` (off with ``checkpoint_wait_s == 0``): when the victims
    checkpoint soon enough, ``None`` and the job in ``victims.checkpoint_waits`` (:func:`_refused`).

    With ``gangs`` (``EngineConfig.gang_rule``), an allocated gang larger than J is not a candidate
    (:func:`gang_rule`) until it has run for its budget's protection cap (``gang_cap``); ``victims.spared``
    then tells that the search left one out, so its failure says nothing about a larger job.

    Returns the placements of J (free GPUs first, then victims' GPUs) and the
    victims with their :class:`Victim` audit records; the free index is
    updated (J's GPUs taken) when a plan is returned (:func:`_commit`).
    """
    victims, job = req.victims, req.job
    victims.narrowed = False
    victims.spared = False
    k = job.replicas
    short_key = (_SHORT, job.gpus_per_replica, job.gpu_model, k)
    log_len = len(req.free.log)
    if req.memo.get(short_key) == log_len:
        # the options without expired-behind runs are known to be too few (known_short's first test): only a
        # leaf behind J's could help, and when none is, the search ends as _behind_options would end it
        if _nothing_behind(req, req.leaf, req.delta):
            return None  # (known_short, its first test not asked twice)
        ratio = req.ratio
        behind, narrowed = victims.behind_of(
            req.leaf,
            _CallableView(ratio) if callable(ratio) else ratio,
            req.delta,
            req.charge_count,
            req.tree,
            req.charge_gpu_s,
            req.moves,
        )
        if not behind:
            victims.narrowed = narrowed
            return None
    s = _Search.of(req)
    cached = _unallocated_options(s)
    options = _cheapest_unallocated(s, cached, k)  # (all of them when fewer than k)
    n = len(cached) - len(options)  # options not in the list
    _free_options(s, options)
    if len(options) + n < k and req.victims.idle_on:
        _idle_options(s, options)
    if len(options) + n < k:
        req.memo[short_key] = log_len  # (the same for any leaf: free, unallocated and idle options)
        found = _behind_options(s, options, req.hero_min_gpus is not None)
        if found is not None and len(found) < k and req.gang_last_resort and victims.spared:
            more = _last_resort_options(s, options)
            if more is not None and len(more) >= k:
                found = more
        if found is not None and len(found) < k and s.sheltered_out and not _hero_waits(req):
            # D3.hero-cover: no feasible set without a covered hero within its share
            more = _behind_options(s, options, False, len(req.free.count))  # (every node's option)
            if more is not None:
                found = _fewest_heroes(s, found, more, k)
        if found is None or len(found) < k:
            return None
        options = found
    options.sort(key=_option_order)
    best = options[:k]
    if (req.patience_s > 0 or req.checkpoint_wait_s > 0) and _refused(s, best):
        return None
    return _commit(s, best)


def _last_resort_options(s: _Search, options: list[Option]) -> list[Option] | None:
    """D3.gangs' last resort (``EngineConfig.gang_last_resort``): where no feasible victim set spares every gang
    larger than J, the options with the gangs past their protection as candidates like any other run (least
    cost first: fewest allocated GPUs, so the smallest gangs); ``s.gangs_spent`` tells :func:`_commit` to judge
    its victims so. The covered heroes stay sheltered (D3.hero-cover); ``s.sheltered_out`` is left as the search
    with the gang rule found it. With ``req.gang_last_resort_over_share`` the gangs of a budget at or under its
    share (r <= 1 in the cycle's view) stay spared: only a borrower's gang is a last-resort victim."""
    req = s.req
    sheltered_out = s.sheltered_out
    req.gangs = False
    req.sparing_within = req.gang_last_resort_over_share
    try:
        found = _behind_options(s, options, req.hero_min_gpus is not None)
    finally:
        req.gangs = True
        req.sparing_within = False
        s.sheltered_out = sheltered_out
    s.gangs_spent = found is not None and len(found) >= req.job.replicas
    return found


def _hero_waits(req: PreemptionRequest) -> bool:
    """D3.hero-waits: ``req.job`` is a hero (at least ``hero_min_gpus`` GPUs) that waits rather than take a covered
    hero within its share."""
    job, least = req.job, req.hero_min_gpus
    return req.hero_waits and least is not None and job.gpus_per_replica * job.replicas >= least


def _fewest_heroes(s: _Search, found: list[Option], more: list[Option], k: int) -> list[Option]:
    """D3.hero-cover, where no feasible set without a sheltered hero run exists: every node freed without one
    (``found``, fewer than k), then the rest from the nodes that one hero gang alone frees when one frees
    enough (the gang of fewest GPUs, then by run key; its nodes least cost first), else the least-cost nodes
    of ``more`` (their options with the hero runs)."""
    have = {o[1] for o in found}
    rest = sorted((o for o in more if o[1] not in have), key=_option_order)
    need = k - len(found)
    by_gang: dict[RunKey, tuple[int, list[Option]]] = {}
    for o in rest:
        heroes = {(x[1].key, x[0][0]) for x in o[2] if s.sheltered(x[1])}
        if len(heroes) == 1:
            key, gpus = heroes.pop()
            by_gang.setdefault(key, (gpus, []))[1].append(o)
    alone = sorted((gpus, key) for key, (gpus, opts) in by_gang.items() if len(opts) >= need)
    if alone:
        return found + by_gang[alone[0][1]][1][:need]
    return found + rest[:need]


def _option_order(o: Option) -> tuple[tuple[int, int, int, float], str]:
    return (o[0], o[1])


@dataclass(slots=True, eq=False)
class _Search:
    """One search's view of its request: J's shape and the indices it reads (per node: model, free count,
    reserved, free GPU indices; runs already taken; idle runs)."""

    req: PreemptionRequest
    view: ShareView
    g: int
    model: str | None
    taken: set[RunKey]
    fmodel: dict[str, str | None]
    fcount: dict[str, int]
    reserved: set[str]
    ffree: dict[str, Any]
    idle_runs: dict[RunKey, Any]
    sheltered_out: bool = False  # the last expired-behind search left out a sheltered hero run (D3.hero-cover)
    gangs_spent: bool = False  # the options are D3.gangs' last resort's (:func:`_last_resort_options`)

    @classmethod
    def of(cls, req: PreemptionRequest) -> _Search:
        free, ratio = req.free, req.ratio
        job, victims = req.job, req.victims
        view = _CallableView(ratio) if callable(ratio) else ratio
        # (positional: this runs once per search)
        return cls(
            req,
            view,
            job.gpus_per_replica,
            job.gpu_model,
            victims.taken,
            free.model,
            free.count,
            free.reserved,
            free.free,
            victims.idle_runs,
        )

    def sheltered(self, run: Run) -> bool:
        """D3.hero-cover: ``run`` is a covered hero gang within its budget's share
        (:func:`~apportion.domain.engine.reservation.hero_sheltered`), judged once per request (one cycle's
        view: the answer does not move within the cycle)."""
        req = self.req
        memo = req.memo.get(_SHELTER)
        if memo is None:
            memo = req.memo[_SHELTER] = {}
            memo[None] = sum(req.free.count.values())  # C(t): the GPUs of the ready nodes
        got = memo.get(run.key)
        if got is None:
            if not run.allocated:  # (the clause concerns allocated runs: unallocated work is victim 1)
                memo[run.key] = False
                return False
            assert req.tree is not None  # expired-behind runs are searched only with a tree
            got = memo[run.key] = hero_sheltered(
                run.gpus_per_replica * run.replicas,
                req.tree.abs_share(run.budget),
                memo[None],
                self.view.ratio(run.budget),
                req.hero_min_gpus,
            )
        return bool(got)

    def within_share(self, budget: str) -> bool:
        """``budget`` is at or under its share (r <= 1), judged once per request (one cycle's view, as
        :meth:`sheltered`): its gangs stay spared by ``gang_last_resort_over_share``'s last resort."""
        memo = self.req.memo.setdefault(_WITHIN, {})
        got = memo.get(budget)
        if got is None:
            got = memo[budget] = self.view.ratio(budget) <= 1.0
        return bool(got)

    def rank(self, x: Candidate) -> tuple[bool, tuple[int, int, int, str, int]]:
        """Unallocated, then idle allocated, then busy allocated runs; each by its order key
        (without idle runs the same order as candidate_order)."""
        return (x[0][0] > 0 and x[1].key not in self.idle_runs, x[0])

    def eligible(self, nid: str) -> bool:
        """J may use node ``nid``: known, not reserved, of J's model, with at least g GPUs."""
        model = self.model
        return (
            nid in self.fmodel
            and nid not in self.reserved
            and self.fcount[nid] >= self.g
            and (model is None or self.fmodel[nid] == model)
        )

    def evaluate(self, nid: str, lst: list[Candidate]) -> Option | None:
        """The least-cost set of ``lst`` (cheapest first) that frees g GPUs on ``nid``, with its cost."""
        g = self.g
        have = len(self.ffree[nid])
        if len(lst) == 1:  # (most nodes hold one candidate: the loops below, unrolled)
            x = lst[0]
            if have >= g:
                return ((0, 0, 0, 0.0), nid, [])
            if have + len(x[2]) < g:
                return None
            c = x[0]
            lost1 = (c[0] + c[1]) * (self.req.now + c[2]) / 1e6  # order_lost_gpu_s(c, now), inlined
            if c[0] and x[1].key in self.idle_runs:
                return ((0, c[0], c[1], lost1), nid, [x])
            return ((c[0], 0, c[1], lost1), nid, [x])
        reach = have
        for x in lst:
            reach += len(x[2])
            if reach >= g:
                break
        else:
            if reach < g:
                return None
        chosen = []
        got = have
        for x in lst:
            if got >= g:
                break
            chosen.append(x)
            got += len(x[2])
        for x in sorted(chosen, key=self.rank, reverse=True):
            if got - len(x[2]) >= g:
                chosen.remove(x)
                got -= len(x[2])
        a = i = u = 0
        lost = 0.0
        now = self.req.now
        idle_runs = self.idle_runs
        for x in chosen:
            c = x[0]
            if c[0] and x[1].key in idle_runs:
                i += c[0]
            else:
                a += c[0]
            u += c[1]
            lost += (c[0] + c[1]) * (now + c[2]) / 1e6  # order_lost_gpu_s(c, now), inlined
        return ((a, i, u, lost), nid, chosen)


def _unallocated_options(s: _Search) -> dict[str, Option]:
    """Nodes that unallocated victims alone can free for J, from the cycle's cache of them.

    Options depend on g, the model and each node's state, not on the preemptor: only the nodes
    touched (``free.log``) since they were last looked at are evaluated again."""
    victims, log = s.req.victims, s.req.free.log
    unalloc_nodes = victims.unalloc
    ckey = (s.g, s.model)
    cached = victims.unalloc_options.get(ckey)
    todo: Any
    if cached is None:
        cached = victims.unalloc_options[ckey] = _first_unallocated_options(s)
        victims.unalloc_seen[ckey] = len(log)
        return cached
    else:
        pos = victims.unalloc_seen[ckey]
        if pos == len(log):
            todo = ()
        else:
            touched = set(log[pos:])
            for nid in touched:
                cached.pop(nid, None)
            todo = [nid for nid in touched if nid in unalloc_nodes]
    victims.unalloc_seen[ckey] = len(log)
    taken = s.taken
    heap = _unallocated_heap(s.req, ckey, cached)
    for nid in todo:
        if not s.eligible(nid):  # (static in a cycle but for reservations, which are logged)
            continue
        lst = unalloc_nodes[nid]
        if taken:
            cands = [x for x in lst if (x[1].job_id, x[1].attempt) not in taken]
        else:
            cands = lst  # evaluate() only reads it
        if cands:
            opt = s.evaluate(nid, cands)
            if opt is not None:
                cached[nid] = opt
                heapq.heappush(heap, (opt[0], nid, id(opt), opt))
    return cached


def _first_unallocated_options(s: _Search) -> dict[str, Option]:
    """Every node that unallocated victims alone can free for J (the first search of its g and model in the
    cycle: :func:`_unallocated_options` with every node to look at), and their heap made in one go."""
    req = s.req
    unalloc_nodes, taken, evaluate = req.victims.unalloc, s.taken, s.evaluate
    fmodel, fcount, reserved, g, model = s.fmodel, s.fcount, s.reserved, s.g, s.model
    cached: dict[str, Option] = {}
    for nid, lst in unalloc_nodes.items():
        # s.eligible(nid), inlined (once per node with unallocated runs)
        if nid not in fmodel or nid in reserved or fcount[nid] < g or (model is not None and fmodel[nid] != model):
            continue
        if taken:
            lst = [x for x in lst if (x[1].job_id, x[1].attempt) not in taken]
            if not lst:
                continue
        opt = evaluate(nid, lst)
        if opt is not None:
            cached[nid] = opt
    _unallocated_heap(req, (g, model), cached)
    return cached


def _unallocated_heap(
    req: PreemptionRequest, ckey: tuple[int, str | None], cached: dict[str, Option]
) -> list[tuple[tuple[int, int, int, float], str, int, Option]]:
    """A heap ``(cost, node, id, option)`` of the cached unallocated options of ``ckey`` (kept in ``req.memo``
    while the cache is the same dict); entries whose option is no longer the node's are stale."""
    hkey = ("unallocated", ckey)
    ent = req.memo.get(hkey)
    if ent is None or ent[0] is not cached:
        heap = [(o[0], nid, id(o), o) for nid, o in cached.items()]
        heapq.heapify(heap)
        ent = req.memo[hkey] = (cached, heap)
    heap = ent[1]
    if len(heap) > 2 * len(cached) + 64:
        heap[:] = [(o[0], nid, id(o), o) for nid, o in cached.items()]
        heapq.heapify(heap)
    return heap


def _cheapest_unallocated(s: _Search, cached: dict[str, Option], k: int) -> list[Option]:
    """The k cheapest (cost, then node id) of the cached unallocated options, all of them when fewer."""
    if len(cached) <= k:
        return list(cached.values())
    heap = _unallocated_heap(s.req, (s.g, s.model), cached)
    if k == 1:  # (most jobs: the top read in place; entries are distinct, so the heap pops them in one order)
        while heap:
            e = heap[0]
            if cached.get(e[1]) is e[3]:
                return [e[3]]
            heapq.heappop(heap)  # stale
        return []
    kept: list[tuple[tuple[int, int, int, float], str, int, Option]] = []
    while heap and len(kept) < k:
        e = heapq.heappop(heap)
        if cached.get(e[1]) is e[3]:
            kept.append(e)
    for e in kept:
        heapq.heappush(heap, e)
    return [e[3] for e in kept]


def _free_options(s: _Search, options: list[Option]) -> None:
    """Add the nodes with g free GPUs and no unallocated victim left on them (no victim needed).

    Kept in ``req.memo`` per (g, model) with the length of ``free.log``: free GPUs and taken victims change
    only with an entry there (a victim is taken after its nodes are logged)."""
    req = s.req
    free = req.free
    key = (_FREE, s.g, s.model)
    got = req.memo.get(key)
    if got is not None and got[0] == len(free.log):
        options.extend(got[1])
        return
    unalloc_nodes, taken, model = req.victims.unalloc, s.taken, s.model
    fcount, g = s.fcount, s.g
    found: list[Option] = []
    for c in range(g, free.maxc + 1):
        for m, b in free.buckets.items():
            if model is not None and m != model:
                continue
            for nid in b[c]:
                # (unalloc_nodes lists are never empty: with nothing taken, only nodes without them qualify)
                if nid not in unalloc_nodes or (taken and not any(x[1].key not in taken for x in unalloc_nodes[nid])):
                    if fcount[nid] >= g:
                        found.append(((0, 0, 0, 0.0), nid, []))
    req.memo[key] = (len(free.log), found)
    options.extend(found)


def _idle_options(s: _Search, options: list[Option]) -> None:
    """D3.idle-runs: nodes freed with idle runs too, for any job that fits, before any busy run."""
    victims, taken = s.req.victims, s.taken
    seen = {o[1] for o in options}
    for nid, lst in victims.idle_on.items():
        if nid in seen or not s.eligible(nid):
            continue
        cands = [x for x in lst if x[1].key not in taken]
        if not cands:
            continue
        cands.extend(x for x in victims.unalloc.get(nid, ()) if x[1].key not in taken)
        cands.sort(key=s.rank)
        opt = s.evaluate(nid, cands)
        if opt is not None:
            options.append(opt)


def _expired_by_node(req: PreemptionRequest, behind: Iterable[str]) -> dict[str, list[tuple[str, list[Candidate]]]]:
    """Node -> ``(leaf, its expired runs there)`` for every leaf that was ever ``behind`` in this request's
    searches, and the shapes ``(replicas, GPUs)`` of the expired gangs among them (in ``req.memo``): a leaf
    is indexed the first time it is behind, so a cycle reads only the expired runs it may preempt."""
    memo = req.memo
    by_node = memo.get(_BY_NODE)
    if by_node is None:
        by_node = memo[_BY_NODE] = {}
        memo[_SEEN] = set()
        memo[_GANG_SHAPES] = []
    seen = memo[_SEEN]
    new = [v for v in behind if v not in seen]
    if new:
        shapes = set(memo[_GANG_SHAPES])
        victims = req.victims
        for v in new:
            seen.add(v)
            for nid, lst in victims.expired_on(v).items():
                ent = by_node.get(nid)
                if ent is None:
                    by_node[nid] = [(v, lst)]
                else:
                    ent.append((v, lst))
                shapes.update((x[1].replicas, x[0][0]) for x in lst if x[1].replicas > 1)
        memo[_GANG_SHAPES] = sorted(shapes)
    return by_node


def _memo_key(req: PreemptionRequest, g: int, model: str | None, gpus: int, shelter: bool) -> tuple[object, ...]:
    """What a node's expired-behind option depends on beside the node and the behind set: g, the model and,
    with the gang rule, which expired gang shapes (of the leaves indexed so far) are too large for J (the one
    place the job's size enters :func:`gang_rule`; the gang's age does not depend on J), so that jobs of one g
    share their options. A new shape makes new keys: their options start afresh. With ``shelter`` (D3.hero-cover's
    victims' clause) the options leave out the sheltered hero runs: a key of its own."""
    least = req.gang_least_gpus
    if not req.gangs:
        if not req.sparing_within:
            return (g, model, shelter)
        shapes = tuple(gang_rule(r, n, gpus, least_gpus=least) for r, n in req.memo[_GANG_SHAPES])
        return (g, model, shelter, _WITHIN, shapes)
    return (g, model, shelter, tuple(gang_rule(r, n, gpus, least_gpus=least) for r, n in req.memo[_GANG_SHAPES]))


def _node_option(
    s: _Search,
    nid: str,
    behind: Mapping[str, object],
    mine: list[tuple[str, list[Candidate]]],
    gpus: int,
    shelter: bool = False,
    lists: dict[str, tuple[list[Candidate], bool, bool]] | None = None,
) -> tuple[Option | None, bool, bool]:
    """The least-cost way to free ``nid`` for J with the expired runs there of the leaves ``behind`` J's
    (D3.victims rule 2; less the gangs :func:`gang_rule` spares, D3.gangs; with ``shelter``, less the covered
    hero runs within their share, D3.hero-cover), with the unallocated and idle runs there; whether a gang was
    spared; whether a hero run was left out. ``(None, ...)``: no such run, or not enough GPUs. ``lists``: the
    node's candidates kept for the searches of every g sharing the gang test (:class:`_ListMemo`)."""
    if not s.eligible(nid):
        return None, False, False
    if lists is None:
        lst, spared, sheltered = _node_list(s, nid, behind, mine, gpus, shelter)
    else:
        got = lists.get(nid)
        if got is None:
            got = lists[nid] = _node_list(s, nid, behind, mine, gpus, shelter)
        lst, spared, sheltered = got
    if not lst:
        return None, spared, sheltered
    return s.evaluate(nid, lst), spared, sheltered


def _node_list(
    s: _Search,
    nid: str,
    behind: Mapping[str, object],
    mine: list[tuple[str, list[Candidate]]],
    gpus: int,
    shelter: bool,
) -> tuple[list[Candidate], bool, bool]:
    """The candidates of :func:`_node_option` on ``nid``, cheapest first (empty without an expired-behind
    run); whether a gang was spared; whether a hero run was left out. They depend on J's size only through
    :func:`gang_rule`'s size test of the expired gang shapes (in :func:`_memo_key`), not on g or the model."""
    req = s.req
    victims, taken, now, gang_cap, idle_runs = req.victims, s.taken, req.now, req.gang_cap, s.idle_runs
    lst: list[Candidate] = []
    spared = sheltered = False
    least = req.hero_min_gpus or 0  # (the run's allocated GPUs first: most runs are far smaller)
    for v, cands in mine:
        if v not in behind:
            continue
        for x in cands:
            if x[1].key in taken:
                continue
            if (
                (req.gangs or req.sparing_within)
                and x[1].replicas > 1  # (a single-node run always may: gang_rule's age test is not needed)
                and not gang_rule(
                    x[1].replicas,
                    x[0][0],
                    gpus,
                    ran_us(x[1], now),
                    gang_bound_us(x[1], gang_cap(x[1].budget) if gang_cap is not None else None, req.gang_times),
                    req.gang_least_gpus,
                )
                and (req.gangs or s.within_share(x[1].budget))
            ):
                spared = True  # (the failure says nothing about a larger job)
                continue
            if shelter and x[0][0] >= least and s.sheltered(x[1]):
                sheltered = True
                continue
            lst.append(x)
    if not lst:
        return lst, spared, sheltered
    if nid in victims.unalloc:
        lst.extend(x for x in victims.unalloc[nid] if x[1].key not in taken)
    if idle_runs:
        lst[:] = [x for x in lst if x[1].key not in idle_runs]  # (an idle expired run: once, below)
        lst.extend(x for x in victims.idle_on.get(nid, ()) if x[1].key not in taken)
    lst.sort(key=s.rank)  # (order keys are unique: the order does not depend on the leaves' order)
    return lst, spared, sheltered


@dataclass(slots=True, eq=False)
class _BehindMemo:
    """The expired-behind options of one job shape in one request's searches (speed only).

    ``opts``: node -> ``(seq, option)`` for the leaves ``behind`` at the last search, nodes without an
    option absent; ``heap``: ``(cost, node, seq)`` of the options, stale entries (a node's seq moved on)
    dropped when met; ``spared``: the nodes where a gang was spared; ``sheltered``: the nodes where a hero run
    was left out (D3.hero-cover). A node's option depends only on the
    behind set, J's shape and the node's own state, so a search re-evaluates only the nodes touched since
    the last one (``free.log`` from ``pos``: GPUs taken, victims taken, reservations) and the nodes of the
    leaves that joined or left the behind set.
    """

    behind: set[str] = field(default_factory=set)
    pos: int = 0
    opts: dict[str, tuple[int, Option]] = field(default_factory=dict)
    heap: list[tuple[tuple[int, int, int, float], str, int]] = field(default_factory=list)
    spared: set[str] = field(default_factory=set)
    sheltered: set[str] = field(default_factory=set)
    seq: int = 0

    def copy(self) -> _BehindMemo:
        """A memo of its own with the same contents (the options are never changed in place)."""
        return _BehindMemo(
            set(self.behind),
            self.pos,
            dict(self.opts),
            list(self.heap),
            set(self.spared),
            set(self.sheltered),
            self.seq,
        )


@dataclass(slots=True, eq=False)
class _ListMemo:
    """The expired-behind candidates per node shared by the searches of every g and model with one gang test
    and shelter (speed only): ``lists`` node -> :func:`_node_list`'s answer for the leaves ``behind``;
    a node leaves it when touched (``free.log`` from ``pos``) or when one of its leaves joins or leaves the
    behind set, as in :class:`_BehindMemo`."""

    behind: set[str] = field(default_factory=set)
    pos: int = 0
    lists: dict[str, tuple[list[Candidate], bool, bool]] = field(default_factory=dict)

    def copy(self) -> _ListMemo:
        """A memo of its own with the same contents (a node's answer is never changed in place)."""
        return _ListMemo(set(self.behind), self.pos, dict(self.lists))


_LISTS = "node_lists"
_BY_NODE = "expired_by_node"
_SEEN = "expired_indexed"
_GANG_SHAPES = "gang_shapes"
_MAX_R = "max_ratio"
_SHORT = "short"
_SHELTER = "sheltered"
_WITHIN = "within_share"  # budget -> at or under its share (gang_last_resort_over_share)
_LAST = "last_used"
_FREE = "free_options"


def known_short(
    req: PreemptionRequest, g: int, k: int, model: str | None, leaf: str, delta: float, charge_count: int
) -> bool:
    """The search of a job of shape (g, k, model) of ``leaf`` with hysteresis ``delta`` is known to fail
    without looking (speed only): a search of this shape found too few nodes without expired-behind runs
    with nothing touched since (free, unallocated and idle options are the same for any leaf), and no leaf is
    behind ``leaf``'s by ``delta`` for any charge (:func:`_none_behind`; ``charge_count``: the cycle's charges
    so far). What :func:`plan_preemption` tests first: a caller may ask it before setting up the request for
    the job."""
    return req.memo.get((_SHORT, g, model, k)) == len(req.free.log) and _none_behind(req, leaf, delta, charge_count)


def short_test(
    req: PreemptionRequest, g: int, k: int, model: str | None, delta: float, charge_count: int
) -> Callable[[str], bool] | None:
    """:func:`known_short` of shape (g, k, model) with ``delta`` as a test of the leaf alone, for questions
    asked of many leaves with nothing placed, reserved or charged between them; ``None`` when the shape's
    first test fails (then it fails for every leaf)."""
    if req.memo.get((_SHORT, g, model, k)) != len(req.free.log):
        return None
    got = _behind_answers(req, delta)
    if got is None:
        return _never
    top, clear, ratio = got
    # (the loop of _nothing_behind, its bound read once: nothing moves it meanwhile)
    return partial(
        _clear_or_none_behind, top=top, clear=clear, ratio=ratio, delta=delta, req=req, charge_count=charge_count
    )


def _none_behind(req: PreemptionRequest, leaf: str, delta: float, charge_count: int) -> bool:
    """No leaf is behind ``leaf``'s by ``delta`` whatever J's charge, with ``charge_count`` charges in the cycle
    so far: :func:`_nothing_behind` (a bound on every r), else :meth:`CycleVictims.behind_of` at charge 0 finds
    none (the after-move test only refuses more as the charge grows, so none is behind for any charge); what
    :func:`plan_preemption` finds before it returns ``None`` for a shape known to be short, with ``narrowed``
    false. ``False`` without a tree or with a view that charges (the baselines: nothing is known)."""
    got = _behind_answers(req, delta)
    if got is None:
        return False
    top, clear, ratio = got
    return _clear_or_none_behind(leaf, top, clear, ratio, delta, req, charge_count)


def _clear_or_none_behind(
    leaf: str,
    top: float,
    clear: dict[str, bool],
    ratio: Callable[[str], float],
    delta: float,
    req: PreemptionRequest,
    charge_count: int,
) -> bool:
    """:func:`_none_behind` once :func:`_behind_answers` is read (``top``, ``clear``, ``ratio``)."""
    if _ancestors_clear(leaf, top, clear, ratio, delta):
        return True
    view = req.ratio
    assert not callable(view) and req.tree is not None  # (_behind_answers answered)
    behind, narrowed = req.victims.behind_of(leaf, view, delta, charge_count, req.tree, 0.0, req.moves)
    return not behind and not narrowed


def _never(leaf: str) -> bool:
    return False


def _nothing_behind(req: PreemptionRequest, leaf: str | None = None, delta: float | None = None) -> bool:
    """No branch is behind ``leaf``'s (default J's) by ``delta`` (default the request's) at any ancestor (so
    :meth:`CycleVictims.behind_of` finds no leaf):
    the largest r of any budget is below r + delta of each of the leaf's ancestors (:func:`_behind_answers`)."""
    if delta is None:
        delta = req.delta
    got = _behind_answers(req, delta)
    if got is None:
        return False
    top, clear, ratio = got
    return _ancestors_clear(req.leaf if leaf is None else leaf, top, clear, ratio, delta)


def _ancestors_clear(
    leaf: str, top: float, clear: dict[str, bool], ratio: Callable[[str], float], delta: float
) -> bool:
    """``top`` < r + ``delta`` for every ancestor of ``leaf`` (itself included), each answer kept in ``clear``."""
    for a in ancestors_of(leaf):
        ok = clear.get(a)
        if ok is None:
            ok = clear[a] = top < ratio(a) + delta  # (the same sum as behind_of's filter)
        if not ok:
            return False
    return True


def _behind_answers(
    req: PreemptionRequest, delta: float
) -> tuple[float, dict[str, bool], Callable[[str], float]] | None:
    """What :func:`_nothing_behind` reads: the bound on the largest r, the answers kept with it for ``delta``
    (budget -> bound < its r + delta), and the view's r; ``None`` without a tree or a view that charges
    (the baselines: nothing is known). The bound is kept per request (speed only): the largest r at its first
    use, raised by the r of the ancestors of each leaf charged since (a charge only raises r, and only theirs).
    Each answer is kept with the bound: until the next charge neither the bound nor any r moves, so the
    leaves of one branch share their ancestors' answers."""
    tree = req.tree
    ratio_of = req.ratio
    if tree is None or callable(ratio_of):
        return None
    memo = req.memo
    ratio = ratio_of.ratio
    charged = req.charged
    got = memo.get(_MAX_R)
    if got is None or got[0] != len(charged):
        if got is None:
            top = max((ratio(p) for p in tree.paths()), default=0.0)
        else:
            top = got[1]
            for c in charged[got[0] :]:
                for a in ancestors_of(c):
                    r = ratio(a)
                    if r > top:
                        top = r
        got = memo[_MAX_R] = (len(charged), top, {})
    answers: dict[float, dict[str, bool]] = got[2]
    clear = answers.get(delta)
    if clear is None:
        clear = answers[delta] = {}
    return got[1], clear, ratio


def _behind_options(s: _Search, options: list[Option], shelter: bool = False, extra: int = 0) -> list[Option] | None:
    """The k cheapest of ``options`` and of the nodes that expired-behind runs (with unallocated and idle
    ones) can free for J, a node's expired-behind option in place of its other one; ``None`` when no leaf
    is behind J's. With ``shelter``, the covered hero runs within their share are left out (D3.hero-cover)
    and ``s.sheltered_out`` tells whether one was; ``extra`` more expired-behind options than k are kept."""
    s.sheltered_out = False
    req = s.req
    victims, k = req.victims, req.job.replicas
    if _nothing_behind(req):
        victims.narrowed = False
        return None
    behind, victims.narrowed = victims.behind_of(
        req.leaf, s.view, req.delta, req.charge_count, req.tree, req.charge_gpu_s, req.moves
    )
    if not behind:
        return None
    by_node = _expired_by_node(req, behind)
    gpus = s.g * k
    key = _memo_key(req, s.g, s.model, gpus, shelter)
    memo = _per_set(req, key, behind, _BehindMemo)
    log = req.free.log
    dirty = set(log[memo.pos :])
    memo.pos = len(log)
    if memo.behind != behind.keys():
        for v in memo.behind.symmetric_difference(behind):
            dirty.update(victims.expired_on(v))
        memo.behind = set(behind)
    lists = _node_lists(req, key[2:], behind, log) if dirty else None
    opts, heap, spared, sheltered = memo.opts, memo.heap, memo.spared, memo.sheltered
    for nid in dirty:  # (in any order: the options do not depend on it)
        mine = by_node.get(nid)
        if mine is None:
            continue
        opt, sp, sh = _node_option(s, nid, behind, mine, gpus, shelter, lists)
        if sp:
            spared.add(nid)
        else:
            spared.discard(nid)
        if sh:
            sheltered.add(nid)
        else:
            sheltered.discard(nid)
        if opt is None:
            opts.pop(nid, None)
        else:
            memo.seq += 1
            opts[nid] = (memo.seq, opt)
            heapq.heappush(heap, (opt[0], nid, memo.seq))
    if spared:
        victims.spared = True
    s.sheltered_out = bool(sheltered)
    if len(heap) > 2 * len(opts) + 64:
        heap[:] = [(o[0], nid, q) for nid, (q, o) in opts.items()]
        heapq.heapify(heap)
    best: list[Option] = [o for o in options if o[1] not in opts]
    kept: list[tuple[tuple[int, int, int, float], str, int]] = []
    while heap and len(kept) < k + extra:
        e = heapq.heappop(heap)
        cur = opts.get(e[1])
        if cur is not None and cur[0] == e[2]:
            kept.append(e)
            best.append(cur[1])
    for e in kept:
        heapq.heappush(heap, e)
    return best


_M = TypeVar("_M", "_BehindMemo", "_ListMemo")


def _per_set(req: PreemptionRequest, key: tuple[object, ...], behind: Mapping[str, object], new: type[_M]) -> _M:
    """The memo of ``key`` for the behind set ``behind``: one per set the request's searches meet (the behind
    set moves with the preemptor's leaf and with each charge, and comes back), so that a set met again finds
    its memo as it left it, brought up to date by the nodes touched since; a set met first starts from a copy
    of the memo of ``key`` used last (then only the nodes of the leaves that joined or left are looked at again,
    as when one memo followed the set). Speed only: each memo says what its own set's searches would find."""
    per_set = req.memo.get(key)
    if per_set is None:
        per_set = req.memo[key] = {}
    members = frozenset(behind)
    memo = per_set.get(members)
    if memo is None:
        last = req.memo.get((_LAST, key))
        memo = per_set[members] = new() if last is None else last.copy()
    req.memo[(_LAST, key)] = memo
    return memo


def _node_lists(
    req: PreemptionRequest, test: tuple[object, ...], behind: Mapping[str, object], log: list[str]
) -> dict[str, tuple[list[Candidate], bool, bool]]:
    """The kept candidates of the nodes for the searches sharing ``test`` (shelter and gang test), brought
    up to date: the nodes touched since, and those of the leaves that joined or left the behind set, dropped."""
    lm = _per_set(req, (_LISTS, *test), behind, _ListMemo)
    lists = lm.lists
    if lists:
        for nid in log[lm.pos :]:
            lists.pop(nid, None)
        if lm.behind != behind.keys():
            for v in lm.behind.symmetric_difference(behind):
                for nid in req.victims.expired_on(v):
                    lists.pop(nid, None)
    lm.pos = len(log)
    if lm.behind != behind.keys():
        lm.behind = set(behind)
    return lists


def _refused(s: _Search, best: list[Option]) -> bool:
    """The least-cost plan waits: :func:`patience_rule` (the job in ``victims.waits``), then
    :func:`checkpoint_rule` (the job in ``victims.checkpoint_waits``)."""
    req = s.req
    now, job, victims, idle_runs = req.now, req.job, req.victims, s.idle_runs
    gpus = job.gpus_per_replica * job.replicas
    lost: dict[RunKey, tuple[float, Run]] = {}
    for _, _, chosen in best:
        for x in chosen:
            # a gang victim on two nodes counts once; an idle run's GPUs did no work (D3.idle-runs)
            lost[x[1].key] = (0.0 if x[1].key in idle_runs else order_lost_gpu_s(x[0], now), x[1])
    total = sum(v[0] for v in lost.values())
    waited_s = us_to_s(now - job.queued_at_us)
    if patience_rule(total, gpus, waited_s, s.view.ratio(req.leaf), req.patience_s) == PATIENCE_WAIT:
        victims.waits[job.job_id] = total
        return True
    soon = checkpoint_rule(((w, next_checkpoint_us(r)) for w, r in lost.values()), gpus, now, req.checkpoint_wait_s)
    if soon.wait:
        victims.checkpoint_waits[job.job_id] = soon
        return True
    return False


def _commit(s: _Search, best: list[Option]) -> Plan:
    """Take J's GPUs on the ``best`` nodes (free first, then the victims', lowest indices) and check every
    victim again by :func:`victim_rule`, the one home of the rule, for its audit record."""
    req = s.req
    free, g, leaf, now, idle_runs = req.free, s.g, req.leaf, req.now, s.idle_runs
    gangs, gang_cap = req.gangs and not s.gangs_spent, req.gang_cap
    gpus = g * req.job.replicas
    log = free.log
    placements = []
    picked: dict[RunKey, tuple[Run, Victim]] = {}
    for _, nid, chosen in best:
        for x in chosen:
            for p in x[1].placements:
                log.append(p.node_id)
        log.append(nid)
        taken_gpus = list(free.take(nid, min(g, len(s.ffree[nid]))))
        extra = sorted(gg for x in chosen for gg in x[2])
        taken_gpus.extend(extra[: g - len(taken_gpus)])
        placements.append(placement(nid, tuple(sorted(taken_gpus))))
        for x in chosen:
            run = x[1]
            if run.key in picked:
                continue
            idle = idle_runs.get(run.key)
            verdict = victim_rule(
                run,
                leaf,
                now,
                s.view,
                req.delta,
                req.charge_gpu_s,
                req.moves,
                gpus if gangs else None,
                # (victim_rule reads the cap of allocated runs only: an unallocated one is allowed first)
                gang_cap_us=gang_cap(run.budget) if gangs and gang_cap is not None and run.allocated else None,
                gang_least_gpus=req.gang_least_gpus,
                gang_times=req.gang_times,
                idle_s=idle[0] if idle is not None else None,
                idle_after_s=idle[1] if idle is not None else None,
            )
            if not verdict.allowed:  # the search and the rule disagree: a bug, never a decision
                raise AssertionError(f"victim {run.key} of {leaf}'s plan refused by victim_rule: {verdict}")
            picked[run.key] = (run, _victim(run, now, verdict, idle[0] if idle is not None else None))
    return tuple(placements), [picked[key] for key in sorted(picked)]


class _CallableView:
    """A :class:`ShareView` of a plain ``path -> r`` function (a charge changes nothing)."""

    __slots__ = ("ratio",)

    def __init__(self, fn: Callable[[str], float]) -> None:
        self.ratio = fn

    def ratio_after(self, path: str, gpu_s: float) -> float:
        return self.ratio(path)


def _victim(run: Run, now: Micros, verdict: VictimVerdict, idle_s: float | None = None) -> Victim:
    """The audit record of a victim the rule allowed (``verdict.allowed``: one of the allowing rule ids)."""
    until = run.protected_until_us
    rule: Literal["unallocated", "idle", "expired_behind"] = (
        RULE_UNALLOCATED
        if verdict.rule == RULE_UNALLOCATED
        else RULE_IDLE
        if verdict.rule == RULE_IDLE
        else RULE_EXPIRED_BEHIND
    )
    values = {
        "job_id": run.job_id,
        "attempt": run.attempt,
        "budget": run.budget,
        "allocated": run.allocated,
        "gpus": run.gpus,
        "protected_until": from_us(until) if until is not None else None,
        "rule": rule,
        "lca": verdict.lca,
        "victim_ratio": verdict.victim_ratio,
        "preemptor_ratio": verdict.preemptor_ratio,
        "preemptor_ratio_after": verdict.preemptor_ratio_after,
        "lost_gpu_s": work_lost_gpu_s(run, now),
        "idle_s": idle_s if rule == RULE_IDLE else None,
    }
    return built(Victim, values, _plain_victim(values))


def _plain_victim(v: dict[str, Any]) -> bool:
    """Every value of a :class:`Victim` is what its validation returns (:func:`~apportion.domain.engine.emit.built`)."""
    lca, until = v["lca"], v["protected_until"]
    return (
        type(v["job_id"]) is str
        and type(v["attempt"]) is int
        and type(v["budget"]) is str
        and type(v["allocated"]) is bool
        and type(v["gpus"]) is int
        and (until is None or utc_time(until))
        and (lca is None or type(lca) is str)
        and real_or_none(v["victim_ratio"])
        and real_or_none(v["preemptor_ratio"])
        and real_or_none(v["preemptor_ratio_after"])
        and real_or_none(v["lost_gpu_s"])
        and real_or_none(v["idle_s"])
    )
