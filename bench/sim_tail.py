"""Where the tail comes from: per-job figures of one simulated policy, and a comparison of two.

Usage (traces from ``$APPORTION_DATA_DIR``, else ``../shared/data`` beside the checkout)::

    .venv/bin/python bench/sim_tail.py run philly week44 fairshare OUT.json [--seed N] [--tail-h H] [--churn-bound N]
        [--free-order 0|1] [--progress-after N]
        [--at-share-bound N] [--owner-free 0|1]
    .venv/bin/python bench/sim_tail.py run itp week5 slurm OUT.json [--budgets infra/budgets/itp-hetero.yaml]
    .venv/bin/python bench/sim_tail.py compare FAIR.json PEER.json

``run`` simulates one policy as ``apportion simulate`` does (same defaults; ``--churn-bound N`` sets
``EngineConfig.churn_bound``, 0 = none; ``--free-order`` sets ``EngineConfig.free_order``, ``--progress-after N``
``EngineConfig.progress_after``, ``--at-share-bound N`` ``EngineConfig.at_share_bound``, 0 = off, ``--owner-free`` ``EngineConfig.owner_free``), writes the policy's report (the ``--json`` document) beside OUT
(``.json`` replaced by ``.report.json``) and one row per job to OUT: budget, allocated, shape g x k, duration,
submit, first placement, completion (µs; null when not reached) and preemptions. ``compare`` reads two such
files of the same slice and seed and prints, for the first policy against the second: the jobs that make the JCT tail (completion time above the first policy's p95)
and the never-placed jobs, by GPUs asked for (1, 2-4, 5-8, gangs of 16 and more), by budget, and by the
preemptions they suffered, with the same jobs' figures under the second policy; then the allocated waits
above the first policy's p95 by size and budget. Not part of ``make bench`` (a study, not a target).
"""

from __future__ import annotations

import collections
import json
import sys
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
    from apportion.cli.simulate import _run
    from apportion.domain.cluster import PROTECTION_CHURN_BOUND
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
    core.Simulator.run = keep  # type: ignore[method-assign]  # the study keeps the result _run drops
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
            owner_free=_opt(argv, "--owner-free", "0") != "0",
        )
    finally:
        core.Simulator.run = orig  # type: ignore[method-assign]
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


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "compare"):
        print(__doc__)
        return 2
    return run(argv[1:]) if argv[0] == "run" else compare(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
