#!/usr/bin/env python3
"""Dispatcher restart time on a week of a busy cluster's signed log: full replay vs snapshot plus tail (issue 18).

The log is a simulated busy cluster (the trace of ``bench_sim.py`` on ``--nodes`` nodes x 8 GPUs, Poisson
arrivals at ~1.1x capacity over ``--days`` event days, gangs, preemptions) with node heartbeats every
``--heartbeat-s`` event seconds, signed as a live stack signs it (rule D10.authentication; docs/security.md):
ops register a key for the user, for each node (``node:<id>``) and for the dispatcher
(``service:dispatcher``); submissions are signed by the user, decisions in batches of up to 32 by the
dispatcher (:class:`apportion.identity.keys.BatchSigner`), node reports (registrations, heartbeats, starts,
completions) by their node. Every event the dispatcher reads (submissions, jobs, nodes and budgets
topics; its commands left out) is a Kafka record value. Each measurement runs in a fresh process (its peak
RSS is its own):

* ``full``: :meth:`DispatcherService.bootstrap` of every record (a start without a snapshot);
* ``snapshot``: decode a snapshot taken ``--tail-s`` event seconds before the end of the log
  (:mod:`services.dispatcher.snapshot`; made by a ``prepare`` process before, not timed), restore it and
  bootstrap the tail (a start with one: the leader writes one every ``snapshot_every_wall_s``, 60 s); the
  snapshot's size and encode time are printed.

No Kafka: this is the CPU and memory of the rebuild, which a real start adds to the time it takes to
fetch the records. The two starts must end in the same state (jobs, runs, queue, window) and neither may
dead-letter a record (a record the reader edge refuses, an unsigned report or decision among them, would
be a bench that measures less than a live start does). Exit 1 when they differ, when a record was
dead-lettered or when the snapshot start is not at least 3x faster than the full replay.
Run: ``.venv/bin/python bench/bench_restart.py [--days 7] [--nodes 32] [--heartbeat-s 60] [--tail-s 600]``.
The generated log is cached in ``$TMPDIR/apportion-bench-cache/`` (its name holds the parameters; ``--no-cache``
generates it again).
"""

from __future__ import annotations

import argparse
import json
import pickle
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import cast

from scratch import CACHE_HELP, cache_file

from apportion.settings import topic_name

HERE = Path(__file__).resolve().parent
SPEEDUP_MIN = 3.0
#: records per signature of the dispatcher's decisions (what a busy cycle signs at once)
DECISION_BATCH = 32


