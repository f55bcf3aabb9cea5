#!/usr/bin/env python3
"""Audit rebuild benchmark: full-log rebuild rate beside the raw read rate of the same source.

The log is a simulator run (the real dispatcher core: submissions, queueing,
placements, preemptions, starts, completions, commands) of ``--jobs`` jobs
on 32 nodes x 8 GPUs, 4 budgets, wrapped as records and written as an
export file (gzip JSON Lines, :mod:`apportion.audit.source`).

* **file, raw**: gzip + ``json.loads`` of every line (the floor);
* **file, rebuild**: :func:`apportion.audit.source.load_log` (decode every
  event, sort into log order) and then the full rebuild ``audit verify``
  starts from: every event folded into an occupancy ledger and into the
  dispatcher state (:func:`apportion.domain.dispatch.evolve`).

With ``KAFKA_BOOTSTRAP`` set, the same records are produced to a fresh topic
namespace and read back: **kafka, raw** is a kafka-python consume of every
record (no decode), **kafka, rebuild** is ``load_log(bootstrap=...)`` plus
the same fold. Without it the Kafka part is reported as skipped.

The export file is written in a fresh folder of the system temp directory, removed when the run ends
(``--keep`` keeps it). Usage: ``.venv/bin/python bench/bench_audit.py [--jobs N] [--seed S] [--keep]``.
Prints figures; exits 0.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
import uuid
from pathlib import Path

from scratch import scratch_dir

from apportion.settings import topic_name


def make_log(jobs: int, seed: int) -> list:
    import random

    from apportion import events
    from apportion.audit.verify import records_from_events
    from apportion.domain.budgets import BudgetTree
    from apportion.domain.dispatch import DispatchConfig
    from apportion.sim.core import SimConfig, SimJob, SimNode, simulate
    from apportion.timeutil import from_us

    t0 = 1_700_000_000_000_000
    tree = {"lab": 1.0, "lab/a": 0.4, "lab/b": 0.3, "lab/c": 0.2, "lab/d": 0.1}
    rng = random.Random(seed)
    trace = []
    t = t0
    for i in range(jobs):
        t += int(rng.expovariate(1 / 60.0) * 1e6)
        g = rng.choice((1, 1, 2, 4, 8))
        mr = 0.0 if rng.random() < 0.25 else rng.choice((600.0, 1800.0, 3600.0))
        trace.append(
            SimJob(
                f"j{i}", rng.choice(("lab/a", "lab/b", "lab/c", "lab/d")), "u", t, g, 1, mr, rng.uniform(300, 4 * 3600)
            )
        )
    nodes = [SimNode(f"n{i:02d}", 8) for i in range(32)]
    res = simulate(
        BudgetTree.from_mapping(tree),
        nodes,
        trace,
        SimConfig(seed=seed, dispatch=DispatchConfig(heartbeat_timeout_s=None), sample_s=0),
    )
    budget = [events.BudgetSet(path=p, share=s, ts=from_us(t0 - 1), producer="ops") for p, s in tree.items()]
    return records_from_events(budget + res.log)


def fold_all(recs: list) -> int:
    from apportion.domain.dispatch import DispatchState, evolve

    state = DispatchState()
    n = 0
    for r in recs:
        if r.event is not None:
            evolve(state, r.event)  # the dispatcher state and, inside it, the occupancy ledger
            n += 1
    return n


def raw_file(path: Path) -> int:
    n = 0
    with gzip.open(path, "rt", encoding="utf-8") as f:
        f.readline()
        for line in f:
            json.loads(line)
            n += 1
    return n


def kafka_part(recs: list) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    from apportion.audit.source import audit_topics, load_log
    from apportion.bus.provision import provision

    bootstrap = os.environ["KAFKA_BOOTSTRAP"]
    os.environ["APPORTION_TOPIC_PREFIX"] = f"bench{uuid.uuid4().hex[:8]}."
    provision(bootstrap)
    from apportion import topics

    names = {t.base: topic_name(t) for t in topics.ALL_TOPICS}
    from apportion.bus.producer import READ_COMMITTED
    from apportion.bus.security import kafka_auth

    prod = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=512 * 1024, acks=1, **kafka_auth())
    for r in recs:
        base = r.topic
        prod.send(names.get(base, base), key=(r.key or "").encode(), value=r.raw)
    prod.flush()
    prod.close()
    wanted = sorted(audit_topics())
    t = time.perf_counter()
    c = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        group_id=None,
        max_partition_fetch_bytes=8 * 1024 * 1024,
        **READ_COMMITTED,
        **kafka_auth(),
    )
    parts = [TopicPartition(tn, p) for tn in wanted for p in sorted(c.partitions_for_topic(tn) or ())]
    c.assign(parts)
    c.seek_to_beginning()
    end = c.end_offsets(parts)
    n = 0
    remaining = {tp for tp in parts if end[tp] > 0}
    while remaining:
        for tp, rs in c.poll(timeout_ms=500, max_records=5000).items():
            n += len(rs)
            if c.position(tp) >= end[tp]:
                remaining.discard(tp)
    c.close()
    raw_dt = time.perf_counter() - t
    t = time.perf_counter()
    got = load_log(bootstrap=bootstrap)
    fold_all(got)
    dt = time.perf_counter() - t
    print(f"kafka, raw consume (kafka-python) : {n:>9,} records {raw_dt:6.2f} s {n / raw_dt:>10,.0f} records/s")
    print(
        f"kafka, full rebuild               : {len(got):>9,} events  {dt:6.2f} s {len(got) / dt:>10,.0f} events/s"
        f"  ({(len(got) / dt) / (n / raw_dt):.0%} of raw)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=5_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the export file (its folder is printed)")
    args = ap.parse_args(argv)
    with scratch_dir("apportion-bench-audit-", args.keep) as root:
        return measure(args, root / "log.jsonl.gz")


def measure(args: argparse.Namespace, path: Path) -> int:
    """The run of :func:`main`'s arguments ``args``, its export written to ``path``."""
    from apportion.audit.source import audit_topics, load_log, write_export

    t = time.perf_counter()
    recs = make_log(args.jobs, args.seed)
    write_export(recs, path, topic_names=audit_topics(), exported_at="bench")
    print(
        f"log: {len(recs):,} records from {args.jobs:,} simulated jobs ({time.perf_counter() - t:.1f} s to make), "
        f"{path.stat().st_size / 1e6:.1f} MB export"
    )
    t = time.perf_counter()
    n_raw = raw_file(path)
    raw_dt = time.perf_counter() - t
    t = time.perf_counter()
    got = load_log(from_file=path)
    load_dt = time.perf_counter() - t
    n = fold_all(got)
    dt = time.perf_counter() - t
    print(f"file, raw read (gzip + json)      : {n_raw:>9,} records {raw_dt:6.2f} s {n_raw / raw_dt:>10,.0f} records/s")
    print(
        f"file, full rebuild                : {n:>9,} events  {dt:6.2f} s {n / dt:>10,.0f} events/s"
        f"  (decode+sort {load_dt:.2f} s, fold {dt - load_dt:.2f} s; {(n / dt) / (n_raw / raw_dt):.0%} of raw)"
    )
    if os.environ.get("KAFKA_BOOTSTRAP"):
        kafka_part(recs)
    else:
        print("kafka: skipped (set KAFKA_BOOTSTRAP to measure the rebuild from Kafka beside a raw consume)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
