"""Where the tail comes from: per-job figures of one simulated policy, and a comparison of two.

Usage (traces from ``$APPORTION_DATA_DIR``, else ``../shared/data`` beside the checkout)::

    .venv/bin/python bench/sim_tail.py run philly week44 fairshare OUT.json [--seed N] [--tail-h H] [--churn-bound N]
        [--free-order 0|1] [--free-las 0|1] [--progress-after N]
        [--at-share-bound N] [--grow-over-share 0|1] [--owner-free 0|1] [--gang-wait-h H] [--gang-min-gpus N]
        [--gang-bound-x X] [--cover-min-gpus N] [--free-las-queue-gpu-s S] [--free-starve-x K]
        [--free-starve-h T] [--free-las-levels-gpu-h A,B,...] [--age-first-h H]
        [--age-first-gangs 0|1] [--age-weight W] [--age-max-h H]
        [--age-floor-r F] [--runs RUNS.json]
    .venv/bin/python bench/sim_tail.py run itp week5 slurm OUT.json [--budgets infra/budgets/itp-hetero.yaml]
        [--slurm-simplified]
    .venv/bin/python bench/sim_tail.py compare FAIR.json PEER.json
    .venv/bin/python bench/sim_tail.py decompose FAIR.json PEER.json    (both run with --runs OUT.runs.json)

``run`` simulates one policy as ``apportion simulate`` does (same defaults; ``--churn-bound N`` sets
``EngineConfig.churn_bound``, 0 = none; ``--free-order`` sets ``EngineConfig.free_order``, ``--free-las``
``EngineConfig.free_las`` (default 1, the policy's), ``--progress-after N``
``EngineConfig.progress_after``, ``--at-share-bound N`` ``EngineConfig.at_share_bound``, 0 = off, ``--grow-over-share 1``
``EngineConfig.grow_over_share`` True (default 0, the policy's), ``--owner-free`` ``EngineConfig.owner_free``,
``--gang-wait-h H`` ``EngineConfig.gang_wait_s`` in hours, ``--gang-min-gpus N`` ``EngineConfig.gang_min_gpus``,
``--gang-bound-x X`` ``EngineConfig.gang_bound_x``, 0 = none for both; ``--cover-min-gpus N``
``EngineConfig.cover_min_gpus``; ``--free-las-queue-gpu-s S`` ``EngineConfig.free_las_queue_gpu_s``, 0 = off;
``--free-starve-x K`` ``EngineConfig.free_starve_x``, ``--free-starve-h T`` ``EngineConfig.free_starve_s`` in hours,
``--free-las-levels-gpu-h A,B,...`` ``EngineConfig.free_las_levels_gpu_s`` in GPU-hours (rule D3.free-starve);
``--age-first-h H`` ``EngineConfig.age_first_s`` in hours, ``--age-first-gangs 1`` ``EngineConfig.age_first_gangs``;
``--age-weight W`` ``EngineConfig.age_weight``, ``--age-max-h H`` ``EngineConfig.age_max_s`` in hours (default 168),
``--age-floor-r F`` ``EngineConfig.age_floor_r``;
``--slurm-simplified``: policy ``slurm`` is the simplified peer,
``SlurmConfig(backfill_reserve=False)``), writes the policy's report (the ``--json`` document) beside OUT
(``.json`` replaced by ``.report.json``) and one row per job to OUT: budget, allocated, shape g x k, duration,
submit, first placement, completion (µs; null when not reached) and preemptions. ``compare`` reads two such
files of the same slice and seed and prints, for the first policy against the second: the jobs that make the JCT tail (completion time above the first policy's p95)
and the never-placed jobs, by GPUs asked for (1, 2-4, 5-8, gangs of 16 and more), by budget, and by the
preemptions they suffered, with the same jobs' figures under the second policy; then the allocated waits
above the first policy's p95 by size and budget. ``--runs R.json`` also writes one row per run (attempt): its
budget, GPUs, placement and end (µs), how it ended, the budget's r when placed, whether it held the reservation,
its protection, the work its preemption lost. ``decompose`` reads two runs files (OUT with ``.json`` replaced by
``.runs.json``) and prints where each policy's GPU-hours went (allocated and free runs by how they ended, work
lost, protected runs, re-runs, reservation holders), the jobs completed and never placed of each class, and, at
the moments the second policy started the free jobs it completed and the first never placed, the GPUs the first
held by class of run and by budget. Not part of ``make bench`` (a study, not a target).
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = {
    "philly": ("philly/philly.csv", "infra/budgets/philly.yaml"),
    "itp": ("itp/itp.csv", "infra/budgets/itp.yaml"),
}
H = 3600e6


def _opt(argv: list[str], name: str, default: str | None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def run(argv: list[str]) -> int:
    """Simulate one policy on a slice and write the per-job rows."""
    import apportion.sim.core as core
    from apportion.cli.simulate import _run, gang_scope
    from apportion.domain.cluster import PROTECTION_CHURN_BOUND, PROTECTION_GROW_OVER_SHARE
    from apportion.sim.traces import load_budget_file, load_trace

    trace, slice_, policy, out = argv[:4]
    seed = int(_opt(argv, "--seed", "1") or 1)
    tail = _opt(argv, "--tail-h", None)
    from apportion.settings import default_data_dir

    path, budgets = TRACES[trace]
    bf = load_budget_file(ROOT / (_opt(argv, "--budgets", budgets) or budgets))
    jobs = load_trace(default_data_dir() / path, bf, seed, slice_)
    kept: list[Any] = []
    orig = core.Simulator.run

    def keep(self: Any) -> Any:
        res = orig(self)
        kept.append(res)
        return res

    churn = _opt(argv, "--churn-bound", None)
    runs_out = _opt(argv, "--runs", None)
    gang_wait = _opt(argv, "--gang-wait-h", None)
    cover = _opt(argv, "--cover-min-gpus", None)
    las_queue = float(_opt(argv, "--free-las-queue-gpu-s", "0") or 0)
    starve_x, starve_h = _opt(argv, "--free-starve-x", None), _opt(argv, "--free-starve-h", None)
    levels = _opt(argv, "--free-las-levels-gpu-h", None)
    age_first = _opt(argv, "--age-first-h", None)
    age_weight = _opt(argv, "--age-weight", None)
    age_floor = _opt(argv, "--age-floor-r", None)
    least, times = _opt(argv, "--gang-min-gpus", None), _opt(argv, "--gang-bound-x", None)
    scope = gang_scope(None if least is None else int(least), None if times is None else float(times))
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    ledger_apply = core.JobLedger.apply
    if runs_out is not None:
        core.JobLedger.apply = _recorder(ledger_apply, runs)  # type: ignore[method-assign]
    core.Simulator.run = keep  # type: ignore[method-assign]  # the study keeps the result _run drops
    from apportion.sim.baselines import POLICIES
    from apportion.sim.peers.slurm import Slurm, SlurmConfig

    slurm = POLICIES["slurm"]
    if "--slurm-simplified" in argv:
        POLICIES["slurm"] = Slurm(SlurmConfig(backfill_reserve=False))
    try:
        rep = _run(
            policy,
            bf,
            jobs,
            seed,
            300.0,
            None if tail is None else float(tail),
            churn_bound=PROTECTION_CHURN_BOUND if churn is None else int(churn) or None,
            free_order=_opt(argv, "--free-order", "0") != "0",
            progress_after=int(_opt(argv, "--progress-after", "0") or 0) or None,
            at_share_bound=int(_opt(argv, "--at-share-bound", "0") or 0) or None,
            knobs={
                "owner_free": _opt(argv, "--owner-free", "0") != "0",
                "free_las": _opt(argv, "--free-las", "1") != "0",
                "grow_over_share": _opt(argv, "--grow-over-share", "1" if PROTECTION_GROW_OVER_SHARE else "0") != "0",
                "gang_wait_s": None if gang_wait is None else float(gang_wait) * 3600,
                "cover_min_gpus": None if cover is None else int(cover),
                "free_las_queue_gpu_s": las_queue or None,
                "free_starve_x": None if starve_x is None else float(starve_x),
                "free_starve_s": None if starve_h is None else float(starve_h) * 3600,
                "free_las_levels_gpu_s": None
                if levels is None
                else tuple(sorted(float(v) * 3600 for v in levels.split(","))),
                "age_first_s": None if age_first is None else float(age_first) * 3600,
                "age_first_gangs": _opt(argv, "--age-first-gangs", "0") != "0",
                "age_weight": None if age_weight is None else float(age_weight),
                "age_max_s": float(_opt(argv, "--age-max-h", "168") or 168) * 3600,
                "age_floor_r": None if age_floor is None else float(age_floor),
                **scope,
            },
        )
    finally:
        POLICIES["slurm"] = slurm
        core.Simulator.run = orig  # type: ignore[method-assign]
        core.JobLedger.apply = ledger_apply  # type: ignore[method-assign]
    if runs_out is not None:
        Path(runs_out).write_text(json.dumps(list(runs.values())))
    led = kept[0].jobs_ledger
    rows = [
        {
            "id": j.job_id,
            "budget": j.budget,
            "alloc": j.min_runtime_s > 0,
            "g": j.gpus_per_replica,
            "k": j.replicas,
            "dur_h": j.duration_s / 3600,
            "submit": j.submit_us,
            "placed": led.first_placed.get(j.job_id),
            "done": led.completed.get(j.job_id),
            "preempted": led.preempted.get(j.job_id, 0),
        }
        for j in jobs
    ]
    Path(out).write_text(
        json.dumps({"policy": policy, "slice": slice_, "seed": seed, "end": kept[0].end_us, "jobs": rows})
    )
    from apportion.sim.report import to_json

    Path(out.removesuffix(".json") + ".report.json").write_text(to_json([rep]))
    d = rep.__dict__
    print(
        f"{policy} {slice_} seed {seed}: completed {d['completed']}, jct p95 {d['jct_p95_s'] / 3600:.1f} h, "
        f"wall {d['wall_s']:.0f} s -> {out}"
    )
    return 0


def _recorder(apply: Any, runs: dict[tuple[str, int], dict[str, Any]]) -> Any:
    """Wrap ``JobLedger.apply`` so that every run's span, size, budget, r at placement and end are kept."""
    from apportion.events import JobCompleted, JobPlaced, JobPreempted, JobRequeued
    from apportion.timeutil import to_us

    def rec(self: Any, ev: Any) -> Any:
        t = type(ev)
        if t is JobPlaced:
            d = ev.decision
            runs[(ev.job_id, ev.attempt)] = {
                "id": ev.job_id,
                "att": ev.attempt,
                "budget": ev.budget,
                "alloc": ev.allocated,
                "gpus": ev.gpus_per_replica * ev.replicas,
                "placed": to_us(ev.ts),
                "end": None,
                "how": None,
                "r": d.ratio,
                "resv": d.reservation,
                "prot_s": d.protection_s,
                "pre": d.preemptions or 0,
                "lost": 0.0,
                "by": None,
                "victims": len(d.victims),
            }
        elif t is JobPreempted:
            r = runs.get((ev.job_id, ev.attempt))
            if r is not None:
                r["how"] = "preempted"
                r["lost"] = ev.lost_gpu_s or 0.0
                r["by"] = ev.by_budget
        elif t is JobRequeued or t is JobCompleted:
            # (a requeue names the attempt the job waits as: the run it ends is the one before)
            r = runs.get((ev.job_id, ev.attempt - 1 if t is JobRequeued else ev.attempt))
            if r is not None:
                r["end"] = max(r["end"] or 0, to_us(ev.ts))
                if t is JobCompleted:
                    r["how"] = "done"
                elif r["how"] is None:
                    r["how"] = ev.reason
        return apply(self, ev)

    return rec


