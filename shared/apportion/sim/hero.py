"""The hero scenario: gangs of thousands of GPUs for weeks on a 16,384-GPU cluster (docs/hero.md).

Pure and seeded: :func:`hero_scenario` builds the cluster, the budget tree and
the trace from a background trace (the Philly jobs, loaded by the caller) and
a seed; :class:`HeroSimulator` is the simulator with one more measure, the
GPUs idled while each hero job gathered; :func:`hero_rows` reads the per-job
figures from a finished run.

* Cluster: ``nodes`` nodes of 8 GPUs, in ``racks`` racks and ``blocks``
  blocks (:func:`~apportion.sim.traces.topology_of`; default 2,048 nodes,
  32 racks, 4 blocks).
* Budgets: ``bg`` (share 1 - ``hero_share``) holds the background trace's
  leaf budgets at their relative shares (``philly/<vc>`` becomes
  ``bg/<vc>``); ``hero`` holds one leaf per hero job at the share given.
* Background: every background job, its GPUs multiplied by ``size`` (8 GPUs
  per replica once it passes a node), the trace tiled (its span repeated)
  until ``days``, each copy's submit time shifted by a seeded offset of at
  most one hour; budgets, minimum runtimes and durations as loaded. ``load``
  multiplies the background's arrivals: each job of each copy is submitted
  ``floor(load)`` times, and once more with probability ``load - floor(load)``
  (each time with its own offset; the draws beyond the first come from a second
  seeded stream, so ``load=1`` is the scenario without it).
* Hero jobs: :data:`DEFAULT_HEROES`: g = 8, k = GPUs / 8, checkpointing
  every ``checkpoint_s`` (default hourly), minimum runtime ``min_runtime_s``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import UNTIL_STARTED
from apportion.domain.engine.reservation import protection_end_us
from apportion.domain.fairshare import budget_order
from apportion.domain.occupancy import OccupancyLedger
from apportion.events import Event, JobPlaced, JobPreempted, JobStarted, JobSubmitted
from apportion.report import share_deficit_pp
from apportion.sim.core import SimJob, SimNode, SimResult, Simulator
from apportion.sim.traces import topology_of
from apportion.timeutil import Micros, s_to_us, to_us, us_to_s

__all__ = [
    "DEFAULT_HEROES",
    "HeroJob",
    "HeroRow",
    "HeroScenario",
    "HeroSimulator",
    "OrderHeads",
    "backlogged_pairs",
    "deficit_by_budget",
    "hero_nodes",
    "hero_rows",
    "hero_scenario",
]

DAY_S = 86_400


@dataclass(frozen=True, slots=True)
class HeroJob:
    """One hero job: ``gpus`` GPUs (a multiple of 8) for ``days`` days, submitted ``submit_day`` days in,
    charged to leaf ``hero/<name>`` of absolute share ``share``."""

    name: str
    gpus: int
    days: float
    submit_day: float
    share: float


#: Two budgets whose share covers their job (0.10 x 16,384 = 1,638 >= 1,024; 0.30 x 16,384 = 4,915 >= 4,096)
#: and one that does not (0.10 x 16,384 = 1,638 < 8,192).
DEFAULT_HEROES: tuple[HeroJob, ...] = (
    HeroJob("a", 1024, 14.0, 2.0, 0.10),
    HeroJob("b", 4096, 30.0, 3.0, 0.30),
    HeroJob("c", 8192, 60.0, 4.0, 0.10),
)


@dataclass(frozen=True)
class HeroScenario:
    """A built scenario: the inputs of :class:`~apportion.sim.core.Simulator` and the hero job ids."""

    tree: BudgetTree
    nodes: tuple[SimNode, ...]
    jobs: tuple[SimJob, ...]
    heroes: tuple[str, ...]
    start_us: Micros
    until_us: Micros


def hero_nodes(nodes: int = 2048, gpus: int = 8, racks: int = 32, blocks: int = 4) -> list[SimNode]:
    """``nodes`` nodes ``h0000``.. of ``gpus`` GPUs, labelled by :func:`~apportion.sim.traces.topology_of`."""
    width = max(4, len(str(nodes - 1)))
    out = []
    for i in range(nodes):
        block, rack = topology_of(i, nodes, racks, blocks)
        out.append(SimNode(f"h{i:0{width}d}", gpus, None, block, rack))
    return out


def _scaled_shape(gpus: int, size: int, per_node: int) -> tuple[int, int]:
    """``(g, k)`` of a job of ``gpus * size`` GPUs: one replica while it fits a node, else replicas of a node each.

    >>> _scaled_shape(1, 4, 8), _scaled_shape(4, 16, 8), _scaled_shape(3, 4, 8)
    ((4, 1), (8, 8), (8, 2))
    """
    total = gpus * size
    if total <= per_node:
        return total, 1
    return per_node, -(-total // per_node)


def hero_scenario(
    background: Sequence[SimJob],
    background_tree: BudgetTree,
    seed: int,
    *,
    days: float = 21.0,
    size: int = 16,
    heroes: Sequence[HeroJob] = DEFAULT_HEROES,
    nodes: int = 2048,
    racks: int = 32,
    blocks: int = 4,
    checkpoint_s: float = 3600.0,
    min_runtime_s: float = 24 * 3600.0,
    load: float = 1.0,
    bg_min_runtime_cap_s: float | None = None,
) -> HeroScenario:
    """The scenario of the module docstring. ``background`` and its tree: e.g. the Philly jobs of a slice.

    ``bg_min_runtime_cap_s``: each allocated background job's minimum runtime becomes ``min(duration,
    bg_min_runtime_cap_s)``, the budget file's rule with this cap (``None``: as loaded); unallocated jobs stay
    unallocated. A longer cap leaves more of a busy cluster protected when a hero arrives, so the hero gathers.

    Raises:
        ValueError: no background job, a hero share that leaves the background nothing, a hero
            larger than the cluster or not a multiple of 8 GPUs, a ``load`` below 1, a negative
            ``bg_min_runtime_cap_s``.
    """
    if not background:
        raise ValueError("hero scenario: no background jobs")
    if not load >= 1:
        raise ValueError(f"hero scenario: load {load} must be at least 1")
    if bg_min_runtime_cap_s is not None and not bg_min_runtime_cap_s >= 0:
        raise ValueError(f"hero scenario: background minimum runtime cap {bg_min_runtime_cap_s} s must be >= 0")
    per_node = 8
    hero_share = sum(h.share for h in heroes)
    if not 0 <= hero_share < 1:
        raise ValueError(f"hero scenario: hero shares sum to {hero_share}, must be in [0, 1)")
    for h in heroes:
        if h.gpus % per_node or h.gpus > nodes * per_node:
            raise ValueError(f"hero scenario: hero {h.name}: {h.gpus} GPUs is not a multiple of 8 within the cluster")
    rng = random.Random(seed)
    more = random.Random(f"hero-load-{seed}")  # the arrivals beyond the first of each job (``load``)
    leaves = sorted({j.budget for j in background})
    bg_total = sum(background_tree.abs_share(leaf) for leaf in leaves) or 1.0
    spec: dict[str, Any] = {"bg": 1 - hero_share}
    for leaf in leaves:
        spec["bg/" + leaf.rsplit("/", 1)[-1]] = background_tree.abs_share(leaf) / bg_total or 1e-6
    if heroes:
        spec["hero"] = hero_share
        for h in heroes:
            spec[f"hero/{h.name}"] = h.share / hero_share
    tree = BudgetTree.from_mapping(spec)
    src = sorted(background, key=lambda j: (j.submit_us, j.job_id))
    start = src[0].submit_us
    span = max(src[-1].submit_us - start, s_to_us(3600))
    until = start + s_to_us(days * DAY_S)
    jobs: list[SimJob] = []
    copy = 0
    while start + copy * span < until:
        for j in src:
            times = [j.submit_us + copy * span + s_to_us(rng.uniform(0, 3600))]
            if load > 1:
                extra = int(load) - 1 + (more.random() < load - int(load))
                times += [j.submit_us + copy * span + s_to_us(more.uniform(0, 3600)) for _ in range(extra)]
            g, k = _scaled_shape(j.gpus_per_replica * j.replicas, size, per_node)
            mr = j.min_runtime_s
            if bg_min_runtime_cap_s is not None and mr > 0:
                mr = min(j.duration_s, bg_min_runtime_cap_s)
            for i, t in enumerate(times):
                if t >= until:
                    continue
                jobs.append(
                    replace(
                        j,
                        job_id=f"{j.job_id}~{copy}" + (f".{i}" if i else ""),
                        budget="bg/" + j.budget.rsplit("/", 1)[-1],
                        submit_us=t,
                        gpus_per_replica=g,
                        replicas=k,
                        gpu_model=None,
                        min_runtime_s=mr,
                    )
                )
        copy += 1
    ids = []
    for h in heroes:
        job_id = f"hero-{h.name}"
        ids.append(job_id)
        jobs.append(
            SimJob(
                job_id=job_id,
                budget=f"hero/{h.name}",
                user=f"hero-{h.name}",
                submit_us=start + s_to_us(h.submit_day * DAY_S),
                gpus_per_replica=per_node,
                replicas=h.gpus // per_node,
                min_runtime_s=min_runtime_s,
                duration_s=h.days * DAY_S,
                checkpoint_interval_s=checkpoint_s,
            )
        )
    return HeroScenario(tree, tuple(hero_nodes(nodes, per_node, racks, blocks)), tuple(jobs), tuple(ids), start, until)


class OrderHeads:
    """When each watched job's leaf, after a preemption of the job, first ranks first in the fair-share order.

    Pure: fed every event in processing order (inputs and dispatcher outputs), it reads the order the
    ``FairShareRanking`` publishes, :func:`~apportion.domain.fairshare.budget_order` of every leaf (rank 0 is
    served first), over ``ledger``, an :class:`~apportion.domain.occupancy.OccupancyLedger` the caller folds the
    same events into (the simulator's: its dispatcher state's). The order is read at the preemption and then at
    each later event time, so a leaf's head time is the first event time at which it ranks first. Whether the
    caller folds an event before or after feeding it does not change what is read: an event at ``t`` changes no
    occupancy at ``t`` (a run placed at ``t`` has held its GPUs for no time yet, one ended at ``t`` was charged
    up to it), save a refused start or a lost run, which end their run earlier (none in the simulator's hero
    scenario).

    ``heads[job]``: per preemption, ``[preempted_us, head_us, placed_us]`` (``None``: not yet), the next
    placement ending the record (a placement before the head leaves ``head_us`` ``None``).
    """

    def __init__(self, tree: BudgetTree, leaves: Mapping[str, str], ledger: OccupancyLedger) -> None:
        """``leaves``: job id -> its leaf budget, the jobs watched; ``ledger``: the occupancy read."""
        self._tree = tree
        self._leaves = dict(leaves)
        self.ledger = ledger
        self.heads: dict[str, list[list[Micros | None]]] = {}
        self._open: set[str] = set()  # preempted, not placed again
        self._waiting: set[str] = set()  # preempted, not placed again, not yet at the head
        self._t: Micros | None = None

    def feed(self, ev: Event) -> list[str]:
        """Watch ``ev``; returns the watched jobs whose leaf reached the head at this event's time."""
        t = to_us(ev.ts)
        reached = self._check(t) if self._waiting and (self._t is None or t > self._t) else []
        if self._t is None or t > self._t:
            self._t = t
        job = getattr(ev, "job_id", None)
        if job not in self._leaves:
            return reached
        if type(ev) is JobPreempted and job not in self._open:
            self.heads.setdefault(job, []).append([t, None, None])
            self._open.add(job)
            self._waiting.add(job)
            reached += self._check(t)
        elif type(ev) is JobPlaced and job in self._open:
            self.heads[job][-1][2] = t
            self._open.discard(job)
            self._waiting.discard(job)
        return reached

    def _check(self, t: Micros) -> list[str]:
        led = self.ledger
        head = budget_order(self._tree, led.occupancy(t), led.capacity_gpu_s(t))[0]
        reached = sorted(j for j in self._waiting if self._leaves[j] == head)
        for job in reached:
            self.heads[job][-1][1] = t
            self._waiting.discard(job)
        return reached