@dataclass(frozen=True)
class Rec:
    """The fields of a kafka-python record the dispatcher reads."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int = 0


def generate(days: float, nodes_n: int, heartbeat_s: float, seed: int) -> list[tuple[str, bytes, bytes, int]]:
    """``(topic, key, value, event time µs)`` of every event the dispatcher reads, in the simulator's order, signed.

    The simulator runs without heartbeats on the jobs submitted in the first ``days`` of the trace; each
    node's heartbeats are merged in afterwards, every ``heartbeat_s`` event seconds, listing the replicas
    the cluster state (folded from the log up to that point) has open on the node.
    """
    sys.path.insert(0, str(HERE))
    from dataclasses import replace

    from bench_sim import config, trace

    from apportion.client import key_registration
    from apportion.domain.admission import (
        _SHARED_REPORTS,
        DISPATCHER,
        DISPATCHER_PRODUCER,
        DISPATCHER_TYPES,
        REPORT_TYPES,
        RUN_REPORT_TYPES,
        node_principal,
    )
    from apportion.domain.cluster import ClusterState
    from apportion.domain.dispatch import DispatchConfig
    from apportion.events import (
        TOPIC_OF,
        BudgetSet,
        Event,
        JobCancelRequested,
        JobPlaced,
        JobSubmitted,
        NodeHeartbeat,
        RunningWorkload,
        encode,
        key_of,
    )
    from apportion.identity.keys import SIGNED_TYPES, BatchSigner, Identity
    from apportion.sim.core import SimNode, Simulator
    from apportion.timeutil import from_us, s_to_us, to_us
    from apportion.topics import COMMANDS

    sim_nodes = [SimNode(f"n{i:03d}", 8) for i in range(nodes_n)]
    n = 1000
    while True:  # enough of the trace to cover the days
        tree, js = trace(n, seed, 8 * nodes_n)
        if js[-1].submit_us - js[0].submit_us >= s_to_us(days * 86400):
            break
        n *= 2
    js = [j for j in js if j.submit_us - js[0].submit_us < s_to_us(days * 86400)]
    cfg = replace(config(seed, 10.0), keep_log=True, dispatch=DispatchConfig(heartbeat_timeout_s=None))
    r = Simulator(tree, sim_nodes, js, cfg).run()
    t0 = from_us(js[0].submit_us - s_to_us(1))
    user_keys = {u: Identity.generate(u) for u in sorted({j.user for j in js})}
    node_keys = {nd.node_id: Identity.generate(node_principal(nd.node_id)) for nd in sim_nodes}
    dispatcher = Identity.generate(DISPATCHER)
    signer = BatchSigner(dispatcher, DECISION_BATCH)
    head: list[Event] = [
        key_registration(i.user, i.public_key, by="ops", now=t0)
        for i in (dispatcher, *user_keys.values(), *node_keys.values())
    ]
    head += [BudgetSet(path=p, share=tree.share(p), ts=t0, producer="bench") for p in sorted(tree.paths())]
    cluster = ClusterState()
    step = s_to_us(heartbeat_s)
    next_hb: int | None = None
    merged: list[Event] = []
    for e in [*head, *r.log]:
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
    merged = [e for e in merged if topic_name(TOPIC_OF[e.type]) != topic_name(COMMANDS)]

    def by_dispatcher(e) -> bool:
        return isinstance(e, DISPATCHER_TYPES) or (isinstance(e, _SHARED_REPORTS) and e.producer == DISPATCHER_PRODUCER)

    # the simulator's reports of a run may name no node (a live agent always names its own): the replica's
    placed: dict[tuple[str, int], tuple[str, ...]] = {}
    for i, e in enumerate(merged):
        if isinstance(e, JobPlaced):
            placed.setdefault((e.job_id, e.attempt), tuple(p.node_id for p in e.placements))
        elif isinstance(e, RUN_REPORT_TYPES) and not by_dispatcher(e) and e.node_id is None:
            nodes_of = placed[(e.job_id, e.attempt)]
            merged[i] = e.model_copy(update={"node_id": nodes_of[getattr(e, "replica", None) or 0]})

    values: list[bytes | None] = [None] * len(merged)
    pending: list[int] = []  # a run of the dispatcher's decisions, signed together

    def flush() -> None:
        for i, v in zip(pending, signer.values([encode(merged[i]) for i in pending]), strict=True):
            values[i] = v
        pending.clear()

    for i, e in enumerate(merged):
        if by_dispatcher(e):
            pending.append(i)
            if len(pending) == DECISION_BATCH:
                flush()
            continue
        flush()
        if e.type in SIGNED_TYPES:
            request = cast(JobSubmitted | JobCancelRequested, e)  # the types SIGNED_TYPES names
            values[i] = encode(user_keys[request.user].sign(e))
        elif isinstance(e, REPORT_TYPES):
            assert e.node_id is not None  # every report names its node by now (filled in above)
            values[i] = node_keys[e.node_id].signed_value(e)
        else:
            values[i] = encode(e)
    flush()
    return [
        (topic_name(TOPIC_OF[e.type]), key_of(e).encode(), v, to_us(e.ts))
        for e, v in zip(merged, values, strict=True)
        if v
    ]


def records(log: list[tuple[str, bytes, bytes, int]]) -> list[Rec]:
    offsets: dict[str, int] = {}
    out = []
    for topic, key, value, _ in log:
        off = offsets.get(topic, 0)
        offsets[topic] = off + 1
        out.append(Rec(topic, 0, off, key, value))
    return out


def service(now: datetime):  # DispatcherService
    from apportion.clock import ManualClock
    from services.dispatcher.config import DispatcherSettings
    from services.dispatcher.service import DispatcherService

    settings = DispatcherSettings(heartbeat_timeout_s=0, kafka_bootstrap="unused:1", redis_url="redis://unused")
    return DispatcherService(settings, ManualClock(now), lambda sent: None)


def summary(svc) -> str:
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


def child(mode: str, path: str, tail_s: float) -> None:
    """One measurement in this process; prints a JSON line.

    ``full``: bootstrap every record. ``prepare``: bootstrap the records before the cut, encode the snapshot
    and write it with the tail records to ``path + ".snapshot"`` (not timed). ``snapshot``: read that file,
    decode the snapshot, restore it and bootstrap the tail, so the peak RSS is the restart's own.
    """
    from apportion.timeutil import from_us, s_to_us
    from services.dispatcher import snapshot as snapmod

    result: dict = {}
    if mode == "snapshot":
        with open(path + ".snapshot", "rb") as f:
            fields, tail, end_us = pickle.load(f)
        t = time.perf_counter()
        snap = snapmod.decode(fields, window_s=7 * 24 * 3600.0, topic_prefix="")
        result["decode_s"] = time.perf_counter() - t
        svc = service(from_us(end_us))
        svc.restore(snap)
        svc.bootstrap(tail)
        result["tail"] = len(tail)
    else:
        with open(path, "rb") as f:
            log = pickle.load(f)
        recs = records(log)
        end_us = max(t for *_, t in log)
        now = from_us(end_us)  # the restart happens just after the last record
        cut = next((i for i, (*_, t) in enumerate(log) if t > end_us - s_to_us(tail_s)), len(log))
        del log
        result["records"] = len(recs)
        if mode == "prepare":
            pre = service(now)
            pre.bootstrap(recs[:cut])
            t = time.perf_counter()
            fields = snapmod.encode(pre.snapshot(), topic_prefix="")
            result["encode_s"] = time.perf_counter() - t
            result["snapshot_bytes"] = len(fields["state"])
            with open(path + ".snapshot", "wb") as f:
                pickle.dump((fields, recs[cut:], end_us), f, protocol=5)
            print(json.dumps(result))
            return
        t = time.perf_counter()
        svc = service(now)
        svc.bootstrap(recs)
    result["restart_s"] = time.perf_counter() - t
    result["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["dead_lettered"] = svc.intake.stats.dead_lettered
    result["summary"] = summary(svc)
    print(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=CACHE_HELP)
    ap.add_argument("--days", type=float, default=7.0, help="event days of submissions in the log")
    ap.add_argument("--nodes", type=int, default=32, help="nodes of 8 GPUs")
    ap.add_argument("--heartbeat-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tail-s", type=float, default=600.0, help="event seconds of the log after the snapshot")
    ap.add_argument("--no-cache", action="store_true", help="generate the log again (see below)")
    ap.add_argument("--child", choices=["full", "prepare", "snapshot"])
    ap.add_argument("--log")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.log, a.tail_s)
        return 0
    name = f"restart-signed-{a.days:g}d-{a.nodes}-{a.heartbeat_s:g}-{a.seed}.pickle"
    path = cache_file(name, fresh=a.no_cache)
    if not path.exists():
        t = time.perf_counter()
        log = generate(a.days, a.nodes, a.heartbeat_s, a.seed)
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as f:
            pickle.dump(log, f, protocol=5)
        partial.replace(path)
        print(f"generated {len(log)} signed records in {time.perf_counter() - t:.1f} s ({path})", flush=True)
        del log
    res = {}
    for mode in ("full", "prepare", "snapshot"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--log", str(path), "--tail-s", str(a.tail_s)],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            print(out.stderr)
            return 1
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    full, snap = res["full"], {**res["prepare"], **res["snapshot"]}
    same = full["summary"] == snap["summary"]
    clean = full["dead_lettered"] == snap["dead_lettered"] == 0
    speedup = full["restart_s"] / max(snap["restart_s"], 1e-9)
    print(
        f"bench_restart: {full['records']} signed records ({a.days:g} event-days of submissions on {a.nodes} x 8 "
        f"GPUs, heartbeats every {a.heartbeat_s:g} s): full replay {full['restart_s']:.2f} s, peak RSS "
        f"{full['rss_mib']:.0f} MiB, {full['dead_lettered']} dead-lettered"
    )
    print(
        f"  restart from a snapshot {a.tail_s:g} event-s before the end ({snap['snapshot_bytes'] / 2**20:.1f} MiB, "
        f"encoded in {snap['encode_s']:.2f} s, decoded in {snap['decode_s']:.2f} s) + {snap['tail']} tail records: "
        f"{snap['restart_s']:.2f} s ({speedup:.1f}x faster), peak RSS {snap['rss_mib']:.0f} MiB, "
        f"{snap['dead_lettered']} dead-lettered; same state as the full "
        f"replay: {'yes' if same else 'NO'}"
    )
    return 0 if same and clean and speedup >= SPEEDUP_MIN else 1


if __name__ == "__main__":
    sys.exit(main())