def _size(r: dict[str, Any]) -> str:
    n = r["g"] * r["k"]
    return "1" if n == 1 else "2-4" if n <= 4 else "5-8" if n <= 8 else "16+"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))] if xs else 0.0


def _table(title: str, sel: list[dict[str, Any]], peer: dict[str, dict[str, Any]], key: Any) -> None:
    groups: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in sel:
        groups[key(r)].append(r)
    print(
        f"  {title}: group, jobs, GPU-h of work, mean duration h, mean wait h, preempted jobs, peer mean wait h, "
        "peer done"
    )
    for g, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        waits = [((r["placed"] or r["end"]) - r["submit"]) / H for r in rs]
        pw = [((peer[r["id"]]["placed"] or peer[r["id"]]["end"]) - r["submit"]) / H for r in rs]
        print(
            f"    {g:>24} {len(rs):6d} {sum(r['g'] * r['k'] * r['dur_h'] for r in rs):9.0f} "
            f"{sum(r['dur_h'] for r in rs) / len(rs):6.1f} {sum(waits) / len(rs):7.1f} "
            f"{sum(1 for r in rs if r['preempted']):5d} {sum(pw) / len(rs):7.1f} "
            f"{sum(1 for r in rs if peer[r['id']]['done']):6d}"
        )


