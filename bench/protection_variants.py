"""Fair share on a Philly slice under protection-growth variants (evidence for rule D3.bounded-churn).

Usage::

    .venv/bin/python bench/protection_variants.py week44 double flat linear double_cap4 double_cap8
    .venv/bin/python bench/protection_variants.py weeks39-45 double double,dbl=-1 grow4 double,w=0.5 double,ckpt=0

Variants of ``cluster.protection_s`` (swapped in for the run; everything else as on main): ``double`` (in
force: min_runtime x 2**p for the first ``protection_doublings`` preemptions, then the cap: max_min_runtime and
W x ``protection_cap_w``), ``growN`` (min_runtime x N**p, same caps), ``flat`` (min_runtime), ``linear``
(min_runtime x (1 + p)), ``double_capN`` / ``linear_capN`` (also capped at N x min_runtime). Options after
commas: ``w=F`` sets ``EngineConfig.protection_cap_w`` (default 0.25, W / 4 as in rule D3.bounded-churn; 1 is the
whole window),
``dbl=N`` ``EngineConfig.protection_doublings`` (default 3; -1 doubles to the cap, policy fairtree-4),
``hard=N`` ``EngineConfig.churn_bound`` (a job preempted N times is protected until it completes; default 5,
0 = no bound; ``double,w=1,hard=0`` is policy fairtree-5), ``seed=N`` the seed of the trace rule and of the
simulator (default 1), ``delta=D`` ``EngineConfig.delta`` (hysteresis, default 0.05), ``resv=S``
``EngineConfig.reservation_after_s`` (default 3600), ``gang=0`` turns ``EngineConfig.gang_rule`` off (policy
fairtree-6's decisions), ``ckpt=S`` ``EngineConfig.checkpoint_wait_s`` (default
7200; 0 turns ``checkpoint_rule`` off). Prints goodput, share deficit, work lost, completions, preemptions,
the most preemptions of one allocated and one unallocated job, and the five budgets with the largest part of
the mean deficit. With ``PROTECTION_VARIANTS_SAMPLES=PREFIX`` each run's hourly samples (``Simulator.samples``)
go to ``PREFIX.SPEC.json``. Week 44 runs until every job is done; other slices stop at the last submission.
Not part of ``make bench`` (a study, not a target). The sweeps on weeks 39-45 are in ``docs/simulation.md``.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "philly" / "philly.csv"


def variant(kind: str, orig: Callable[..., float]) -> Callable[..., float]:
    """The protection function named ``kind`` (see the module docstring)."""
    from apportion.events import is_allocated

    def protection(
        min_runtime_s: float,
        preemptions: int,
        max_min_runtime_s: float | None = None,
        window_s: float | None = None,
        window_fraction: float = 1.0,
        doublings: int | None = None,
        churn_bound: int | None = None,
    ) -> float:
        if not is_allocated(min_runtime_s):
            return 0.0
        if kind == "double" or (churn_bound is not None and preemptions >= churn_bound):
            return orig(
                min_runtime_s, preemptions, max_min_runtime_s, window_s, window_fraction, doublings, churn_bound
            )
        if kind == "flat":
            return min_runtime_s
        if kind.startswith("grow"):
            grown = min_runtime_s * float(kind[len("grow") :]) ** min(preemptions, 60)
        elif kind == "linear":
            grown = min_runtime_s * (1 + preemptions)
        elif kind.startswith("double_cap"):
            grown = min(min_runtime_s * 2**preemptions, min_runtime_s * int(kind[len("double_cap") :]))
        elif kind.startswith("linear_cap"):
            grown = min(min_runtime_s * (1 + preemptions), min_runtime_s * int(kind[len("linear_cap") :]))
        else:
            raise SystemExit(f"unknown variant {kind!r}")
        caps = [c for c in (max_min_runtime_s, window_s * window_fraction if window_s else None) if c is not None]
        return max(min_runtime_s, min([grown, *caps]))

    return protection


def main(argv: list[str]) -> int:
    import apportion.domain.cluster as cluster
    import apportion.domain.engine.emit as emit
    import apportion.sim.core as core
    from apportion.cli.simulate import _run
    from apportion.domain.cluster import PROTECTION_CAP_W, PROTECTION_CHURN_BOUND, PROTECTION_DOUBLINGS
    from apportion.domain.engine import CHECKPOINT_WAIT_S
    from apportion.events import JobPreempted
    from apportion.sim.traces import load_budget_file, load_trace

    if len(argv) < 2:
        print(__doc__)
        return 2
    slice_, kinds = argv[0], argv[1:]
    bf = load_budget_file(ROOT / "infra/budgets/philly.yaml")
    traces: dict[int, Any] = {}
    tail = None if slice_ == "week44" else 0.0
    orig_protection, orig_outputs = cluster.protection_s, core.Simulator._outputs
    for spec in kinds:
        kind, *opts = spec.split(",")
        knobs = {k: float(v) for k, v in (o.split("=", 1) for o in opts)}
        seed = int(knobs.get("seed", 1))
        if seed not in traces:
            traces[seed] = load_trace(DATA, bf, seed, slice_)
        jobs = traces[seed]
        fn = variant(kind, orig_protection)
        # the experiment swaps the rule in place (no engine knob takes another protection function; emit imports
        # the name, which mypy's no_implicit_reexport of the domain does not let us assign): the ignores below
        cluster.protection_s = emit.protection_s = fn  # type: ignore[attr-defined]
        counts: collections.Counter[str] = collections.Counter()
        allocated: dict[str, bool] = {}

        last: list[Any] = []

        def spy(self: Any, out: list[Any], t: int, c: Any = counts, a: Any = allocated, s: Any = last) -> None:
            if not s:
                s.append(self)
            for e in out:
                if type(e) is JobPreempted:
                    c[e.job_id] += 1
                    a[e.job_id] = e.allocated
            orig_outputs(self, out, t)

        # the experiment counts each job's preemptions by spying on the simulator's outputs (method-assign below)
        core.Simulator._outputs = spy  # type: ignore[method-assign]
        t0 = time.perf_counter()
        rep = _run(
            "fairshare",
            bf,
            jobs,
            seed,
            300.0,
            tail,
            checkpoint_wait_s=knobs.get("ckpt", CHECKPOINT_WAIT_S),
            protection_cap_w=knobs.get("w", PROTECTION_CAP_W),
            protection_doublings=None
            if knobs.get("dbl", PROTECTION_DOUBLINGS) < 0
            else int(knobs.get("dbl", PROTECTION_DOUBLINGS)),
            delta=knobs.get("delta"),
            reservation_after_s=knobs.get("resv"),
            churn_bound=int(knobs.get("hard", PROTECTION_CHURN_BOUND or 0)) or None,
            gang_rule=bool(knobs.get("gang", 1)),
        )
        core.Simulator._outputs = orig_outputs  # type: ignore[method-assign]  # the spy swapped back (see above)
        d = rep.__dict__
        if os.environ.get("PROTECTION_VARIANTS_SAMPLES") and last:  # (t_us, {leaf: (O_b/K, running, pending, alloc)})
            Path(os.environ["PROTECTION_VARIANTS_SAMPLES"] + f".{spec}.json").write_text(json.dumps(last[0].samples))
        most_alloc = max((n for j, n in counts.items() if allocated[j]), default=0)
        most_free = max((n for j, n in counts.items() if not allocated[j]), default=0)
        over5 = sum(1 for j, n in counts.items() if allocated[j] and n > 5)
        by_id = {j.job_id: j for j in jobs}
        worst = sorted((j for j, n in counts.items() if allocated[j] and n > 5), key=lambda j: -counts[j])[:12]
        for j in worst:
            jb = by_id[j]
            print(
                f"  {j}: preempted {counts[j]}, duration {jb.duration_s / 3600:.1f} h, gpus {jb.gpus_per_replica}"
                f"x{jb.replicas}, min_runtime {jb.min_runtime_s / 3600:.2f} h, budget {jb.budget}",
                flush=True,
            )
        weight = sum(b.backlogged_frac or 0.0 for b in rep.budgets)
        behind = sorted(rep.budgets, key=lambda b: -(b.mean_deficit_pp or 0.0) * (b.backlogged_frac or 0.0))[:5]
        print(  # each budget's part of the mean deficit: its mean over its backlogged samples x its share of them
            "  deficit by budget (mean pp over its backlogged samples, backlogged fraction, part of the mean pp): "
            + ", ".join(
                f"{b.path.rsplit('/', 1)[-1]} {b.mean_deficit_pp or 0.0:.2f} {b.backlogged_frac or 0.0:.2f} "
                f"{(b.mean_deficit_pp or 0.0) * (b.backlogged_frac or 0.0) / weight if weight else 0.0:.3f}"
                for b in behind
            ),
            flush=True,
        )
        print(
            f"{spec}: goodput {d['goodput']:.4f}, deficit {d['mean_deficit_pp']:.2f} pp, lost {d['lost_pct']:.2f}%, "
            f"completed {d['completed']}, preemptions {d['preemptions']}, violations {d['violations']}, most of one allocated job {most_alloc} "
            f"({over5} above 5), of one unallocated job {most_free}, {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    cluster.protection_s = emit.protection_s = orig_protection  # type: ignore[attr-defined]  # the rule swapped back (see above)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
