#!/usr/bin/env python3
"""N jobs as one job array against N records, on the live stack with every security layer on.

Starts a local Kafka and Redis (or uses ``KAFKA_BOOTSTRAP``/``REDIS_URL``) and the four services as
processes (those of ``bench_live.py``), on one fresh topic namespace and enough simulated 8-GPU nodes for
N one-GPU jobs. Then, alternated (array, records, array, records, ...: ``--rounds``), it submits N jobs of
2 s of simulated work, signed, either as one ``JobSubmitted`` with ``array`` ``0-(N-1)`` or as N records,
and prints per run:

* submissions/s at the client: N over the wall time to build, sign, send and flush what it submits;
* placements/s: N over the wall time from the first submission to the N-th ``JobPlaced`` seen;
* CPU seconds per 1,000 placed jobs of the broker and of the four services, over the same span.

Each run waits for every ``JobCompleted`` of its jobs (and 2 s more) before the next one starts, so each
finds the cluster idle and the services caught up.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2000, help="jobs per run (default 2,000)")
    ap.add_argument("--rounds", type=int, default=2, help="array/records pairs, alternated (default 2)")
    ap.add_argument("--keep", action="store_true", help="keep the data folder (logs, broker and agent data)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from scratch import scratch_dir

    with scratch_dir("apportion-bench-arrays-", args.keep) as tmp:
        return measure(args, tmp)


def measure(args: argparse.Namespace, tmp: Path) -> int:
    """The runs of :func:`main`'s arguments ``args``, with their data (broker, logs, journals) in ``tmp``."""
    from bench_live import CommandWatcher, CpuBudget, start_services

    class Watcher(CommandWatcher):
        """``bench_live``'s watcher, also timing each job's first ``JobCompleted``."""

        KINDS = (*CommandWatcher.KINDS, "JobCompleted")

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.bus.stack import LocalStack
    from apportion.cli.stack import dev_keyring
    from apportion.identity.keys import Identity
    from apportion.settings import topic_name
    from apportion.topics import COMMANDS, JOBS, NODES

    stack = None
    bootstrap, redis_url = os.environ.get("KAFKA_BOOTSTRAP"), os.environ.get("REDIS_URL")
    if not (bootstrap and redis_url):
        stack = LocalStack(tmp / "stack").start()
        bootstrap, redis_url = stack.bootstrap, stack.redis_url
    ns = f"bencharr{uuid.uuid4().hex[:6]}."
    os.environ["APPORTION_TOPIC_PREFIX"] = ns
    provision(bootstrap)
    env = dict(
        os.environ,
        APPORTION_KAFKA_BOOTSTRAP=bootstrap,
        APPORTION_REDIS_URL=redis_url,
        APPORTION_TOPIC_PREFIX=ns,
        APPORTION_LOG_LEVEL="WARNING",
        APPORTION_KEYRING=str(dev_keyring(tmp / "keyring")),
        # the node agent's journal and the policy's data folders: in tmp, removed with it
        APPORTION_STATE_DIR=str(tmp / "node_agent"),
        APPORTION_FAUST_DIR=str(tmp),
    )
    n = args.jobs
    nodes = (n + 7) // 8 + 1
    procs: dict[str, subprocess.Popen[bytes]] = {}
    producer = EventProducer(bootstrap, client_id="bench-arrays", linger_ms=0)
    rows: list[tuple[str, float, float, float, float]] = []
    try:
        now = datetime.now(UTC)
        for path, share in (("bench", 1.0), ("bench/a", 1.0)):
            producer.publish(events.BudgetSet(path=path, share=share, ts=now, producer="bench"))
        signer = Identity.generate("bench")
        producer.publish(
            events.UserKeyRegistered(user="bench", public_key=signer.public_key, by="bench", ts=now, producer="bench")
        )
        watcher = Watcher(bootstrap, [topic_name(COMMANDS), topic_name(JOBS), topic_name(NODES)])
        watcher.start()
        procs = start_services(env, tmp / "logs", nodes)
        print(
            f"stack {bootstrap}; namespace {ns}; {nodes} simulated nodes x 8 GPUs; logs in {tmp / 'logs'}{'' if args.keep else ' (removed at the end; --keep)'}"
        )
        deadline = time.perf_counter() + 180
        while watcher.count("NodeRegistered") < nodes:
            if time.perf_counter() > deadline:
                print(f"FAIL: only {watcher.count('NodeRegistered')} of {nodes} nodes registered within 180 s")
                return 1
            time.sleep(0.05)

        def record(job_id: str, array: str | None) -> events.JobSubmitted:
            t = datetime.now(UTC)
            return signer.sign(
                events.JobSubmitted(
                    job_id=job_id, budget="bench/a", user="bench", gpus_per_replica=1, min_runtime_s=60,
                    duration_s=2.0, submitted_at=t, ts=t, producer="bench", array=array,
                )
            )  # fmt: skip

        probe = record("probe", None)
        producer.send(probe)
        producer.flush()
        if watcher.wait_for(("JobPlaced", "probe"), 120) is None:
            print("FAIL: the stack did not place a probe job within 120 s")
            return 1
        broker = [pid for pid in [stack.node_pid(1) if stack is not None else None] if pid is not None]
        cpu = CpuBudget({**{name: [p.pid] for name, p in procs.items()}, "broker": broker})
        done: list[str] = []
        for r in range(args.rounds):
            for kind in ("array", "records"):
                tag = f"{kind[0]}{r}"
                ids = [f"{tag}_{i}" for i in range(n)]
                end = time.perf_counter() + 300
                while not all(("JobCompleted", j) in watcher.seen for j in done) and time.perf_counter() < end:
                    time.sleep(0.1)  # the previous run's jobs (2 s each) have ended: an idle cluster
                time.sleep(2.0)
                cpu0 = cpu.sample()
                t0 = time.perf_counter()
                if kind == "array":
                    producer.send(record(tag, f"0-{n - 1}"))
                else:
                    for job_id in ids:
                        producer.send(record(job_id, None))
                producer.flush()
                t_pub = time.perf_counter() - t0
                end = time.perf_counter() + 300
                while not all(("JobPlaced", j) in watcher.seen for j in ids) and time.perf_counter() < end:
                    time.sleep(0.02)
                placed = [watcher.seen[("JobPlaced", j)] for j in ids if ("JobPlaced", j) in watcher.seen]
                if len(placed) < n:
                    print(f"FAIL: {kind}: {len(placed)} of {n} placed within 300 s")
                    return 1
                span = max(placed) - t0
                per = cpu.per_1000(cpu0, cpu.sample(), n)
                rows.append((kind, n / t_pub, n / span, per["broker"], per["total"] - per["broker"]))
                done = ids
                print(
                    f"{kind:8} {n} jobs: client {n / t_pub:>9,.0f} submissions/s ({t_pub * 1000:.0f} ms); "
                    f"{n / span:>6,.0f} placements/s ({span:.2f} s to the last JobPlaced; load average "
                    f"{os.getloadavg()[0]:.1f}); CPU s per 1,000 to the last JobPlaced: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in per.items()),
                    flush=True,
                )
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        producer.close()
        if stack is not None:
            stack.stop()
    for kind in ("array", "records"):
        mine = [r for r in rows if r[0] == kind]
        if mine:
            lo, hi = min(r[2] for r in mine), max(r[2] for r in mine)
            print(f"{kind}: placements/s {lo:,.0f}-{hi:,.0f} over {len(mine)} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
