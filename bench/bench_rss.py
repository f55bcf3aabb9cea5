#!/usr/bin/env python3
"""Resident memory of each service over a long steady run: the slope and the growth over the second half.

Starts its own Kafka and Redis and the four services (the stack of ``bench/chaos.py``, without the chaos)
on an accelerated clock, then for ``--duration-s`` wall seconds submits short jobs at ``--rate`` per
second (1-4 GPUs, 1-5 event-minutes) on 8 simulated nodes, while heartbeats flow. Every ``--every-s``
it samples each service's ``VmRSS`` (``/proc/<pid>/status``). Printed per service: RSS at the start of
the second half and at the end, the growth over the second half, and the least-squares slope over the
second half in MiB/h (the first half is warm-up: imports, caches, the window filling).

Each submission is signed by the bench's user (a key ops registered) and the node agent signs its reports
with the keys of a development keyring of the bench's own (rule D10.proven-user), so the jobs are placed, run
and complete: unsigned, the dispatcher would reject every one and the run would measure an idle stack. At
the end the log is read and the jobs' outcomes are printed (completed, rejected, dead letters); a run in
which fewer than 90% of the submissions completed fails, as a run in which a service exited.

The issue's target: flat within 10% over the second half. Exit 1 when a service grows more than that.
At the default 1,440x clock a 300 s run covers five event-days, so the dispatcher's de-duplication
state and the agent's ended set reach their steady size (window: ``APPORTION_WINDOW_S``, one day here,
filled after 60 wall seconds). The figures in docs/reliability.md are of a 20-minute run (20 event-days):
``.venv/bin/python bench/bench_rss.py --duration-s 1200``.
Run: ``.venv/bin/python bench/bench_rss.py [--duration-s 300] [--rate 5] [--time-scale 1440]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from pathlib import Path

from scratch import scratch_dir

from apportion.settings import topic_name

HERE = Path(__file__).resolve().parent
GROWTH_MAX = 0.10
#: least share of the submissions that must complete for the run to count (the rest may still be running)
COMPLETED_MIN = 0.90
#: the dispatcher's lease, wall seconds
LEASE_TTL_WALL_S = 15.0


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def slope_per_h(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(wall s, MiB)`` samples, MiB per hour."""
    n = len(samples)
    if n < 2:
        return 0.0
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    sxx = sum((t - mx) ** 2 for t, _ in samples)
    sxy = sum((t - mx) * (v - my) for t, v in samples)
    return 3600.0 * sxy / sxx if sxx else 0.0


def job_outcomes(bootstrap: str) -> dict[str, int]:
    """Counts of the jobs' final events on the log (``JobCompleted``, ``JobRejected``, ``JobFailed``, one per
    job) and of the dead letters (``deadletter``), read after the services stopped."""
    from apportion import events, topics
    from apportion.bus.reader import iter_topic_records

    final: dict[str, str] = {}
    for r in iter_topic_records(bootstrap, [topic_name(topics.JOBS)]):
        if isinstance(r.event, (events.JobCompleted, events.JobRejected, events.JobFailed)):
            final[r.event.job_id] = r.event.type
    counts: dict[str, int] = {}
    for kind in final.values():
        counts[kind] = counts.get(kind, 0) + 1
    counts["deadletter"] = sum(1 for _ in iter_topic_records(bootstrap, [topic_name(topics.DEADLETTER)], decode=False))
    return counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--rate", type=float, default=5.0, help="submissions per wall second")
    ap.add_argument("--every-s", type=float, default=5.0)
    ap.add_argument("--time-scale", type=float, default=1440.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--trace",
        default="",
        help="services to run under tracemalloc (comma-separated): the lines that grew over the second half "
        "are printed (slower; for finding what grows, not for the figures)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the data folder (logs, broker data, snapshots)")
    a = ap.parse_args()
    with scratch_dir("apportion-bench-rss-", a.keep) as root:
        return measure(a, root)


