#!/usr/bin/env python3
"""Live stack benchmarks (DESIGN section 9): latency, throughput, accounting ingest.

Starts a local Kafka and Redis (or uses ``KAFKA_BOOTSTRAP``/``REDIS_URL``), a
fresh topic namespace, and the services as processes on the wall clock:

1. **submit-to-StartWorkload latency** on an idle cluster: one submission at
   a time (1 GPU, 1 s simulated run), wall time from the producer's ack to
   the ``StartWorkload`` arriving at a consumer of ``apportion.commands``.
   Target p50 <= 100 ms.
2. **sustained throughput**: N submissions published as fast as the producer
   goes; placements/s = N / (time of the N-th ``JobPlaced`` - time of the
   first submission). Target >= 1,000 jobs/s on 2 cores.
3. **accounting ingest**: M job events produced to the jobs topic; the raw
   kafka-python consume rate of that topic, then the accounting service's
   start-up rebuild of the same log (read + decode + fold), in one run.
   Target: accounting >= 50% of the raw rate (kafka-python as shipped, with
   its pure-Python CRC-32C). Also printed: the same read with the compiled
   CRC-32C every service uses (:func:`apportion.bus.crc.use_compiled_crc32c`),
   a stricter baseline the target does not name.

Every connection is TLS (Kafka SASL_SSL, Redis ``rediss://``: DESIGN section
10). ``--no-tls`` runs the same stack with the same authentication and ACLs
without TLS (``APPORTION_NO_TLS=1``, development only); ``--tls-cost`` runs
both, one after the other, and prints each figure with and without TLS side
by side.

Prints figures; exits 1 when a target is missed. Sizes: ``--jobs``,
``--events``; ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from apportion.settings import topic_name

REPO = Path(__file__).resolve().parents[1]


class CommandWatcher(threading.Thread):
    """Records the wall time each StartWorkload (by job id) and JobPlaced arrives."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        super().__init__(daemon=True)
        from kafka import KafkaConsumer, TopicPartition

        from apportion.bus.producer import READ_COMMITTED
        from apportion.bus.security import kafka_auth

        self.kc = KafkaConsumer(
            bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, **READ_COMMITTED, **kafka_auth()
        )
        parts = [TopicPartition(t, p) for t in topics for p in sorted(self.kc.partitions_for_topic(t) or ())]
        self.kc.assign(parts)
        self.kc.seek_to_end()
        for tp in parts:
            self.kc.position(tp)
        self.seen: dict[tuple[str, str], float] = {}
        self.stop = threading.Event()
        self.cond = threading.Condition()

    def run(self) -> None:
        import json

        while not self.stop.is_set():
            batch = self.kc.poll(timeout_ms=20)
            now = time.perf_counter()
            with self.cond:
                for recs in batch.values():
                    for r in recs:
                        d = json.loads(r.value)
                        if d.get("type") in ("StartWorkload", "JobPlaced", "JobRejected"):
                            self.seen.setdefault((d["type"], d["job_id"]), now)
                        elif d.get("type") == "NodeRegistered":
                            self.seen.setdefault((d["type"], d["node_id"]), now)
                self.cond.notify_all()
        self.kc.close()

    def wait_for(self, key: tuple[str, str], timeout: float) -> float | None:
        end = time.perf_counter() + timeout
        with self.cond:
            while key not in self.seen:
                left = end - time.perf_counter()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.seen[key]

    def count(self, kind: str) -> int:
        with self.cond:
            return sum(1 for k in self.seen if k[0] == kind)