def compare(argv: list[str]) -> int:
    """Print where the first policy's tail and never-placed jobs come from, against the second's."""
    a, b = (json.loads(Path(p).read_text()) for p in argv[:2])
    for doc in (a, b):
        for r in doc["jobs"]:
            r["end"] = doc["end"]
    peer = {r["id"]: r for r in b["jobs"]}
    jobs = a["jobs"]
    print(f"{a['policy']} against {b['policy']}, {a['slice']} seed {a['seed']}: {len(jobs)} jobs")
    for doc in (a, b):
        jct = [(r["done"] - r["submit"]) / H for r in doc["jobs"] if r["done"]]
        aw = [((r["placed"]) - r["submit"]) / H for r in doc["jobs"] if r["placed"] and r["alloc"]]
        print(
            f"  {doc['policy']}: completed {len(jct)}, never placed {sum(1 for r in doc['jobs'] if not r['placed'])}, "
            f"JCT p95 {_pct(jct, 0.95):.1f} h, allocated wait p95 {_pct(aw, 0.95):.1f} h"
        )
    jct = [(r["done"] - r["submit"]) / H for r in jobs if r["done"]]
    p95 = _pct(jct, 0.95)
    tail = [r for r in jobs if r["done"] and (r["done"] - r["submit"]) / H > p95]
    never = [r for r in jobs if not r["placed"]]
    for title, sel in (("JCT tail (above p95)", tail), ("never placed", never)):
        print(f"{title}: {len(sel)} jobs")
        _table("by GPUs asked", sel, peer, _size)
        _table("by allocated", sel, peer, lambda r: "allocated" if r["alloc"] else "unallocated")
        _table("by budget", sel, peer, lambda r: r["budget"].rsplit("/", 1)[-1])
        _table("by preemptions", sel, peer, lambda r: str(min(r["preempted"], 5)))
    aw = [((r["placed"]) - r["submit"]) / H for r in jobs if r["placed"] and r["alloc"]]
    w95 = _pct(aw, 0.95)
    late = [r for r in jobs if r["alloc"] and r["placed"] and (r["placed"] - r["submit"]) / H > w95]
    print(f"allocated waits above p95 ({w95:.1f} h): {len(late)} jobs")
    _table("by GPUs asked", late, peer, _size)
    _table("by budget", late, peer, lambda r: r["budget"].rsplit("/", 1)[-1])
    return 0