def measure(a: argparse.Namespace, root: Path) -> int:
    """The run of :func:`main`'s arguments ``a`` with its data (logs, broker, snapshots) in ``root``."""
    sys.path.insert(0, str(HERE))
    from chaos import SERVICES, open_stack, raise_on_sigterm

    from apportion import events as ev
    from apportion.bus.producer import EventProducer
    from apportion.cli.stack import dev_keyring
    from apportion.client import key_registration
    from apportion.identity.keys import Identity

    raise_on_sigterm()  # a SIGTERM stops the services, the broker and Redis through the finally below
    rng = random.Random(a.seed)
    user = Identity.generate("u")
    (root / "logs").mkdir()
    ring = str(dev_keyring(root / "keyring"))  # the node agent registers and signs with its nodes' keys there
    local, stack, clock = open_stack(
        root, f"rss{uuid.uuid4().hex[:6]}.", a.time_scale, APPORTION_WINDOW_S="86400", APPORTION_KEYRING=ring
    )
    # a long run on a shared machine: a 3 s lease lapses under load, and each take-over rebuilds the state
    stack.lease_ttl_wall_s = LEASE_TTL_WALL_S
    traced = [t for t in a.trace.split(",") if t]
    for name in traced:
        stack.traced[name] = (root / "tracemalloc" / name, a.every_s)
    producer: EventProducer | None = None
    samples: dict[str, list[tuple[float, float]]] = {s: [] for s in SERVICES}
    outcomes: dict[str, int] = {}
    try:  # from here on, whatever fails stops the services, the broker and Redis
        producer = EventProducer(local.bootstrap, client_id="bench-rss")
        for path, share in (("lab", 1.0), ("lab/a", 0.5), ("lab/b", 0.5)):
            producer.publish(ev.BudgetSet(path=path, share=share, ts=clock.now(), producer="bench"))
        producer.publish(key_registration(user.user, user.public_key, by="ops", now=clock.now()))
        for name in SERVICES:
            stack.start(name)
        t0 = time.monotonic()
        next_sample = t0
        i = 0
        while (now := time.monotonic()) - t0 < a.duration_s:
            while i < (now - t0) * a.rate:
                ts = clock.now()
                g = rng.choice([1, 1, 2, 4])
                dur = float(rng.randint(60, 300))
                producer.send(
                    user.sign(ev.JobSubmitted(
                        job_id=f"r{i:07d}", budget=rng.choice(["lab/a", "lab/b"]), user="u", gpus_per_replica=g,
                        min_runtime_s=0.0 if rng.random() < 0.3 else 60.0, duration_s=dur, submitted_at=ts, ts=ts,
                        producer="bench",
                    ))
                )  # fmt: skip
                i += 1
            if now >= next_sample:
                for name, p in stack.procs.items():
                    v = rss_mib(p.pid)
                    if v is not None:
                        samples[name].append((now - t0, v))
                next_sample += a.every_s
            time.sleep(0.02)  # pacing of the load generator
        producer.flush(60)
    finally:
        exited = {n: p.poll() for n, p in stack.procs.items() if p.poll() is not None}
        stack.stop()
        if producer is not None:
            producer.close()
        try:
            outcomes = job_outcomes(local.bootstrap)
        finally:
            local.stop()
    print(
        f"bench_rss: {a.duration_s:.0f} s at {a.time_scale:g}x ({a.duration_s * a.time_scale / 86400:.1f} event-days, "
        f"window 1 day), {i} submissions; RSS per service over the second half:"
    )
    done = outcomes.get("JobCompleted", 0)
    print(
        f"  jobs: {done} completed, {outcomes.get('JobRejected', 0)} rejected, {outcomes.get('JobFailed', 0)} failed, "
        f"{outcomes.get('deadletter', 0)} dead letters (of {i} submitted)"
    )
    ok = not exited and done >= COMPLETED_MIN * i
    for name in SERVICES:
        half = [(t, v) for t, v in samples[name] if t >= a.duration_s / 2]
        if len(half) < 2:
            print(f"  {name:11s} too few samples")
            ok = False
            continue
        first, last = half[0][1], half[-1][1]
        growth = (last - first) / first
        ok &= growth <= GROWTH_MAX
        print(
            f"  {name:11s} {first:6.1f} -> {last:6.1f} MiB ({growth:+.1%}), slope {slope_per_h(half):+7.1f} MiB/h"
            f"{'' if growth <= GROWTH_MAX else '  (over the 10% target)'}"
        )
    for name in traced:  # the snapshot nearest the half against the last one
        snaps = sorted((root / "tracemalloc" / name).glob("snap-*.pickle"))
        if len(snaps) >= 2:
            from tracemalloc_run import growth as grown_allocations

            print(f"  {name}: allocations that grew over the second half ({len(snaps)} snapshots):")
            for line in grown_allocations(snaps[len(snaps) // 2], snaps[-1]):
                print(f"    {line}")
    if exited:
        print(f"  services that exited: {exited}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
