#!/usr/bin/env python3
"""Occupancy rebuild benchmark (rule D9.occupancy-rebuild): 1,000,000 job events into windows.

A busy week of a 10,000-GPU cluster (1,250 nodes x 8 GPUs, every GPU busy
back-to-back), 200 leaf budgets in a 3-level tree (5 orgs x 5 groups x 8
teams), ~20% unallocated runs, some failures and preemptions. The log is
generated deterministically from ``--seed`` as JSON Lines (cached in
``$TMPDIR/apportion-bench-cache/``; ``--no-cache`` generates it again), then replayed from the file through :func:`apportion.events.decode`:

* decode only (the floor set by parsing and validation);
* bulk :func:`~apportion.domain.occupancy.rebuild` (target <= 10 s);
* incremental :meth:`~apportion.domain.occupancy.OccupancyLedger.apply`;
* a full query (occupancy + unallocated + capacity) at 200 leaves, p50/p99.

Prints figures; exits 1 when the bulk rebuild misses 10 s or the two paths
disagree. Usage: ``.venv/bin/python bench/bench_occupancy.py [--events N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from scratch import CACHE_HELP, cache_file

from apportion.domain.occupancy import OccupancyLedger, rebuild
from apportion.events import decode
from apportion.heap import settle_heap
from apportion.timeutil import US_PER_S, WEEK_S, from_us, to_us

T0 = to_us(datetime(2024, 1, 1, tzinfo=UTC))
NODES = 1250
LANE_PATTERNS = ([8], [4, 4], [4, 2, 1, 1], [2, 2, 2, 2], [2, 2, 4], [1] * 8)
TARGET_S = 10.0

PLACED = (
    '{"event_id":"%s","type":"JobPlaced","schema_version":1,"ts":"%s","producer":"dispatcher",'
    '"job_id":"%s","attempt":%d,"budget":"%s","user":"%s","allocated":%s,'
    '"gpus_per_replica":%d,"replicas":1,"min_runtime_s":%s,'
    '"placements":[{"node_id":"%s","gpus":[%s]}],"submitted_at":"%s",'
    '"decision":{"rank":%d,"budget_rank":%d,"ratio":%s,"victims":[],"reservation":false,'
    '"policy_version":"fairtree-1"},"fencing_token":7}'
)
STARTED = (
    '{"event_id":"%s","type":"JobStarted","schema_version":1,"ts":"%s","producer":"node-agent",'
    '"job_id":"%s","attempt":%d,"replica":0,"node_id":"%s","gpus":[%s],"pid":%d}'
)
COMPLETED = (
    '{"event_id":"%s","type":"JobCompleted","schema_version":1,"ts":"%s",'
    '"producer":"node-agent","job_id":"%s","attempt":%d,"replica":0,"node_id":"%s",'
    '"exit_code":0}'
)
FAILED = (
    '{"event_id":"%s","type":"JobFailed","schema_version":1,"ts":"%s","producer":"node-agent",'
    '"job_id":"%s","attempt":%d,"replica":null,"node_id":"%s","exit_code":1,"reason":"oom"}'
)
PREEMPTED = (
    '{"event_id":"%s","type":"JobPreempted","schema_version":1,"ts":"%s",'
    '"producer":"dispatcher","job_id":"%s","attempt":%d,"budget":"%s","allocated":%s,'
    '"by_job_id":null,"grace_s":30.0,"reason":"preempted"}'
)
REQUEUED = (
    '{"event_id":"%s","type":"JobRequeued","schema_version":1,"ts":"%s",'
    '"producer":"dispatcher","job_id":"%s","attempt":%d,"submitted_at":"%s",'
    '"reason":"preempted"}'
)
REGISTERED = (
    '{"event_id":"%s","type":"NodeRegistered","schema_version":1,"ts":"%s",'
    '"producer":"node-agent","node_id":"%s","gpu_count":8,"gpu_model":"A100",'
    '"simulated":true}'
)


def leaves() -> list[str]:
    """200 leaf budgets: 5 orgs x 5 groups x 8 teams."""
    return [f"org{o}/grp{g}/team{t}" for o in range(5) for g in range(5) for t in range(8)]


def generate(path: Path, n_events: int, seed: int) -> None:
    """Write a deterministic week-long log of about ``n_events`` job events (plus registrations)."""
    rng = random.Random(seed)

    def eid() -> str:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    def iso(us: int) -> str:
        return from_us(us).isoformat()

    budgets = leaves()
    weights = [1.0 / (1 + i % 17) for i in range(len(budgets))]
    lanes = []  # (node, gpu indices)
    for n in range(NODES):
        pattern = LANE_PATTERNS[rng.randrange(len(LANE_PATTERNS))]
        first = 0
        for g in pattern:
            lanes.append((f"node{n:04d}", list(range(first, first + g))))
            first += g
    week_us = WEEK_S * US_PER_S
    # ~3.2 job events per run: calibrate the mean run length to hit n_events in a week
    runs_per_lane = n_events / 3.2 / len(lanes)
    mean_us = week_us / runs_per_lane
    heap: list[tuple[int, int, str]] = []
    seq = 0
    for n in range(NODES):
        heap.append((T0, seq, REGISTERED % (eid(), iso(T0), f"node{n:04d}")))
        seq += 1
    job = 0
    for node, gpus in lanes:
        t = T0 + rng.randrange(60 * US_PER_S)
        gpu_list = ",".join(map(str, gpus))
        while t < T0 + week_us:
            job += 1
            jid = f"j{job}"
            budget = rng.choices(budgets, weights)[0]
            allocated = rng.random() >= 0.2
            dur = int(rng.expovariate(1.0 / (mean_us * 0.97))) + US_PER_S
            sub = t - rng.randrange(600 * US_PER_S)
            heap.append(
                (
                    t,
                    seq,
                    PLACED
                    % (
                        eid(),
                        iso(t),
                        jid,
                        1,
                        budget,
                        f"user{rng.randrange(400)}",
                        "true" if allocated else "false",
                        len(gpus),
                        "3600.0" if allocated else "0.0",
                        node,
                        gpu_list,
                        iso(sub),
                        rng.randrange(20000),
                        rng.randrange(200),
                        repr(rng.random()),
                    ),
                )
            )
            start = t + rng.randrange(2 * US_PER_S)
            heap.append(
                (start, seq + 1, STARTED % (eid(), iso(start), jid, 1, node, gpu_list, rng.randrange(1, 99999)))
            )
            end = t + dur
            roll = rng.random()
            if roll < 0.05:
                heap.append((end, seq + 2, FAILED % (eid(), iso(end), jid, 1, node)))
            elif roll < 0.12:
                heap.append(
                    (end, seq + 2, PREEMPTED % (eid(), iso(end), jid, 1, budget, "true" if allocated else "false"))
                )
                heap.append((end, seq + 3, REQUEUED % (eid(), iso(end), jid, 2, iso(sub))))
            else:
                heap.append((end, seq + 2, COMPLETED % (eid(), iso(end), jid, 1, node)))
            seq += 4
            t = end + rng.randrange(30 * US_PER_S)
    heap.sort()
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for _, _, line in heap[: n_events + NODES]:
            f.write(line)
            f.write("\n")
    tmp.replace(path)


def events_from(path: Path):
    """Decode the file line by line (streaming: the log is never all in memory)."""
    with path.open("rb") as f:
        for line in f:
            yield decode(line)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="occupancy rebuild benchmark", epilog=CACHE_HELP)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=20240101)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--no-cache", action="store_true", help="generate the log again (see below)")
    parser.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    path = cache_file(f"occupancy-{args.seed}-{args.events}.jsonl", fresh=args.no_cache and not args.generate_only)
    if args.generate_only:
        generate(path, args.events, args.seed)
        return 0
    if not path.exists():
        # in a child process, so this process's peak RSS measures the replay only
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, __file__, "--generate-only", "--events", str(args.events), "--seed", str(args.seed)],
            check=True,
        )
        print(f"generated {path} in {time.perf_counter() - t:.1f} s")
    # As the accounting service's process does from its start (services/accounting/app.py): the start-up
    # objects frozen, the collector's thresholds raised for a ledger of hundreds of thousands of runs.
    settle_heap()
    with path.open("rb") as f:
        n = sum(1 for _ in f)
    print(
        f"log: {n:,} events ({n - NODES:,} job events + {NODES:,} registrations), "
        f"{path.stat().st_size / 1e6:.0f} MB, 200 leaf budgets, {NODES * 8:,} GPUs, 1 week"
    )
    rss0 = peak_rss_mb()

    gc.collect()
    t, c = time.perf_counter(), time.process_time()
    for _ in events_from(path):
        pass
    decode_s, decode_cpu = time.perf_counter() - t, time.process_time() - c
    print(f"decode only:        {decode_s:6.2f} s  {n / decode_s:>10,.0f} events/s  CPU {decode_cpu:.2f} s")

    gc.collect()
    t, c = time.perf_counter(), time.process_time()
    bulk = rebuild(events_from(path))
    bulk_s, bulk_cpu = time.perf_counter() - t, time.process_time() - c
    rss_bulk = peak_rss_mb()
    print(
        f"bulk rebuild:       {bulk_s:6.2f} s  {n / bulk_s:>10,.0f} events/s "
        f"(fold {max(bulk_s - decode_s, 0):.2f} s beyond decode)  target <= {TARGET_S:.0f} s"
    )
    print(f"  CPU {bulk_cpu:.2f} s (fold {bulk_cpu - decode_cpu:.2f} s beyond decode; load {os.getloadavg()[0]:.1f})")
    print(
        f"  peak RSS {rss_bulk:.0f} MB (process; {rss0:.0f} MB before the replay); "
        f"retained breakpoints {bulk.retained():,}, open runs {bulk.running():,}"
    )

    at = bulk.clock
    if at is None:
        raise SystemExit("bench_occupancy: the replay folded no event")
    bulk_answers = (bulk.occupancy_us(at), bulk.unallocated_us(at), bulk.capacity_us(at))
    del bulk
    gc.collect()
    t = time.perf_counter()
    inc = OccupancyLedger()
    apply = inc.apply
    for e in events_from(path):
        apply(e)
    inc_s = time.perf_counter() - t
    print(
        f"incremental apply:  {inc_s:6.2f} s  {n / inc_s:>10,.0f} events/s "
        f"(fold {max(inc_s - decode_s, 0):.2f} s beyond decode)  peak RSS {peak_rss_mb():.0f} MB, "
        f"retained breakpoints {inc.retained():,}"
    )

    same = inc.clock == at and ((inc.occupancy_us(at), inc.unallocated_us(at), inc.capacity_us(at)) == bulk_answers)
    print(f"incremental == bulk (exact GPU-µs): {same}")

    times = []
    for i in range(args.queries):
        q = at + i * US_PER_S
        t = time.perf_counter()
        occ = inc.occupancy(q)
        inc.unallocated(q)
        inc.capacity_gpu_s(q)
        inc.capacity_gpus(q)
        times.append(time.perf_counter() - t)
    times.sort()
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    print(
        f"full query ({len(occ)} paths: 200 leaves + ancestors; occupancy, unallocated, "
        f"capacity): p50 {statistics.median(times) * 1e3:.3f} ms  p99 {p99 * 1e3:.3f} ms"
    )
    total = sum(occ[p] for p in occ if "/" not in p)
    cap = inc.capacity_gpu_s(at)
    print(
        f"sanity: allocated {total / cap:.1%} + unallocated "
        f"{sum(v for p, v in inc.unallocated(at).items() if '/' not in p) / cap:.1%} "
        f"of capacity {cap / 3600:,.0f} GPU-h in the window"
    )

    ok = same and bulk_s <= TARGET_S
    if not ok:
        print("MISSED: bulk rebuild over target or paths disagree", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
