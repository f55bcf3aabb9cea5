#!/usr/bin/env python3
"""Dispatcher restart time on a large generated log: full replay vs snapshot plus tail (issue 18).

The log is a simulated busy cluster (the trace of ``bench_sim.py``: 125 nodes x 8 GPUs, Poisson arrivals
at ~1.1x capacity, gangs, preemptions) with node heartbeats every ``--heartbeat-s`` event seconds: every
event the dispatcher reads (submissions, jobs, nodes and budgets topics; its commands left out), encoded
as Kafka record values. Each measurement runs in a fresh process (its peak RSS is its own):

* ``full``: :meth:`DispatcherService.bootstrap` of every record (a start without a snapshot);
* ``snapshot``: decode a snapshot taken at ``--at`` of the log (:mod:`services.dispatcher.snapshot`),
  restore it and bootstrap the tail (a start with one); the snapshot's size and encode time are printed.

No Kafka: this is the CPU and memory of the rebuild, which a real start adds to the time it takes to
fetch the records. The two starts must end in the same state (jobs, runs, queue, window). Exit 1 when
they differ or when the snapshot start is not at least 3x faster than the full replay.
Run: ``.venv/bin/python bench/bench_restart.py [--jobs 3000] [--heartbeat-s 60] [--at 0.9]``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPEEDUP_MIN = 3.0


@dataclass(frozen=True)
class Rec:
    """The fields of a kafka-python record the dispatcher reads."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int = 0


def generate(jobs: int, heartbeat_s: float, seed: int) -> list[tuple[str, bytes, bytes]]:
    """``(topic, key, value)`` of every event the dispatcher reads, in the simulator's order.

    The simulator runs without heartbeats; each node's heartbeats are merged in afterwards, every
    ``heartbeat_s`` event seconds, listing the replicas the cluster state (folded from the log up to
    that point) has open on the node.
    """
    sys.path.insert(0, str(HERE))
    from dataclasses import replace

    from bench_sim import config, nodes, trace

    from apportion.domain.cluster import ClusterState
    from apportion.domain.dispatch import DispatchConfig
    from apportion.events import TOPIC_OF, BudgetSet, NodeHeartbeat, RunningWorkload, encode, key_of
    from apportion.sim.core import Simulator
    from apportion.timeutil import from_us, s_to_us, to_us
    from apportion.topics import COMMANDS

    tree, js = trace(jobs, seed, 1000)
    cfg = replace(config(seed, 10.0), keep_log=True, dispatch=DispatchConfig(heartbeat_timeout_s=None))
    r = Simulator(tree, nodes(), js, cfg).run()
    t0 = from_us(js[0].submit_us)
    budgets = [BudgetSet(path=p, share=tree.share(p), ts=t0, producer="bench") for p in sorted(tree.paths())]
    cluster = ClusterState()
    step = s_to_us(heartbeat_s)
    next_hb: int | None = None
    merged = []
    for e in [*budgets, *r.log]:
        t = to_us(e.ts)
        while next_hb is not None and next_hb <= t:
            for nid in sorted(cluster.nodes):
                running = [
                    RunningWorkload(job_id=k[0], attempt=k[1], replica=i, gpus=run.placements[i].gpus)
                    for k in sorted(cluster.node_runs.get(nid, ()))
                    if (run := cluster.runs.get(k)) is not None
                    for i in sorted(run.open_replicas)
                    if run.placements[i].node_id == nid
                ]
                hb = NodeHeartbeat(ts=from_us(next_hb), producer="bench/agent", node_id=nid, running=tuple(running))
                cluster.apply(hb)
                merged.append(hb)
            next_hb += step
        cluster.apply(e)
        merged.append(e)
        if next_hb is None and cluster.nodes:
            next_hb = t + step
    out = []
    for e in merged:
        topic = TOPIC_OF[e.type]
        if topic.name != COMMANDS.name:
            out.append((topic.name, key_of(e).encode(), encode(e)))
    return out


def records(log: list[tuple[str, bytes, bytes]]) -> list[Rec]:
    offsets: dict[str, int] = {}
    out = []
    for topic, key, value in log:
        off = offsets.get(topic, 0)
        offsets[topic] = off + 1
        out.append(Rec(topic, 0, off, key, value))
    return out