def _held(rows: list[dict[str, Any]], end: int) -> dict[str, float]:
    """GPU-hours of runs by class: allocated or not, how the run ended (completed, preempted, open at the end)."""
    out: dict[str, float] = collections.defaultdict(float)
    for r in rows:
        span = ((r["end"] or end) - r["placed"]) / H * r["gpus"]
        cls = "alloc" if r["alloc"] else "unalloc"
        how = "done" if r["how"] == "done" else "preempted" if r["how"] == "preempted" else "open"
        out[f"{cls} {how}"] += span
        out[f"{cls} held"] += span
        out[f"{cls} lost"] += r["lost"] / 3600
        if r["alloc"] and r["prot_s"] is not None:
            out["alloc protected"] += min(span, r["gpus"] * r["prot_s"] / 3600)
        if r["alloc"] and r["att"] > 1:
            out["alloc re-runs"] += span
        if r["resv"]:
            out["alloc reservation holders"] += span
    return out


def _run_class(r: dict[str, Any]) -> str:
    """A run's class: unallocated; allocated of a budget at r <= 1 or above when placed, first run or re-run."""
    if not r["alloc"]:
        return "unalloc"
    return ("alloc r<=1" if r["r"] <= 1 else "alloc r>1") + (" re-run" if r["att"] > 1 else "")