def start_services(env: dict[str, str], logs: Path, nodes: int) -> list[subprocess.Popen[bytes]]:
    logs.mkdir(parents=True, exist_ok=True)
    cmds = [
        ["services.dispatcher", "--heartbeat-timeout-s", "600", "--tick-wall-s", "0.2"],
        [
            "services.node_agent",
            "--sim-nodes",
            str(nodes),
            "--gpus-per-node",
            "8",
            "--node-prefix",
            "b",
            "--heartbeat-interval-s",
            "60",
        ],
        ["services.accounting", "--snapshot-debounce-wall-s", "1.0"],
        ["services.policy"],
    ]
    procs = []
    for cmd in cmds:
        f = open(logs / f"{cmd[0].split('.')[1]}.log", "ab")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", *cmd], env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=f, stderr=f
            )
        )
    return procs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-jobs", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=5000, help="submissions for the throughput run")
    ap.add_argument("--events", type=int, default=200_000, help="job events for the accounting ingest run")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--ingest-only", action="store_true", help="only the accounting ingest (3), not the services")
    tls = ap.add_mutually_exclusive_group()
    tls.add_argument("--no-tls", action="store_true", help="Kafka SASL_PLAINTEXT and plaintext Redis (development)")
    tls.add_argument("--tls-cost", action="store_true", help="run with TLS, then without; print both side by side")
    args = ap.parse_args()
    if args.quick:
        args.latency_jobs, args.jobs, args.events = 30, 500, 20_000
    if not args.tls_cost:
        return 0 if bench(args, tls=not args.no_tls, figures={}) else 1
    with_tls: dict[str, float] = {}
    without: dict[str, float] = {}
    print("== with TLS")
    ok = bench(args, tls=True, figures=with_tls)
    print("== without TLS (APPORTION_NO_TLS=1)")
    bench(args, tls=False, figures=without)
    print(tls_cost_table(with_tls, without))
    return 0 if ok else 1