def service(now: datetime):  # noqa: ANN201 - DispatcherService
    from apportion.clock import ManualClock
    from services.dispatcher.config import DispatcherSettings
    from services.dispatcher.service import DispatcherService

    settings = DispatcherSettings(heartbeat_timeout_s=0, kafka_bootstrap="unused:1", redis_url="redis://unused")
    return DispatcherService(settings, ManualClock(now), lambda sent: None)


def summary(svc) -> str:  # noqa: ANN001
    st = svc.state
    facts = (
        sorted((j, r.status, r.attempt) for j, r in st.jobs.items()),
        sorted(st.finished.items()),
        sorted((b, [p.job_id for p in lst]) for b, lst in st.pending.items()),
        sorted((k, r.open_replicas, r.stopping) for k, r in st.cluster.runs.items()),
        sorted((n.node_id, n.free, n.state) for n in st.cluster.nodes.values()),
        st.clock_us,
        sorted(st.ledger.occupancy(st.clock_us).items()),
    )
    return repr(facts)


def child(mode: str, path: str, at: float) -> None:
    """One measurement in this process; prints a JSON line."""
    from apportion.events import decode
    from services.dispatcher import snapshot as snapmod

    with open(path, "rb") as f:
        log = pickle.load(f)
    recs = records(log)
    now = max(decode(v).ts for _, _, v in log[-100:])  # the restart happens just after the last record
    cut = int(len(recs) * at)
    result: dict = {"records": len(recs)}
    if mode == "snapshot":
        pre = service(now)
        pre.bootstrap(recs[:cut])
        t = time.perf_counter()
        fields = snapmod.encode(pre.snapshot(), topic_prefix="")
        result["encode_s"] = time.perf_counter() - t
        result["snapshot_bytes"] = len(fields["state"])
        del pre
        t = time.perf_counter()
        snap = snapmod.decode(fields, window_s=7 * 24 * 3600.0, topic_prefix="")
        svc = service(now)
        svc.restore(snap)
        svc.bootstrap(recs[cut:])
        result["tail"] = len(recs) - cut
    else:
        t = time.perf_counter()
        svc = service(now)
        svc.bootstrap(recs)
    result["restart_s"] = time.perf_counter() - t
    result["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["summary"] = summary(svc)
    print(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--heartbeat-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--at", type=float, default=0.9, help="share of the log the snapshot covers")
    ap.add_argument("--child", choices=["full", "snapshot"])
    ap.add_argument("--log")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.log, a.at)
        return 0
    path = Path(tempfile.gettempdir()) / f"apportion-bench-restart-{a.jobs}-{a.heartbeat_s:g}-{a.seed}.pickle"
    if not path.exists():
        t = time.perf_counter()
        log = generate(a.jobs, a.heartbeat_s, a.seed)
        with open(path, "wb") as f:
            pickle.dump(log, f, protocol=5)
        print(f"generated {len(log)} records in {time.perf_counter() - t:.1f} s ({path})", flush=True)
    res = {}
    for mode in ("full", "snapshot"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--log", str(path), "--at", str(a.at)],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            print(out.stderr)
            return 1
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    full, snap = res["full"], res["snapshot"]
    same = full["summary"] == snap["summary"]
    speedup = full["restart_s"] / max(snap["restart_s"], 1e-9)
    print(
        f"bench_restart: {full['records']} records ({a.jobs} jobs, heartbeats every {a.heartbeat_s:g} s): "
        f"full replay {full['restart_s']:.2f} s, peak RSS {full['rss_mib']:.0f} MiB"
    )
    print(
        f"  from a snapshot at {a.at:.0%} of the log ({snap['snapshot_bytes'] / 2**20:.1f} MiB, encoded in "
        f"{snap['encode_s']:.2f} s) + {snap['tail']} tail records: {snap['restart_s']:.2f} s "
        f"({speedup:.1f}x faster); same state as the full replay: {'yes' if same else 'NO'}"
    )
    return 0 if same and speedup >= SPEEDUP_MIN else 1


if __name__ == "__main__":
    sys.exit(main())