class HeroSimulator(Simulator):
    """A :class:`~apportion.sim.core.Simulator` that also measures each hero job's gathering.

    ``gathering_idle_gpu_s[job]``: the simulator's idle-while-waiting integral
    (:mod:`apportion.sim.conservation`, allocated and unallocated waiting
    jobs together) between the job's submission and its first placement:
    GPUs that sat free while some waiting job could have used them. Two
    heroes gathering at once are each charged the whole of that span's idle.

    ``running_us[job]``: when the job's gang first ran whole, every replica of one attempt started
    (``JobStarted``): its placement (``JobPlaced``, the decision) plus the time its victims took to stop,
    within their grace period.

    ``restarts[job]``: per preemption of a hero job, ``(wait_s, protection_s)``: seconds from the
    preemption (its requeue) to its next placement (``None`` while it still waits) and the longest
    protection in force then, seconds: the latest :func:`~apportion.domain.engine.reservation.protection_end_us`
    of the allocated runs that hold GPUs once the preempting cycle's decisions are in (the runs it placed
    included), minus the preemption's time.

    ``heads``: :class:`OrderHeads` fed the run's events; :meth:`heads_s` reads, per preemption, when the job's
    leaf reached the head of the fair-share order and the longest protection in force then.
    """

    def __init__(
        self,
        *args: Any,
        heroes: Sequence[str] = (),
        on_day: Callable[[HeroSimulator, Micros], None] | None = None,
        **kwargs: Any,
    ) -> None:
        """``on_day(sim, t)``: called at the first sample of each simulated day after the first (a long run's
        figures so far: ``sim.jobs_ledger``, ``sim.samples``); ``None``: not called."""
        super().__init__(*args, **kwargs)
        self._heroes = frozenset(heroes)
        self._gather_from: dict[str, float] = {}
        self.gathering_idle_gpu_s: dict[str, float] = {}
        self.restarts: dict[str, list[tuple[float | None, float]]] = {}
        self.running_us: dict[str, Micros] = {}
        self._started: dict[tuple[str, int], set[int]] = {}
        self._requeued: dict[str, Micros] = {}
        self._on_day = on_day
        self._day0: Micros | None = None
        self._days_told = 0
        leaves = {j: self._specs[j].budget for j in self._heroes}
        self.heads = OrderHeads(self.tree, leaves, self.state.ledger)
        self._head_protection: dict[tuple[str, int], float] = {}

    def _watch(self, ev: Event, t: Micros) -> None:
        for job in self.heads.feed(ev):
            n = len(self.heads.heads[job]) - 1
            self._head_protection[job, n] = us_to_s(self._longest_protection(t) - t)

    def heads_s(self, job_id: str) -> list[tuple[float | None, float | None, float | None]]:
        """Per preemption of ``job_id``: seconds from it until the job's leaf first ranked first in the
        fair-share order (:class:`OrderHeads`), from then to the next placement, and the longest protection in
        force then (as in ``restarts``); ``None``: did not happen within the run."""
        out = []
        for n, (pre, head, placed) in enumerate(self.heads.heads.get(job_id, ())):
            assert pre is not None
            out.append(
                (
                    None if head is None else us_to_s(head - pre),
                    None if head is None or placed is None else us_to_s(placed - head),
                    self._head_protection.get((job_id, n)),
                )
            )
        return out

    def _sample(self, t: Micros) -> None:
        super()._sample(t)
        if self._on_day is None:
            return
        if self._day0 is None:
            self._day0 = t
        day = int((t - self._day0) // s_to_us(DAY_S))
        if day > self._days_told:
            self._days_told = day
            self._on_day(self, t)

    def _idle_so_far(self, t: Micros) -> float:
        """The idle-while-waiting integral up to ``t`` (the current ``I`` is constant since its last measure)."""
        self.idle.until(t)
        return self.idle.gpu_s[0] + self.idle.gpu_s[1]

    def _feed(self, ev: Event, t: Micros) -> bool:
        self._watch(ev, t)
        if type(ev) is JobSubmitted and ev.job_id in self._heroes:
            self._gather_from.setdefault(ev.job_id, self._idle_so_far(t))
        elif type(ev) is JobStarted and ev.job_id in self._heroes and ev.job_id not in self.running_us:
            started = self._started.setdefault((ev.job_id, ev.attempt), set())
            started.add(ev.replica)
            if len(started) == self._specs[ev.job_id].replicas:
                self.running_us[ev.job_id] = t
        return super()._feed(ev, t)

    def _outputs(self, out: list[Event], t: Micros) -> None:
        for e in out:
            self._watch(e, t)
            if type(e) is JobPlaced and e.job_id in self._gather_from and e.job_id not in self.gathering_idle_gpu_s:
                self.gathering_idle_gpu_s[e.job_id] = self._idle_so_far(t) - self._gather_from[e.job_id]
            elif type(e) is JobPlaced and e.job_id in self._requeued:
                at = self._requeued.pop(e.job_id)
                _wait, prot = self.restarts[e.job_id][-1]
                self.restarts[e.job_id][-1] = (us_to_s(t - at), prot)
            elif type(e) is JobPreempted and e.job_id in self._heroes and e.job_id not in self._requeued:
                self._requeued[e.job_id] = t
                self.restarts.setdefault(e.job_id, []).append((None, us_to_s(self._longest_protection(t) - t)))
        super()._outputs(out, t)

    def _longest_protection(self, t: Micros) -> Micros:
        """The latest end of protection of the allocated runs holding GPUs now (stopping runs aside; ``t``
        when none is protected past it; a run protected until it completes has no known end and is left out)."""
        ends = (protection_end_us(r) for r in self.state.cluster.runs.values() if r.allocated and not r.stopping)
        return max((e for e in ends if t < e < UNTIL_STARTED), default=t)


@dataclass(frozen=True, slots=True)
class HeroRow:
    """Figures of one hero job in one run (``None``: did not happen within the run); ``stops_d`` and
    ``start_d``: when it was stopped (preempted) and first placed, days since the scenario's start;
    ``running_h``: hours from submission until its whole gang first ran (:attr:`HeroSimulator.running_us`);
    ``restarts_h``: per preemption, hours from it to the next placement (``None``: still waiting) and the
    longest protection in force at it, hours (:attr:`HeroSimulator.restarts`); ``heads_h``: per preemption,
    hours from it until the job's leaf first ranked first in the fair-share order, from then to the next
    placement, and the longest protection in force then (:meth:`HeroSimulator.heads_s`)."""

    job_id: str
    gpus: int
    budget_covers: bool
    start_h: float | None
    gathering_idle_gpu_h: float | None
    gathering_idle_pct_first_day: float | None
    preemptions: int
    lost_gpu_h: float
    max_lost_per_preemption_h: float
    completion_d: float | None
    progress_pct: float
    stops_d: tuple[float, ...] = ()
    start_d: float | None = None
    restarts_h: tuple[tuple[float | None, float], ...] = ()
    running_h: float | None = None
    heads_h: tuple[tuple[float | None, ...], ...] = ()


def hero_rows(
    result: SimResult,
    scenario: HeroScenario,
    gathering_idle_gpu_s: Mapping[str, float],
    capacity_gpus: int,
    saved: Mapping[str, float] | None = None,
    restarts: Mapping[str, Sequence[tuple[float | None, float]]] | None = None,
    running_us: Mapping[str, Micros] | None = None,
    heads: Callable[[str], Sequence[tuple[float | None, float | None, float | None]]] | None = None,
) -> list[HeroRow]:
    """Per hero job: hours from submission to first start (its first placement, ``JobPlaced``: the time to
    start of every policy; with ``running_us``, also until its whole gang ran), GPU-hours idled while it gathered (and as a
    percentage of the GPU-hours it then runs in its first day), preemptions, GPU-hours of work lost (and the
    most one preemption lost, in hours of the whole gang), days from submission to completion, and the part
    of its work done (saved by checkpoints, or completed) when the run ended; with ``restarts``
    (:attr:`HeroSimulator.restarts`), each restart's wait and the longest protection in force at its
    preemption, in hours; with ``heads`` (:meth:`HeroSimulator.heads_s`), each preemption's wait until the
    job's leaf ranked first in the fair-share order, the wait from then and the protection in force then, in
    hours."""
    ledger = result.jobs_ledger
    specs = {j.job_id: j for j in scenario.jobs}
    rows = []
    for job_id in scenario.heroes:
        spec = specs[job_id]
        gpus = spec.gpus_per_replica * spec.replicas
        placed = ledger.first_placed.get(job_id)
        running = (running_us or {}).get(job_id)
        done = ledger.completed.get(job_id)
        stops = [s for s in ledger.stops if s.job_id == job_id]
        lost = sum(s.lost_gpu_s for s in stops)
        idle = gathering_idle_gpu_s.get(job_id)
        progress = spec.duration_s if done is not None else (saved or {}).get(job_id, 0.0)
        rows.append(
            HeroRow(
                job_id=job_id,
                gpus=gpus,
                budget_covers=scenario.tree.abs_share(spec.budget) * capacity_gpus >= gpus,
                start_h=None if placed is None else us_to_s(placed - spec.submit_us) / 3600,
                gathering_idle_gpu_h=None if idle is None else idle / 3600,
                gathering_idle_pct_first_day=None if idle is None else 100 * idle / (gpus * DAY_S),
                preemptions=ledger.preempted.get(job_id, 0),
                lost_gpu_h=lost / 3600,
                max_lost_per_preemption_h=max((s.lost_gpu_s / gpus / 3600 for s in stops), default=0.0),
                completion_d=None if done is None else us_to_s(done - spec.submit_us) / DAY_S,
                progress_pct=100 * progress / spec.duration_s,
                stops_d=tuple(us_to_s(s.at_us - scenario.start_us) / DAY_S for s in stops),
                start_d=None if placed is None else us_to_s(placed - scenario.start_us) / DAY_S,
                restarts_h=tuple(
                    (None if w is None else w / 3600, p / 3600) for w, p in (restarts or {}).get(job_id, ())
                ),
                running_h=None if running is None else us_to_s(running - spec.submit_us) / 3600,
                heads_h=tuple(
                    tuple(None if x is None else x / 3600 for x in h) for h in (heads(job_id) if heads else ())
                ),
            )
        )
    return rows


def backlogged_pairs(
    samples: Sequence[tuple[Micros, Mapping[str, tuple[float, int, int, int]]]],
    start_us: Micros,
    tree: BudgetTree,
    prefix: str = "bg/",
) -> list[tuple[Micros, str, float]]:
    """``(t_us, leaf, deficit pp)`` of every sample from ``start_us`` at which a leaf under ``prefix`` had
    allocated work waiting (the simulator report's pairs of the share deficit, :func:`share_deficit_pp`), in
    sample order, leaves by path within a sample."""
    return [
        (t, leaf, share_deficit_pp(tree.abs_share(leaf), v[0]))
        for t, row in samples
        if t >= start_us
        for leaf, v in sorted(row.items())
        if leaf.startswith(prefix) and v[3]
    ]


def deficit_by_budget(pairs: Sequence[tuple[Micros, str, float]]) -> dict[str, dict[str, Any]]:
    """Per leaf of ``pairs``: ``pairs`` (its backlogged samples), ``behind`` (those with a deficit above 0),
    ``sum_pp`` and ``mean_pp`` of its deficit. The pairs' mean of a run is the sum of every leaf's ``sum_pp``
    over the sum of their ``pairs``: a leaf weighs by how often it was backlogged."""
    out: dict[str, dict[str, Any]] = {}
    for _t, leaf, d in pairs:
        b = out.setdefault(leaf, {"pairs": 0, "behind": 0, "sum_pp": 0.0})
        b["pairs"] += 1
        b["behind"] += d > 0
        b["sum_pp"] += d
    for b in out.values():
        b["mean_pp"] = round(b["sum_pp"] / b["pairs"], 2)
        b["sum_pp"] = round(b["sum_pp"], 1)
    return dict(sorted(out.items()))