#: How each figure reads, and whether more is better (the sign of TLS's cost).
FIGURES = {
    "latency_p50_ms": ("submit-to-StartWorkload p50, ms", False),
    "latency_p99_ms": ("submit-to-StartWorkload p99, ms", False),
    "placements_per_s": ("sustained placements/s", True),
    "broker_cpu_s_per_1000": ("broker CPU s per 1,000 placed", False),
    "services_cpu_s_per_1000": ("services' CPU s per 1,000 placed", False),
    "raw_consume_per_s": ("raw kafka-python consume, events/s", True),
    "accounting_per_s": ("accounting rebuild, events/s", True),
}


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (``/proc/PID/stat``; a gone one counts 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime and stime, fields 14 and 15 of proc(5)
    return total


def tls_cost_table(with_tls: dict[str, float], without: dict[str, float]) -> str:
    """The figures of both runs and what TLS costs in each, one line per figure both runs measured."""
    lines = [f"{'figure':<40} {'with TLS':>12} {'without':>12} {'TLS costs':>10}"]
    for key, (label, more_is_better) in FIGURES.items():
        if key not in with_tls or key not in without:
            continue
        a, b = with_tls[key], without[key]
        cost = (b - a) / b if more_is_better else (a - b) / b
        lines.append(f"{label:<40} {a:>12,.2f} {b:>12,.2f} {100 * cost:>9.0f}%")
    return "\n".join(lines)


def bench(args: argparse.Namespace, *, tls: bool, figures: dict[str, float]) -> bool:
    """One run of the benchmarks on a fresh local stack (with TLS or without); fills ``figures``; true when every
    target is met."""
    if tls:
        os.environ.pop("APPORTION_NO_TLS", None)
    else:
        os.environ["APPORTION_NO_TLS"] = "1"  # infra/ starts the servers without TLS; the clients follow

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.bus.stack import LocalStack
    from apportion.cli.stack import dev_keyring
    from apportion.sim.report import percentile
    from apportion.topics import COMMANDS, JOBS, NODES

    tmp = Path(tempfile.mkdtemp(prefix="apportion-bench-"))
    stack = None
    bootstrap, redis_url = os.environ.get("KAFKA_BOOTSTRAP"), os.environ.get("REDIS_URL")
    if not (bootstrap and redis_url):
        stack = LocalStack(tmp / "stack").start()
        bootstrap, redis_url = stack.bootstrap, stack.redis_url
    if args.ingest_only:
        ok = accounting_ingest(bootstrap, redis_url, args.events, figures)
        if stack is not None:
            stack.stop()
        return ok
    ns = f"bench{uuid.uuid4().hex[:6]}."
    os.environ["APPORTION_TOPIC_PREFIX"] = ns
    provision(bootstrap)
    env = dict(
        os.environ,
        APPORTION_KAFKA_BOOTSTRAP=bootstrap,
        APPORTION_REDIS_URL=redis_url,
        APPORTION_TOPIC_PREFIX=ns,
        APPORTION_LOG_LEVEL="WARNING",
        # the node agent signs every report with its nodes' keys, made and registered here on first use
        APPORTION_KEYRING=str(dev_keyring(tmp / "keyring")),
    )
    nodes = max(8, (args.jobs + 7) // 8 + 1)
    ok = True
    procs: list[subprocess.Popen[bytes]] = []
    producer = EventProducer(bootstrap, client_id="bench", linger_ms=0)
    try:
        now = datetime.now(UTC)
        for path, share in (("bench", 1.0), ("bench/a", 0.5), ("bench/b", 0.5)):
            producer.publish(events.BudgetSet(path=path, share=share, ts=now, producer="bench"))
        from apportion.identity import Identity

        signer = Identity.generate("bench")  # registered as ops would; every submission is signed with it
        producer.publish(
            events.UserKeyRegistered(user="bench", public_key=signer.public_key, by="bench", ts=now, producer="bench")
        )
        watcher = CommandWatcher(bootstrap, [topic_name(COMMANDS), topic_name(JOBS), topic_name(NODES)])
        watcher.start()
        procs = start_services(env, tmp / "logs", nodes)
        print(f"stack {bootstrap}; namespace {ns}; {nodes} simulated nodes x 8 GPUs; logs in {tmp / 'logs'}")

        # wait for the nodes (admission rejects shapes no registered node can hold), then a probe job
        deadline = time.perf_counter() + 120
        while watcher.count("NodeRegistered") < nodes:
            if time.perf_counter() > deadline:
                print(f"FAIL: only {watcher.count('NodeRegistered')} of {nodes} nodes registered within 120 s")
                return False
            time.sleep(0.05)

        def submit(job_id: str, budget: str, duration: float, gpus: int = 1) -> None:
            t = datetime.now(UTC)
            producer.send(
                signer.sign(  # the dispatcher checks every signature (docs/security.md)
                    events.JobSubmitted(
                        job_id=job_id,
                        budget=budget,
                        user="bench",
                        gpus_per_replica=gpus,
                        min_runtime_s=60,
                        duration_s=duration,
                        submitted_at=t,
                        ts=t,
                        producer="bench",
                    )
                )
            )

        submit("probe", "bench/a", 1.0)
        producer.flush()
        if watcher.wait_for(("StartWorkload", "probe"), 120) is None:
            print("FAIL: the stack did not place a probe job within 120 s")
            return False

        # ---- 1. latency on an idle cluster
        lat = []
        for i in range(args.latency_jobs):
            jid = f"lat{i}"
            submit(jid, "bench/a" if i % 2 else "bench/b", 1.0)
            producer.flush()
            t0 = time.perf_counter()
            t1 = watcher.wait_for(("StartWorkload", jid), 30)
            if t1 is None:
                print(f"FAIL: no StartWorkload for {jid} within 30 s")
                return False
            lat.append((t1 - t0) * 1000)
        p50, p99 = statistics.median(lat), percentile(lat, 99)
        figures["latency_p50_ms"] = p50
        if p99 is not None:  # percentile of a non-empty list
            figures["latency_p99_ms"] = p99
        print(
            f"submit-to-StartWorkload latency over {len(lat)} jobs: p50 {p50:.1f} ms, p99 {p99:.1f} ms "
            f"(target p50 <= 100 ms)"
        )
        ok &= p50 <= 100

        # ---- 2. sustained throughput
        base = watcher.count("JobPlaced")
        broker = [pid for pid in [stack.node_pid(1) if stack is not None else None] if pid is not None]
        services = [p.pid for p in procs]
        cpu0 = (cpu_seconds(broker), cpu_seconds(services))
        t0 = time.perf_counter()
        for i in range(args.jobs):
            submit(f"thr{i}", "bench/a" if i % 2 else "bench/b", 3600.0)
        producer.flush()
        t_pub = time.perf_counter() - t0
        last = watcher.wait_for(("JobPlaced", f"thr{args.jobs - 1}"), 600)
        deadline = time.perf_counter() + 600
        while watcher.count("JobPlaced") < base + args.jobs and time.perf_counter() < deadline:
            time.sleep(0.05)
        placed = watcher.count("JobPlaced") - base
        broker_cpu, services_cpu = cpu_seconds(broker) - cpu0[0], cpu_seconds(services) - cpu0[1]
        t_end = max(v for k, v in watcher.seen.items() if k[0] == "JobPlaced")
        rate = placed / (t_end - t0) if last else 0.0
        figures["placements_per_s"] = rate
        print(
            f"sustained: {args.jobs} submissions published in {t_pub:.2f} s ({args.jobs / t_pub:,.0f}/s); "
            f"{placed} placed in {t_end - t0:.2f} s -> {rate:,.0f} placements/s (target >= 1,000/s)"
        )
        if placed and broker:
            figures["broker_cpu_s_per_1000"] = 1000 * broker_cpu / placed
            figures["services_cpu_s_per_1000"] = 1000 * services_cpu / placed
            print(
                f"  CPU per 1,000 placed jobs (from the first submission until the last placement was seen): broker "
                f"{figures['broker_cpu_s_per_1000']:.2f} s, the four services "
                f"{figures['services_cpu_s_per_1000']:.2f} s"
            )
        ok &= rate >= 1000
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        producer.close()

    # ---- 3. accounting ingest vs raw consume, on a fresh namespace
    ok &= accounting_ingest(bootstrap, redis_url, args.events, figures)
    if stack is not None:
        stack.stop()
    print("all targets met" if ok else "SOME TARGETS MISSED")
    return ok


def accounting_ingest(bootstrap: str, redis_url: str, n: int, figures: dict[str, float]) -> bool:
    """Produce ``n`` job events, then time raw consumption and the accounting rebuild of them."""
    from kafka import KafkaConsumer, TopicPartition

    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.clock import WallClock
    from apportion.topics import JOBS
    from services.accounting.app import run as run_accounting
    from services.accounting.config import AccountingSettings

    os.environ["APPORTION_TOPIC_PREFIX"] = f"ingest{uuid.uuid4().hex[:6]}."
    provision(bootstrap)
    producer = EventProducer(bootstrap, client_id="bench-ingest", linger_ms=20, batch_size=256 * 1024)
    t = datetime(2026, 1, 1, tzinfo=UTC)
    dec = events.Decision(rank=0, budget_rank=0, ratio=0.0)
    from datetime import timedelta

    from apportion.domain.admission import DISPATCHER, node_principal
    from apportion.identity import BatchSigner, Identity

    # each node's key and the dispatcher's, registered as ops would: the accounting checks the signature of every
    # placement (the dispatcher's) and every completion (its node's)
    keys = {f"n{k:03d}": Identity.generate(node_principal(f"n{k:03d}")) for k in range(100)}
    dispatcher = Identity.generate(DISPATCHER)
    for ident in (dispatcher, *keys.values()):
        producer.send(events.UserKeyRegistered(user=ident.user, public_key=ident.public_key, ts=t, producer="bench"))
    signer = BatchSigner(dispatcher)
    per_batch = 16  # as the dispatcher signs a busy cycle: 32 records per signature, a JobPlaced and its StartWorkload
    for lo in range(0, n // 2, per_batch):
        placed: list[events.JobPlaced] = []
        values: list[bytes] = []
        for j in range(lo, min(lo + per_batch, n // 2)):
            ts = t + timedelta(seconds=j)
            node = f"n{j % 100:03d}"
            ev = events.JobPlaced(
                job_id=f"j{j}",
                attempt=1,
                budget="lab/a" if j % 2 else "lab/b",
                allocated=True,
                gpus_per_replica=1,
                replicas=1,
                min_runtime_s=60,
                placements=(events.Placement(node_id=node, gpus=(j % 8,)),),
                submitted_at=ts,
                decision=dec,
                ts=ts,
                producer="dispatcher",
            )
            start = events.StartWorkload(node_id=node, job_id=f"j{j}", attempt=1, gpus=(j % 8,), ts=ts)
            placed.append(ev)
            values += [events.encode(ev), events.encode(start)]
        signed = signer.values(values)  # the commands go to apportion.commands, which the accounting does not read
        for k, ev in enumerate(placed):
            producer.send(ev, signed[2 * k])
            node = ev.placements[0].node_id
            done = events.JobCompleted(
                job_id=ev.job_id, attempt=1, replica=0, node_id=node, ts=ev.ts + timedelta(seconds=1), producer="bench"
            )
            producer.send(done, keys[node].signed_value(done))
    producer.flush()
    producer.close()

    from apportion.bus.producer import READ_COMMITTED
    from apportion.bus.security import kafka_auth

    def raw_consume() -> tuple[int, float, float]:
        """``(records, wall s, CPU s)`` of a plain kafka-python read of the topic from offset 0 to its end."""
        kc = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=None,
            enable_auto_commit=False,
            max_partition_fetch_bytes=8 * 1024 * 1024,
            **READ_COMMITTED,
            **kafka_auth(),
        )
        parts = [TopicPartition(topic_name(JOBS), p) for p in sorted(kc.partitions_for_topic(topic_name(JOBS)))]
        kc.assign(parts)
        kc.seek_to_beginning()
        end = kc.end_offsets(parts)
        t0, c0 = time.perf_counter(), time.process_time()
        got = 0
        while any(kc.position(tp) < end[tp] for tp in parts):
            for recs in kc.poll(timeout_ms=500, max_records=10_000).values():
                got += len(recs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        kc.close()
        return got, wall, cpu

    # the baseline: kafka-python as shipped (its pure-Python CRC-32C; put back should anything have swapped it)
    import kafka.record.default_records as kafka_records
    import kafka.record.util as kafka_util

    kafka_records.calc_crc32c = kafka_util.calc_crc32c
    got, raw, raw_cpu = raw_consume()

    settings = AccountingSettings(kafka_bootstrap=bootstrap, redis_url=redis_url, log_json=False, snapshot_interval_s=0)

    async def timed() -> float:
        stop, ready = asyncio.Event(), asyncio.Event()
        t1 = time.perf_counter()
        task = asyncio.create_task(run_accounting(settings, stop, clock=WallClock(), ready=ready))
        await asyncio.wait_for(ready.wait(), 600)
        dt = time.perf_counter() - t1
        stop.set()
        await task
        return dt

    c1 = time.process_time()
    acc = asyncio.run(timed())
    acc_cpu = time.process_time() - c1
    # the stricter baseline: the same read with the compiled CRC-32C every service uses (apportion.bus.service.wire
    # swapped it in for this process when accounting started)
    from apportion.bus.crc import use_compiled_crc32c

    crc = use_compiled_crc32c()
    got_c, raw_c, raw_c_cpu = raw_consume()
    raw_rate, acc_rate = got / raw, n / acc
    figures.update(raw_consume_per_s=raw_rate, accounting_per_s=acc_rate)
    print(
        f"accounting ingest: {n:,} job events; raw kafka-python consume {raw_rate:,.0f} events/s "
        f"({raw:.2f} s); accounting start-up rebuild (read + decode + fold + first snapshot) "
        f"{acc_rate:,.0f} events/s ({acc:.2f} s) = {100 * acc_rate / raw_rate:.0f}% of raw (target >= 50%)"
    )
    # on a shared machine the wall rates swing with the load; the CPU each took (this process, every thread) less
    print(
        f"  CPU: raw consume {raw_cpu:.2f} s ({got / raw_cpu:,.0f} events/CPU-s), accounting {acc_cpu:.2f} s "
        f"({n / acc_cpu:,.0f} events/CPU-s) = {100 * raw_cpu / acc_cpu:.0f}% of raw"
    )
    print(
        f"  stricter baseline, raw consume with the compiled CRC-32C ({crc}): {got_c / raw_c:,.0f} events/s, "
        f"CPU {raw_c_cpu:.2f} s ({got_c / raw_c_cpu:,.0f} events/CPU-s); accounting = "
        f"{100 * acc_rate / (got_c / raw_c):.0f}% of it by wall, {100 * raw_c_cpu / acc_cpu:.0f}% by CPU"
    )
    return acc_rate >= 0.5 * raw_rate


if __name__ == "__main__":
    sys.exit(main())
