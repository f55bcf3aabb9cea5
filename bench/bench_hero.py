"""The hero scenario under every policy (docs/hero.md): per hero job and per budget figures.

Run::

    .venv/bin/python bench/bench_hero.py [--days 21] [--size 16] [--load 1] [--bg-min-runtime-h H] [--slice week44] [--seed 1]
        [--policy fairshare,slurm,kueue,kai,fifo] [--no-heroes] [--hero-days 2,3,4] [--hero-shares 0.1,0.3,0.1]
        [--hero-min-gpus N|none] [--gang-min-gpus N] [--gang-bound-x X] [--gang-last-resort [--gang-last-resort-over-share]] [--grow-over-share] [--hero-reserve-takable] [--hero-waits]
        [--json out.json] [--progress days.jsonl] [--explain-waits waits.jsonl] [--trace-gather gather.jsonl]

Builds :func:`apportion.sim.hero.hero_scenario` from the Philly jobs of
``--slice`` (``infra/budgets/philly.yaml``'s tree and minimum-runtime rule)
and runs each policy on it, one after another. Prints one line per policy
(wall time, utilisation, the background budgets' share deficit: the mean over the
(sample, budget) pairs with allocated work waiting, the report's definition, and the
mean of the per-budget means), one line per background budget (its backlogged pairs, how many
behind, the sum and mean of its deficit), one line per simulated day (the deficit, the budgets
behind, the GPUs the hero and background budgets run) and one per hero job (time to start, GPU-hours idled while it gathered, preemptions,
work lost, completion; per preemption, the wait to the next placement and the longest protection in force, from
the preemption and from when the hero's leaf first ranked first in the fair-share order,
:class:`apportion.sim.hero.OrderHeads`). ``--no-heroes``: the same run without the hero jobs
(same tree), the reference of the background budgets' deficit. ``--grow-over-share``:
``EngineConfig.grow_over_share`` True (every job's protection grown with its preemptions, as up to policy
``fairtree-9``; by default only a job at or under its share). ``--hero-reserve-takable``:
``EngineConfig.hero_reserve_takable`` (a covered hero reserves only nodes whose runs it may take back, rule
D3.hero-cover). ``--hero-waits``: ``EngineConfig.hero_waits`` (a covered hero never preempts another covered
hero within its share: it waits, reserving the nodes that fit it soonest, rule D3.hero-waits). ``--load X``: the background's
arrivals multiplied by X (the overloaded lab, docs/hero.md); the header line gives the background's
offered demand, its GPU-hours submitted within the horizon over the cluster's. ``--explain-waits FILE``: at each
sample where a background budget is behind its share with allocated work waiting, why each of its waiting jobs
waits and how the gang rule's last resort (``--gang-last-resort``) or the rule off would place it.
``--trace-gather FILE``: at each sample while a hero waits for its first placement, the nodes by what holds them
for it and the cycle's reservation (docs/hero.md, every hero arriving on a full cluster).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import types
from pathlib import Path
from typing import Any

from apportion.cli.simulate import gang_scope
from apportion.domain.cluster import PROTECTION_GROW_OVER_SHARE, UNTIL_STARTED
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import EngineConfig, run_cycle
from apportion.domain.engine.inputs import HERO_MIN_GPUS
from apportion.domain.engine.reservation import protection_end_us
from apportion.events import JobPlaced
from apportion.report import share_deficit_pp
from apportion.settings import default_data_dir
from apportion.sim.baselines import POLICIES
from apportion.sim.core import SimConfig
from apportion.sim.hero import (
    DEFAULT_HEROES,
    HeroSimulator,
    backlogged_pairs,
    deficit_by_budget,
    hero_rows,
    hero_scenario,
)
from apportion.sim.report import summarise
from apportion.sim.traces import load_budget_file, load_trace

ROOT = Path(__file__).resolve().parent.parent


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    bf = load_budget_file(ROOT / "infra/budgets/philly.yaml")
    src = load_trace(a.trace or default_data_dir() / "philly" / "philly.csv", bf, a.seed, a.slice)
    heroes = DEFAULT_HEROES
    if a.hero_days:
        days = [float(d) for d in a.hero_days.split(",")]
        heroes = tuple(dataclasses.replace(h, submit_day=d) for h, d in zip(heroes, days, strict=True))
    if a.hero_shares:
        shares = [float(x) for x in a.hero_shares.split(",")]
        heroes = tuple(dataclasses.replace(h, share=x) for h, x in zip(heroes, shares, strict=True))
    sc = hero_scenario(
        src,
        bf.tree,
        a.seed,
        days=a.days,
        size=a.size,
        heroes=heroes,
        load=a.load,
        bg_min_runtime_cap_s=None if a.bg_min_runtime_h is None else a.bg_min_runtime_h * 3600.0,
    )
    if a.no_heroes:
        sc = dataclasses.replace(sc, jobs=tuple(j for j in sc.jobs if j.job_id not in sc.heroes), heroes=())
    gpus = sum(n.gpus for n in sc.nodes)
    print(
        f"# {len(sc.nodes)} nodes, {gpus} GPUs, {len(sc.jobs)} jobs, {a.days} days, heroes {list(sc.heroes)}, "
        f"background demand {offered_demand(sc, gpus):.2f} of the cluster"
    )
    out = []
    for name in a.policy.split(","):
        least = None if a.hero_min_gpus == "none" else int(a.hero_min_gpus)
        dcfg = DispatchConfig(
            engine=EngineConfig(
                window_s=bf.window_s,
                hero_min_gpus=least,
                grow_over_share=a.grow_over_share,
                hero_reserve_takable=a.hero_reserve_takable,
                hero_waits=a.hero_waits,
                gang_last_resort=a.gang_last_resort,
                gang_last_resort_over_share=a.gang_last_resort_over_share,
                **gang_scope(a.gang_min_gpus, a.gang_bound_x),
            ),
            heartbeat_timeout_s=None,
            scheduler=POLICIES[name],
        )
        cfg = SimConfig(seed=a.seed, dispatch=dcfg, keep_log=False, until_us=sc.until_us, sample_s=3600.0)
        t = time.perf_counter()
        on_day = _progress_writer(a.progress, name, sc, gpus) if a.progress else None
        cls = HeroSimulator if a.explain_waits is None else _explaining(a.explain_waits, dcfg.engine, sc)
        if a.trace_gather:
            cls = _tracing(cls, a.trace_gather, dcfg.engine if name == "fairshare" else None, sc)
        sim = cls(sc.tree, sc.nodes, sc.jobs, cfg, window_s=bf.window_s, heroes=sc.heroes, on_day=on_day)
        res = sim.run()
        wall = time.perf_counter() - t
        rep = summarise(res, sc.tree, name, a.seed, wall_s=wall)
        bg = [r.mean_deficit_pp for r in rep.budgets if r.path.startswith("bg/") and r.mean_deficit_pp is not None]
        pairs = backlogged_pairs(res.samples, res.start_us, sc.tree)
        bg_pairs = [d for _t, _leaf, d in pairs]
        per_budget = deficit_by_budget(pairs)
        rows = hero_rows(res, sc, sim.gathering_idle_gpu_s, gpus, sim._saved, sim.restarts, sim.running_us, sim.heads_s)
        daily = deficit_by_day(res, sc, gpus)
        doc = {
            "policy": name,
            "wall_s": round(wall, 1),
            "utilisation": round(rep.utilisation, 4),
            "goodput": round(rep.goodput, 4),
            "bg_deficit_pp": round(sum(bg_pairs) / len(bg_pairs), 2) if bg_pairs else 0.0,
            "bg_backlogged_pairs": len(bg_pairs),
            "bg_mean_of_budget_means_pp": round(sum(bg) / len(bg), 2) if bg else 0.0,
            "bg_deficit_sum_pp": round(sum(bg_pairs), 1),
            "bg_by_budget": per_budget,
            "bg_pairs": [(round((t - sc.start_us) / 86_400e6, 3), leaf, round(d, 3)) for t, leaf, d in pairs],
            "mean_deficit_pp": round(rep.mean_deficit_pp, 2),
            "violations": rep.violations,
            "budgets": {r.path: r.mean_deficit_pp for r in rep.budgets},
            "heroes": [dataclasses.asdict(r) for r in rows],
            "by_day": daily,
        }
        out.append(doc)
        print(
            f"{name}: wall {wall:.0f} s, utilisation {rep.utilisation:.3f}, goodput {rep.goodput:.3f}, "
            f"background deficit {doc['bg_deficit_pp']} pp over {len(bg_pairs)} backlogged (sample, budget) pairs "
            f"(mean of the budgets' means {doc['bg_mean_of_budget_means_pp']} pp), violations {rep.violations}",
            flush=True,
        )
        for r in rows:
            print(
                f"  {r.job_id} {r.gpus} GPUs covers={r.budget_covers} start_h={_f(r.start_h)} "
                f"running_h={_f(r.running_h)} "
                f"gather_idle_gpu_h={_f(r.gathering_idle_gpu_h)} ({_f(r.gathering_idle_pct_first_day)}% of day 1) "
                f"preemptions={r.preemptions} lost_gpu_h={r.lost_gpu_h:.0f} "
                f"max_lost_per_preemption_h={r.max_lost_per_preemption_h:.2f} completion_d={_f(r.completion_d)} "
                f"progress={r.progress_pct:.0f}% start_d={_f(r.start_d)} stops_d={[round(d, 2) for d in r.stops_d]} "
                f"restart_h/protection_in_force_h={[(_f(w), _f(p)) for w, p in r.restarts_h]} "
                f"head_h/restart_from_head_h/protection_at_head_h={[tuple(_f(x) for x in h) for h in r.heads_h]}",
                flush=True,
            )
        for leaf, b in per_budget.items():
            print(
                f"  {leaf}: {b['pairs']} backlogged pairs, {b['behind']} behind, deficit sum {b['sum_pp']} pp, "
                f"mean {b['mean_pp']} pp",
                flush=True,
            )
        for d in daily:
            print(
                f"  day {d['day']}: background deficit {d['bg_deficit_pp']} pp over {d['bg_backlogged']} "
                f"backlogged (sample, budget) pairs, behind {d['behind']}, hero GPUs {d['hero_gpus']}, "
                f"background GPUs {d['bg_gpus']}",
                flush=True,
            )
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
    return out


def _progress_writer(path: str, policy: str, sc: Any, gpus: int) -> Any:
    """An ``on_day`` of :class:`HeroSimulator` that appends one JSON line a simulated day to ``path``: the hero
    rows and the background deficit so far (a long run cut short still tells how far it got)."""

    def write(sim: HeroSimulator, t: int) -> None:
        res = types.SimpleNamespace(jobs_ledger=sim.jobs_ledger)
        rows = hero_rows(res, sc, sim.gathering_idle_gpu_s, gpus, sim._saved, sim.restarts, sim.running_us, sim.heads_s)  # type: ignore[arg-type]
        triples = backlogged_pairs(sim.samples, sc.start_us, sc.tree)
        pairs = [d for _t, _leaf, d in triples]
        means = [b["mean_pp"] for b in deficit_by_budget(triples).values()]
        doc = {
            "policy": policy,
            "day": round((t - sc.start_us) / 86_400e6, 2),
            "bg_deficit_pp": round(sum(pairs) / len(pairs), 2) if pairs else 0.0,
            "bg_backlogged_pairs": len(pairs),
            "bg_deficit_sum_pp": round(sum(pairs), 1),
            "bg_budgets_backlogged_mean_pp": round(sum(means) / len(means), 2) if means else 0.0,
            "heroes": [dataclasses.asdict(r) for r in rows],
        }
        with open(path, "a") as f:
            f.write(json.dumps(doc) + "\n")

    return write


def _explaining(path: str, ecfg: EngineConfig, sc: Any) -> type[HeroSimulator]:
    """A :class:`HeroSimulator` that, at each sample where a background budget with allocated work waiting is
    behind its share, appends to ``path`` one JSON line per waiting allocated job of it: why it waits (the
    policy's cycle run again at the sample with ``explain=True``, :mod:`apportion.domain.engine.reasons`), and
    the victims (budget, replicas, GPUs, hours since placed) with which the same cycle places it with the gang
    rule's last resort and with the rule off (``null``: not placed). Decisions are the run's own."""
    variants = {
        "last_resort": dataclasses.replace(ecfg, gang_last_resort=True),
        "gangs_off": dataclasses.replace(ecfg, gang_rule=False),
    }

    class Explaining(HeroSimulator):
        def _sample(self, t: int) -> None:
            super()._sample(t)
            row = self.samples[-1][1]
            behind = sorted(
                leaf
                for leaf, v in row.items()
                if leaf.startswith("bg/") and v[3] and share_deficit_pp(sc.tree.abs_share(leaf), v[0]) > 0
            )
            if not behind:
                return
            snap = self.state.cycle_snapshot(t)
            res = run_cycle(snap, t, ecfg, explain=True)
            placed = {k: run_cycle(self.state.cycle_snapshot(t), t, c).events for k, c in variants.items()}
            runs = self.state.cluster.runs
            with open(path, "a") as f:
                for leaf in behind:
                    for j in (j for j in snap.pending.get(leaf, ()) if j.allocated):
                        doc: dict[str, Any] = {
                            "day": round((t - sc.start_us) / 86_400e6, 3),
                            "leaf": leaf,
                            "deficit_pp": round(share_deficit_pp(sc.tree.abs_share(leaf), row[leaf][0]), 2),
                            "job": j.job_id,
                            "shape": [j.gpus_per_replica, j.replicas],
                            "waited_h": round((t - j.queued_at_us) / 3600e6, 2),
                            "reason": getattr(res.reasons.get(j.job_id), "kind", None),
                        }
                        for k, events in placed.items():
                            got = next((e for e in events if type(e) is JobPlaced and e.job_id == j.job_id), None)
                            doc[k] = None if got is None else [_victim(runs, v, t) for v in got.decision.victims]
                        f.write(json.dumps(doc) + "\n")

    return Explaining


def _tracing(base: type[HeroSimulator], path: str, ecfg: EngineConfig | None, sc: Any) -> type[HeroSimulator]:
    """A ``base`` that, at each sample while a hero job waits for its first placement, appends to ``path`` one
    JSON line: the nodes by what holds them for it (``hero``: a hero run; ``grown``: a background run within a
    protection grown past its minimum runtime; ``min``: within its minimum runtime; ``free``: every run there may
    go, as to protection), nodes holding a protected run by that run's ``(preemptions before, protection h)``,
    the hours until the hero's k-th node, in order of the end of its background runs' protections, is free of
    protection (``kth_end_h``), and under ours (``ecfg``; ``None``: a peer) the cycle's reservation (holder, nodes,
    those with a hero run). Decisions are the run's own (the reservation from the cycle run again on a copy of
    the state)."""
    heroes = frozenset(sc.heroes)
    replicas = {j.job_id: j.replicas for j in sc.jobs if j.job_id in heroes}

    class Tracing(base):  # type: ignore[valid-type, misc]
        def _sample(self, t: int) -> None:
            super()._sample(t)
            ledger = self.jobs_ledger
            waiting = [j for j in sorted(heroes) if j in ledger.submitted and j not in ledger.first_placed]
            if not waiting:
                return
            cl = self.state.cluster
            cls: dict[str, str] = {}
            end: dict[str, int] = {}
            held: dict[str, int] = {}
            rank = {"free": 0, "min": 1, "grown": 2, "hero": 3}
            for nid in cl.nodes:
                c, e = "free", t
                for key in cl.node_runs.get(nid, ()):
                    r = cl.runs.get(key)
                    if r is None or r.stopping or not r.allocated:
                        continue
                    if r.job_id in heroes:
                        c, e = "hero", UNTIL_STARTED
                        break
                    if r.protected(t):
                        grown = r.protection_us is not None and r.protection_us > r.min_runtime_us
                        k = "grown" if grown else "min"
                        c = k if rank[k] > rank[c] else c
                        e = max(e, protection_end_us(r))
                        tag = f"{r.preemptions}, {(r.protection_us or r.min_runtime_us) / 3600e6:.1f}"
                        held[tag] = held.get(tag, 0) + 1
                cls[nid], end[nid] = c, e
            ends = sorted(x for x in end.values() if x < UNTIL_STARTED)
            res = None if ecfg is None else run_cycle(self.state.cycle_snapshot(t), t, ecfg).reservation
            doc: dict[str, Any] = {
                "day": round((t - sc.start_us) / 86_400e6, 3),
                "waiting": waiting,
                "nodes": {c: sum(1 for x in cls.values() if x == c) for c in rank},
                "protected_by_preemptions_h": dict(sorted(held.items())),
                "kth_end_h": {
                    j: round((ends[replicas[j] - 1] - t) / 3600e6, 2) if len(ends) >= replicas[j] else None
                    for j in waiting
                },
                "reservation": None
                if res is None
                else [res[0], len(res[1]), sum(1 for n in res[1] if cls.get(n) == "hero")],
            }
            with open(path, "a") as f:
                f.write(json.dumps(doc) + "\n")

    return Tracing


def _victim(runs: Any, v: Any, t: int) -> list[Any]:
    run = runs.get((v.job_id, v.attempt))
    if run is None:
        return [v.budget]
    return [v.budget, run.replicas, run.gpus, round((t - run.placed_at_us) / 3600e6, 1)]


def offered_demand(sc: Any, gpus: int) -> float:
    """The background's GPU-hours submitted within the horizon over the cluster's GPU-hours of the horizon."""
    bg = set(sc.heroes)
    work = sum(j.gpus_per_replica * j.replicas * j.duration_s for j in sc.jobs if j.job_id not in bg)
    return work / (gpus * (sc.until_us - sc.start_us) / 1e6)


def deficit_by_day(res: Any, sc: Any, gpus: int) -> list[dict[str, Any]]:
    """Per simulated day: the background budgets' mean share deficit over the (sample, budget) pairs with
    allocated work waiting (the report's definition), the budgets behind (mean deficit pp over their
    backlogged samples), and the mean GPUs running for the hero and background budgets."""
    days: dict[int, dict[str, Any]] = {}
    for t, row in res.samples:
        d = days.setdefault(int((t - sc.start_us) // 86_400_000_000), {"defs": {}, "hero": [], "bg": []})
        d["hero"].append(sum(v[1] for leaf, v in row.items() if leaf.startswith("hero/")))
        d["bg"].append(sum(v[1] for leaf, v in row.items() if leaf.startswith("bg/")))
        for leaf, (share_now, _running, _pending, pending_alloc) in row.items():
            if leaf.startswith("bg/") and pending_alloc:
                deficit = share_deficit_pp(sc.tree.abs_share(leaf), share_now)
                d["defs"].setdefault(leaf, []).append(deficit)
    out = []
    for day, d in sorted(days.items()):
        pairs = [x for v in d["defs"].values() for x in v]
        behind = {leaf: round(sum(v) / len(v), 2) for leaf, v in d["defs"].items() if sum(v) > 0}
        out.append(
            {
                "day": day,
                "bg_deficit_pp": round(sum(pairs) / len(pairs), 2) if pairs else 0.0,
                "bg_backlogged": len(pairs),
                "behind": behind,
                "hero_gpus": round(sum(d["hero"]) / len(d["hero"])),
                "bg_gpus": round(sum(d["bg"]) / len(d["bg"])),
            }
        )
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="default: <data dir>/philly/philly.csv (APPORTION_DATA_DIR)")
    ap.add_argument("--slice", default="week44")
    ap.add_argument("--days", type=float, default=21.0)
    ap.add_argument("--size", type=int, default=16, help="each background job's GPUs multiplied by this")
    ap.add_argument("--load", type=float, default=1.0, help="the background's arrivals multiplied by this (>= 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--bg-min-runtime-h",
        type=float,
        default=None,
        help="each allocated background job's minimum runtime min(duration, H hours) (default: the budget file's 2 h)",
    )
    ap.add_argument("--policy", default="fairshare,slurm,kueue,kai,fifo")
    ap.add_argument("--no-heroes", action="store_true")
    ap.add_argument("--hero-days", default=None, help="submission days of hero-a,b,c (default 2,3,4)")
    ap.add_argument("--hero-shares", default=None, help="absolute shares of hero-a,b,c (default 0.10,0.30,0.10)")
    ap.add_argument(
        "--hero-min-gpus",
        default=str(HERO_MIN_GPUS),
        help="EngineConfig.hero_min_gpus (rule D3.hero-cover), 'none': the rule off",
    )
    ap.add_argument(
        "--gang-min-gpus", type=int, default=None, help="EngineConfig.gang_min_gpus (D3.gangs), 0: every gang"
    )
    ap.add_argument("--gang-bound-x", type=float, default=None, help="EngineConfig.gang_bound_x (D3.gangs), 0: the cap")
    ap.add_argument(
        "--gang-last-resort",
        action="store_true",
        help="EngineConfig.gang_last_resort (D3.gangs): a gang the rule spares is a victim when no feasible "
        "set without one exists",
    )
    ap.add_argument(
        "--gang-last-resort-over-share",
        action="store_true",
        help="EngineConfig.gang_last_resort_over_share (with --gang-last-resort): the last resort takes only the "
        "gangs of a budget over its share",
    )
    ap.add_argument(
        "--grow-over-share",
        action=argparse.BooleanOptionalAction,
        default=PROTECTION_GROW_OVER_SHARE,
        help="EngineConfig.grow_over_share (D3.bounded-churn); --grow-over-share grows every job's protection "
        "(policies up to fairtree-9), the default only jobs at or under their share",
    )
    ap.add_argument(
        "--hero-reserve-takable",
        action="store_true",
        help="EngineConfig.hero_reserve_takable (D3.hero-cover): a covered hero reserves only nodes it may take back",
    )
    ap.add_argument(
        "--hero-waits",
        action="store_true",
        help="EngineConfig.hero_waits (D3.hero-waits): a covered hero never preempts another covered hero within its "
        "share; it waits, reserving the nodes that fit it soonest",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--progress", default=None, help="append a JSON line a simulated day: the figures so far")
    ap.add_argument(
        "--explain-waits",
        default=None,
        help="append a JSON line per waiting allocated job of a background budget behind its share at each "
        "sample: why it waits, and how the gang rule's last resort or the rule off would place it",
    )
    ap.add_argument(
        "--trace-gather",
        default=None,
        help="append a JSON line per sample while a hero waits for its first placement: the nodes by what holds "
        "them (heroes, protected background runs, free to take), the hours until its k-th node is free of "
        "protection, and the cycle's reservation",
    )
    run(ap.parse_args())


if __name__ == "__main__":
    main()