def _run_budget(r: dict[str, Any]) -> str:
    """A run's leaf budget when allocated; unallocated runs together."""
    return r["budget"].rsplit("/", 1)[-1] if r["alloc"] else "(unallocated)"


def _mean_held(
    rows: list[dict[str, Any]], times: list[int], end: int, key: Callable[[dict[str, Any]], str]
) -> dict[str, float]:
    """Mean GPUs held at ``times`` by the runs of each ``key`` (a run still running holds its GPUs to ``end``)."""
    ev = sorted(
        [(r["placed"], r["gpus"], key(r)) for r in rows] + [(r["end"] or end, -r["gpus"], key(r)) for r in rows]
    )
    cur: dict[str, int] = collections.defaultdict(int)
    acc: dict[str, float] = collections.defaultdict(float)
    i = 0
    for t in sorted(times):
        while i < len(ev) and ev[i][0] <= t:
            cur[ev[i][2]] += ev[i][1]
            i += 1
        for k, v in cur.items():
            acc[k] += v
    return {k: v / max(1, len(times)) for k, v in sorted(acc.items())}


def decompose(argv: list[str]) -> int:
    """Where the GPU-hours went under two policies (``run ... --runs``): the completed-jobs gap by component."""
    a, b = (json.loads(Path(p).read_text()) for p in argv[:2])
    ra, rb = (json.loads(Path(p.removesuffix(".json") + ".runs.json").read_text()) for p in argv[:2])
    span = (a["end"] - min(r["submit"] for r in a["jobs"])) / H
    print(f"{a['policy']} against {b['policy']}, {a['slice']} seed {a['seed']}: span {span:.1f} h")
    ha, hb = _held(ra, a["end"]), _held(rb, b["end"])
    for k in sorted(set(ha) | set(hb)):
        print(f"  {k:>28}: {ha.get(k, 0):10.0f} {hb.get(k, 0):10.0f}  diff {ha.get(k, 0) - hb.get(k, 0):+10.0f} GPU-h")
    for doc in (a, b):
        for cls in (True, False):
            rs = [r for r in doc["jobs"] if r["alloc"] is cls]
            done = [r for r in rs if r["done"]]
            print(
                f"  {doc['policy']} {'allocated' if cls else 'unallocated'}: jobs {len(rs)}, completed {len(done)} "
                f"({sum(r['g'] * r['k'] * r['dur_h'] for r in done):.0f} GPU-h of work), never placed "
                f"{sum(1 for r in rs if not r['placed'])}"
            )
    mine = {r["id"]: r for r in a["jobs"]}
    miss = [r for r in b["jobs"] if not r["alloc"] and r["done"] and not mine[r["id"]]["placed"]]
    times = [r["placed"] for r in miss]
    print(f"  unallocated jobs {b['policy']} completed and {a['policy']} never placed: {len(miss)}")
    print(f"    mean GPUs held at their start under {b['policy']}, by class of run: {a['policy']} / {b['policy']}")
    ca, cb = _mean_held(ra, times, a["end"], _run_class), _mean_held(rb, times, b["end"], _run_class)
    for k in sorted(set(ca) | set(cb)):
        print(f"    {k:>20}: {ca.get(k, 0):7.1f} {cb.get(k, 0):7.1f}")
    by: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for rows, j in ((ra, 0), (rb, 1)):
        held = _mean_held(rows, times, a["end"] if j == 0 else b["end"], _run_budget)
        for k, v in held.items():
            by[k][j] = v
    print("    allocated GPUs held at those times by budget: " + a["policy"] + " / " + b["policy"])
    for k, (x, y) in sorted(by.items(), key=lambda kv: -abs(kv[1][0] - kv[1][1]))[:12]:
        print(f"    {k:>20}: {x:7.1f} {y:7.1f}")
    return 0


def main(argv: list[str]) -> int:
    cmds = {"run": run, "compare": compare, "decompose": decompose}
    if not argv or argv[0] not in cmds:
        print(__doc__)
        return 2
    return cmds[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
