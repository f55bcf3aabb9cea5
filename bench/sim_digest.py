"""sha256 of simulator decision logs: the "decisions did not change" check for engine speed-ups.

The digest is ``sha256(SimResult.decision_log())`` (the dispatcher's outputs
as JSON lines joined by ``\\n``), computed incrementally while the run goes
so that a 100,000-job run does not keep its ~1M events in memory.

Run::

    .venv/bin/python bench/sim_digest.py philly --slice week44 [--policy all] [--tail-h H]
        [--no-checkpoints] [--checkpoint-on-stop unallocated|all|none] [--drop Type.field ...]
    .venv/bin/python bench/sim_digest.py bench --jobs 20000 [--gap 10] [--no-checkpoints] [--drop Type.field ...]

``philly`` is the reference setup of docs/simulation.md (Philly trace,
``infra/budgets/philly.yaml``, seed 1, CLI defaults); ``bench`` is the
synthetic trace of ``bench/bench_sim.py``. Without ``--tail-h`` the
``philly`` runs stop at ``simulate``'s default horizon
(:func:`apportion.sim.core.default_horizon_us`; the reference slices drain
well before it, so the digest is the run's to the end). ``--no-checkpoints``
is the simulator before checkpoints (every attempt restarts from scratch):
its digests are the ones published before checkpoints were modelled.
``--drop StartWorkload.progress_s`` hashes every decision event of that
type without that field (repeatable): a field added to an event changes
every digest with nothing else changing, and the digest with it dropped is
the one published before it (the "payload only" check).
Prints one line per policy: ``<policy> <sha256> <decision events> <wall s>``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

from apportion.events import Event, encode
from apportion.sim.core import SimConfig, Simulator, default_horizon_us

ROOT = Path(__file__).resolve().parent.parent


class DigestSimulator(Simulator):
    """A :class:`Simulator` that hashes its decision log as it goes (``keep_log`` may be off)."""

    def __init__(self, *args: Any, drop: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.digest = hashlib.sha256()
        self.decisions = 0
        self.drop: dict[str, set[str]] = {}
        for d in drop:
            kind, _, name = d.partition(".")
            self.drop.setdefault(kind, set()).add(name)

    def _outputs(self, out: list[Event], t: int) -> None:
        h = self.digest
        for e in out:
            if e.producer == "dispatcher":
                if self.decisions:
                    h.update(b"\n")
                gone = self.drop.get(e.type)
                h.update(encode(e) if gone is None else e.model_dump_json(exclude=gone).encode())
                self.decisions += 1
        super()._outputs(out, t)


def _philly(a: argparse.Namespace) -> None:
    from apportion.domain.dispatch import DispatchConfig
    from apportion.domain.engine import EngineConfig
    from apportion.settings import default_data_dir
    from apportion.sim.baselines import POLICIES
    from apportion.sim.traces import load_budget_file, load_trace

    bf = load_budget_file(ROOT / "infra/budgets/philly.yaml")
    names = list(POLICIES) if a.policy == "all" else a.policy.split(",")
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise SystemExit(f"sim_digest: unknown policy {', '.join(unknown)}; use {', '.join(POLICIES)} or all")
    try:
        jobs = load_trace(a.trace or default_data_dir() / "philly" / "philly.csv", bf, a.seed, a.slice)
    except ValueError as exc:  # trace or --slice errors name the file/line or the flag
        raise SystemExit(f"sim_digest: {exc}") from None
    for name in names:
        dcfg = DispatchConfig(
            engine=EngineConfig(window_s=bf.window_s),
            heartbeat_timeout_s=None,
            scheduler=POLICIES[name],
        )
        if a.tail_h is None:
            until = default_horizon_us(jobs, bf.nodes)
        else:
            until = max(j.submit_us for j in jobs) + round(a.tail_h * 3600e6)
        cfg = SimConfig(
            seed=a.seed,
            dispatch=dcfg,
            cycle_s=300.0,
            keep_log=False,
            until_us=until,
            checkpoints=a.checkpoints,
            checkpoint_on_stop=a.checkpoint_on_stop,
        )
        t = time.perf_counter()
        sim = DigestSimulator(bf.tree, bf.nodes, jobs, cfg, window_s=bf.window_s, drop=tuple(a.drop))
        sim.run()
        print(f"{name} {sim.digest.hexdigest()} {sim.decisions} {time.perf_counter() - t:.1f}s", flush=True)


def _bench(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_sim import config, nodes, trace

    tree, jobs = trace(a.jobs, a.seed, 1000)
    t = time.perf_counter()
    sim = DigestSimulator(tree, nodes(), jobs, config(a.seed, a.gap, checkpoints=a.checkpoints), drop=tuple(a.drop))
    sim.run()
    print(f"bench {sim.digest.hexdigest()} {sim.decisions} {time.perf_counter() - t:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("philly")
    p.add_argument("--trace", default=None, help="default: <data dir>/philly/philly.csv (APPORTION_DATA_DIR)")
    p.add_argument("--slice", default="week44")
    p.add_argument("--policy", default="all")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--tail-h",
        type=float,
        default=None,
        help="stop the clock this many hours after the last submission (as `simulate --tail-h`); "
        "default: run until nothing is left",
    )
    p.add_argument(
        "--checkpoint-on-stop",
        choices=["unallocated", "all", "none"],
        default="unallocated",
        help="which preempted workloads save their progress on SIGTERM (default: unallocated)",
    )
    b = sub.add_parser("bench")
    b.add_argument("--jobs", type=int, default=20_000)
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--gap", type=float, default=10.0)
    for q in (p, b):
        q.add_argument(
            "--no-checkpoints",
            dest="checkpoints",
            action="store_false",
            help="every attempt restarts from scratch (the simulator before checkpoints)",
        )
        q.add_argument(
            "--drop",
            action="append",
            default=[],
            metavar="TYPE.FIELD",
            help="hash decision events of TYPE without FIELD (repeatable): the digest from before FIELD existed",
        )
    a = ap.parse_args()
    (_philly if a.what == "philly" else _bench)(a)


if __name__ == "__main__":
    main()
