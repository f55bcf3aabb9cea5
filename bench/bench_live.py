#!/usr/bin/env python3
"""Live stack benchmarks (design D9, ``D9.live-stack``): latency, throughput, CPU, accounting ingest.

Starts a local Kafka and Redis (or uses ``KAFKA_BOOTSTRAP``/``REDIS_URL``), a
fresh topic namespace, and the services as processes on the wall clock:

1. **submit-to-StartWorkload latency** on an idle cluster: one submission at
   a time (1 GPU, 1 s simulated run), wall time from the producer's ack to
   the ``StartWorkload`` arriving at a consumer of ``apportion.commands``.
   Target p50 <= 15 ms. Timed after a warm-up of ``--latency-warmup``
   submissions sent the same way (the stack just started is slower: the
   broker's JIT compiles meanwhile); the warm-up's p50 is printed apart.
2. **sustained throughput**: N signed one-GPU submissions published as fast
   as the client goes; placements/s = N / (time of the N-th ``JobPlaced`` -
   time of the first submission); then the time until the N-th
   ``JobStarted`` (simulated workloads). Target >= 2,500 placements/s on 2
   cores (3x Slurm's job array: ``bench/slurm_side_by_side.py``).
   **CPU budget**: user + system CPU seconds per 1,000 jobs of each
   component (dispatcher, node agent, accounting, policy, the Kafka broker,
   Redis, the bench client), from the first submission to the moment the
   last ``JobPlaced`` arrives and to the moment the last ``JobStarted``
   does (``/proc/PID/stat`` of each process tree, read at those moments).
   The watcher that sees them is measurement, printed apart from the total.
3. **accounting ingest**: M job events produced to the jobs topic; the raw
   kafka-python consume rate of that topic, then the accounting service's
   start-up rebuild of the same log (read + decode + fold), in one run.
   Target: accounting >= 50% of the raw rate (kafka-python as shipped, with
   its pure-Python CRC-32C). Also printed: the same read with the compiled
   CRC-32C every service uses (:func:`apportion.bus.crc.use_compiled_crc32c`),
   a stricter baseline the target does not name.

Every connection is TLS (Kafka SASL_SSL, Redis ``rediss://``: rule D10.transport). ``--no-tls`` runs the same stack
with the same authentication and ACLs
without TLS (``APPORTION_NO_TLS=1``, development only); ``--tls-cost`` runs
both, one after the other, and prints each figure with and without TLS side
by side.

Prints figures (``--json``: also one JSON object on stdout, the text on
stderr); exits 1 when a target is missed. Sizes: ``--jobs``, ``--events``;
``--quick`` for a smoke run. Everything a run writes (the broker's and Redis's
data, the services' logs, the node agent's journal, the policy's data) is in
one folder in the system temp directory, removed when the run ends, however it
ends (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from apportion.settings import topic_name

REPO = Path(__file__).resolve().parents[1]


# ---- CPU budget: CPU seconds per component, sampled at chosen moments (slurm_side_by_side.py uses the same)

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_times(stat: str) -> tuple[int, float, float]:
    """``(ppid, own CPU s, reaped children's CPU s)`` from a ``/proc/PID/stat`` line (proc(5): fields 4, 14+15,
    16+17; a zombie keeps its figures until it is reaped)."""
    f = stat.rsplit(")", 1)[1].split()
    return int(f[1]), (int(f[11]) + int(f[12])) / CLK_TCK, (int(f[13]) + int(f[14])) / CLK_TCK


def proc_table() -> dict[int, tuple[int, float, float]]:
    """Every process now: pid -> ``(ppid, own CPU s, reaped children's CPU s)``."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                table[int(d)] = _proc_times(Path(f"/proc/{d}/stat").read_text())
            except (OSError, IndexError, ValueError):
                continue  # gone between the listing and the read
    return table


def descendants(roots: list[int], table: dict[int, tuple[int, float, float]] | None = None) -> list[int]:
    """``roots`` (those alive) and every live process below them."""
    table = proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def tree_cpu_seconds(roots: list[int], table: dict[int, tuple[int, float, float]] | None = None) -> float:
    """User + system CPU seconds of ``roots`` and everything they started: each live process's own and its reaped
    children's. A child that outlives its parent is counted only while it runs under a root (a subreaper root
    keeps orphans in its tree)."""
    table = proc_table() if table is None else table
    return sum(table[p][1] + table[p][2] for p in descendants(roots, table))


def thread_cpu_seconds(tid: int) -> float:
    """User + system CPU seconds of one thread of this process."""
    return _proc_times(Path(f"/proc/self/task/{tid}/stat").read_text())[1]


class CpuBudget:
    """CPU seconds each named component has used so far: the process trees of its pids, or what a function says.

    ``sample()`` reads them all at once; :func:`per_1000` turns two samples into seconds per 1,000 jobs. Components
    named in ``measurement`` (the benchmark's own observers) are printed but left out of the total."""

    def __init__(
        self,
        trees: dict[str, list[int]],
        own: dict[str, Callable[[], float]] | None = None,
        measurement: tuple[str, ...] = (),
    ) -> None:
        self.trees, self.own, self.measurement = trees, own or {}, measurement

    def sample(self) -> dict[str, float]:
        table = proc_table()
        out = {name: tree_cpu_seconds(pids, table) for name, pids in self.trees.items()}
        out.update((name, fn()) for name, fn in self.own.items())
        return out

    def per_1000(self, before: dict[str, float], after: dict[str, float], jobs: int) -> dict[str, float]:
        """CPU seconds per 1,000 jobs of each component between two samples, and their ``total`` (measurement
        left out)."""
        got = {k: 1000 * (after[k] - before[k]) / jobs for k in before}
        got["total"] = sum(v for k, v in got.items() if k not in self.measurement)
        return {k: round(v, 4) for k, v in got.items()}


def budget_table(columns: dict[str, dict[str, float]], measurement: tuple[str, ...] = ()) -> str:
    """CPU s per 1,000 jobs: one row per component, one column per moment; measurement rows marked."""
    names = list(next(iter(columns.values())))
    lines = [f"  {'CPU s per 1,000 jobs':<28}" + "".join(f"{c:>22}" for c in columns)]
    for n in names:
        label = f"{n} (measurement)" if n in measurement else n
        lines.append(f"  {label:<28}" + "".join(f"{col[n]:>22.3f}" for col in columns.values()))
    return "\n".join(lines)


class CommandWatcher(threading.Thread):
    """Records the wall time each StartWorkload, JobPlaced, JobRejected, JobStarted (by job id) and NodeRegistered
    (by node) arrives; runs a callback the moment a kind's count reaches a mark (:meth:`at_count`)."""

    KINDS: tuple[str, ...] = ("StartWorkload", "JobQueued", "JobPlaced", "JobRejected", "JobStarted")

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
        #: per key: (wall time it arrived, its Kafka record timestamp in s, its event ``ts`` as written)
        self.stamps: dict[tuple[str, str], tuple[float, float, str]] = {}
        self.counts: Counter[str] = Counter()
        self.marks: dict[tuple[str, int], Callable[[], object]] = {}
        self.marked: dict[tuple[str, int], object] = {}
        self.stop = threading.Event()
        self.cond = threading.Condition()

    def run(self) -> None:
        import json

        while not self.stop.is_set():
            batch = self.kc.poll(timeout_ms=20)
            now, wall = time.perf_counter(), time.time()
            with self.cond:
                for recs in batch.values():
                    for r in recs:
                        d = json.loads(r.value)
                        kind = d.get("type")
                        key = (kind, d["job_id"] if kind in self.KINDS else d.get("node_id"))
                        if (kind in self.KINDS or kind == "NodeRegistered") and key not in self.seen:
                            self.seen[key] = now
                            self.stamps[key] = (wall, r.timestamp / 1000, d.get("ts", ""))
                            # by kind, and by kind and id prefix ("JobPlaced:thr"): one run's records apart
                            for tally in (kind, f"{kind}:{str(key[1]).rstrip('0123456789')}"):
                                self.counts[tally] += 1
                                mark = (tally, self.counts[tally])
                                if mark in self.marks:
                                    self.marked[mark] = self.marks.pop(mark)()
                self.cond.notify_all()
        self.kc.close()

    def at_count(self, kind: str, n: int, fn: Callable[[], object]) -> None:
        """Call ``fn`` (on this thread) when the ``n``-th ``kind`` arrives (a kind, or ``kind:prefix`` for the ids
        that are the prefix and a number); its result lands in ``marked``."""
        with self.cond:
            self.marks[(kind, n)] = fn

    def wait_for(self, key: tuple[str, str], timeout: float) -> float | None:
        end = time.perf_counter() + timeout
        with self.cond:
            while key not in self.seen:
                left = end - time.perf_counter()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.seen[key]

    def wait_count(self, kind: str, n: int, timeout: float) -> bool:
        """True once ``n`` of ``kind`` arrived, false after ``timeout`` seconds."""
        end = time.perf_counter() + timeout
        with self.cond:
            while self.counts[kind] < n:
                left = end - time.perf_counter()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def count(self, kind: str) -> int:
        with self.cond:
            return self.counts[kind]

    def last(self, kind: str, prefix: str = "") -> float:
        """Wall time (``perf_counter``) the latest ``kind`` (with an id starting ``prefix``) arrived."""
        with self.cond:
            return max(v for k, v in self.seen.items() if k[0] == kind and k[1].startswith(prefix))


def start_services(env: dict[str, str], logs: Path, nodes: int) -> dict[str, subprocess.Popen[bytes]]:
    logs.mkdir(parents=True, exist_ok=True)
    cmds = {
        "dispatcher": ["services.dispatcher", "--heartbeat-timeout-s", "600", "--tick-wall-s", "0.2"],
        "node agent": [
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
        "accounting": ["services.accounting", "--snapshot-debounce-wall-s", "1.0"],
        "policy": ["services.policy"],
    }
    procs = {}
    for name, cmd in cmds.items():
        f = open(logs / f"{cmd[0].split('.')[1]}.log", "ab")
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", *cmd], env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=f, stderr=f
        )
    return procs


class StopAfter(Exception):
    """The run asked for stops here (``--latency-only``): the stack is stopped, nothing else is measured."""


class BenchError(RuntimeError):
    """The stack did not come up or did not finish a run: the message says what was missing."""


class LiveRun:
    """The four services on a fresh topic namespace of a running Kafka and Redis, with the bench's signed client,
    a :class:`CommandWatcher` and a :class:`CpuBudget` of every component (design D9, ``D9.live-stack``).

    ``broker_pid``/``redis_pid``: the servers' processes when this machine runs them (else not in the budget).
    """

    def __init__(
        self, bootstrap: str, redis_url: str, tmp: Path, nodes: int, broker_pid: int | None, redis_pid: int | None
    ) -> None:
        self.bootstrap, self.redis_url, self.tmp, self.nodes = bootstrap, redis_url, tmp, nodes
        self.broker_pid, self.redis_pid = broker_pid, redis_pid
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.producer: Any = None
        self.watcher: CommandWatcher | None = None
        self.ns = f"bench{uuid.uuid4().hex[:6]}."

    def start(self) -> LiveRun:
        from apportion import events
        from apportion.bus.producer import EventProducer
        from apportion.bus.provision import provision
        from apportion.client import client_linger_ms
        from apportion.identity.keys import Identity
        from apportion.topics import COMMANDS, JOBS, NODES

        os.environ["APPORTION_TOPIC_PREFIX"] = self.ns
        provision(self.bootstrap)
        env = self.service_env()
        # the client's own produce settings for many submissions (apportion.client.publish: linger 2 ms, then
        # one flush); the latency probes have a producer of their own with the client's setting for one
        self.producer = EventProducer(self.bootstrap, client_id="bench", linger_ms=client_linger_ms(2))
        now = datetime.now(UTC)
        for path, share in (("bench", 1.0), ("bench/a", 0.5), ("bench/b", 0.5)):
            self.producer.publish(events.BudgetSet(path=path, share=share, ts=now, producer="bench"))
        self.signer = Identity.generate("bench")  # registered as ops would; every submission is signed with it
        self.producer.publish(
            events.UserKeyRegistered(
                user="bench", public_key=self.signer.public_key, by="bench", ts=now, producer="bench"
            )
        )
        self.watcher = CommandWatcher(self.bootstrap, [topic_name(COMMANDS), topic_name(JOBS), topic_name(NODES)])
        self.watcher.start()
        self.procs = start_services(env, self.tmp / "logs", self.nodes)
        trees = {name: [p.pid] for name, p in self.procs.items()}
        trees["broker"] = [self.broker_pid] if self.broker_pid else []
        trees["redis"] = [self.redis_pid] if self.redis_pid else []
        watcher_tid = self.watcher.native_id or 0
        self.cpu = CpuBudget(
            trees,
            own={
                # this process less the watcher's thread: signing, encoding and producing the submissions
                "bench client": lambda: _self_cpu() - thread_cpu_seconds(watcher_tid),
                "watcher": lambda: thread_cpu_seconds(watcher_tid),
            },
            measurement=("watcher",),
        )
        # wait for the nodes (admission rejects shapes no registered node can hold), then a probe job
        if not self.watcher.wait_count("NodeRegistered", self.nodes, 180):
            raise BenchError(f"only {self.watcher.count('NodeRegistered')} of {self.nodes} nodes registered in 180 s")
        self.submit("probe", "bench/a", 1.0)
        self.producer.flush()
        if self.watcher.wait_for(("StartWorkload", "probe"), 120) is None:
            raise BenchError("the stack did not place a probe job within 120 s")
        return self

    def service_env(self) -> dict[str, str]:
        """The services' environment: this run's stack and topic namespace, and every folder they write in
        ``tmp`` (the node agent's keys, journal and job files, the policy's data), none in the system temp
        directory."""
        from scratch import state_env

        from apportion.cli.stack import dev_keyring

        return dict(
            os.environ,
            APPORTION_KAFKA_BOOTSTRAP=self.bootstrap,
            APPORTION_REDIS_URL=self.redis_url,
            APPORTION_TOPIC_PREFIX=self.ns,
            APPORTION_LOG_LEVEL="WARNING",
            # the node agent signs every report with its nodes' keys, made and registered here on first use
            APPORTION_KEYRING=str(dev_keyring(self.tmp / "keyring")),
            **state_env(self.tmp),
        )

    def submit(
        self, job_id: str, budget: str, duration: float, gpus: int = 1, array: str | None = None, producer: Any = None
    ) -> None:
        """One signed submission; with ``array`` (Slurm's index expression), one record for the array's jobs;
        ``producer``: another than the run's (the latency probes')."""
        from apportion import events

        t = datetime.now(UTC)
        (producer or self.producer).send(
            self.signer.sign(  # the dispatcher checks every signature (docs/security.md)
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
                    array=array,
                )
            )
        )

    def close(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.watcher is not None:
            self.watcher.stop.set()
            self.watcher.join(5)
        if self.producer is not None:
            self.producer.close()


def _self_cpu() -> float:
    return _proc_times(Path("/proc/self/stat").read_text())[1]


def throughput(run: LiveRun, jobs: int, timeout: float = 600, *, array: bool = False) -> dict[str, Any]:
    """``jobs`` one-GPU submissions published as fast as the client goes, then waited for until every one is
    placed and started (simulated workloads). Placements/s = jobs / (N-th ``JobPlaced`` - first submission); the
    CPU budget is sampled at the first submission and the moments the last ``JobPlaced`` and the last
    ``JobStarted`` arrive. ``array``: the jobs as one job array (one signed record, elements ``thra_0`` ...).
    Raises :class:`BenchError` when they do not all arrive within ``timeout`` s."""
    w = run.watcher
    assert w is not None
    tag = "thra_" if array else "thr"  # this run's jobs only, not a late latency probe's
    placed, started = f"JobPlaced:{tag}", f"JobStarted:{tag}"
    placed0, started0 = w.count(placed), w.count(started)
    w.at_count(placed, placed0 + jobs, run.cpu.sample)
    w.at_count(started, started0 + jobs, run.cpu.sample)
    cpu0 = run.cpu.sample()
    t0 = time.perf_counter()
    if array:
        run.submit("thra", "bench/a", 3600.0, array=f"0-{jobs - 1}")
    for i in range(0 if array else jobs):
        run.submit(f"thr{i}", "bench/a" if i % 2 else "bench/b", 3600.0)
    run.producer.flush()
    t_pub = time.perf_counter() - t0
    if not w.wait_count(placed, placed0 + jobs, timeout):
        raise BenchError(f"{w.count(placed) - placed0} of {jobs} placed in {timeout:.0f} s")
    t_placed = w.last("JobPlaced", tag) - t0
    if not w.wait_count(started, started0 + jobs, timeout):
        raise BenchError(f"{w.count(started) - started0} of {jobs} started in {timeout:.0f} s")
    t_started = w.last("JobStarted", tag) - t0
    with w.cond:  # the callbacks ran on the watcher's thread just before the counts were seen
        at_placed = w.marked[(placed, placed0 + jobs)]
        at_started = w.marked[(started, started0 + jobs)]
    assert isinstance(at_placed, dict) and isinstance(at_started, dict)
    return {
        "jobs": jobs,
        "publish_s": t_pub,
        "submissions_per_s": jobs / t_pub,
        "last_placed_s": t_placed,
        "last_started_s": t_started,
        "placements_per_s": jobs / t_placed,
        "cpu_per_1000_to_last_placed": run.cpu.per_1000(cpu0, at_placed, jobs),
        "cpu_per_1000_to_last_started": run.cpu.per_1000(cpu0, at_started, jobs),
    }


#: Submissions before the timed latency run (:func:`warm_up`): the first hundreds after the stack starts are
#: slower (docs/performance.md, "Submit to `StartWorkload`").
WARMUP_JOBS = 300


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-jobs", type=int, default=200, help="submissions timed one at a time (1)")
    ap.add_argument(
        "--latency-warmup",
        type=int,
        default=WARMUP_JOBS,
        help=f"submissions sent the same way before them, not timed (the stack just started; default {WARMUP_JOBS})",
    )
    ap.add_argument("--jobs", type=int, default=5000, help="submissions for the throughput run")
    ap.add_argument("--events", type=int, default=200_000, help="job events for the accounting ingest run")
    ap.add_argument(
        "--quick", action="store_true", help="50 latency jobs after 100, 1,000 jobs, 20,000 events (minutes)"
    )
    ap.add_argument("--ingest-only", action="store_true", help="only the accounting ingest (3), not the services")
    ap.add_argument("--latency-only", action="store_true", help="only the latency and its hops (1)")
    ap.add_argument(
        "--latency-nodes",
        type=int,
        default=8,
        metavar="N",
        help="simulated nodes (8 GPUs each) of a --latency-only run (default 8; the full run has --jobs/8 + 1)",
    )
    ap.add_argument("--json", action="store_true", help="figures as one JSON object on stdout (text on stderr)")
    ap.add_argument(
        "--broker-times",
        action="store_true",
        help="the broker logs every request's times; after the latency run, print their medians per request kind",
    )
    tls = ap.add_mutually_exclusive_group()
    tls.add_argument("--no-tls", action="store_true", help="Kafka SASL_PLAINTEXT and plaintext Redis (development)")
    tls.add_argument("--tls-cost", action="store_true", help="run with TLS, then without; print both side by side")
    ap.add_argument("--keep", action="store_true", help="keep the data folder (logs, broker data, journals)")
    args = ap.parse_args()
    if args.latency_nodes < 1:
        ap.error("--latency-nodes: at least 1")
    if args.latency_nodes != 8 and not args.latency_only:
        ap.error("--latency-nodes needs --latency-only (the full run's nodes hold its --jobs, one GPU each)")
    if args.quick:  # a few minutes
        args.latency_jobs, args.jobs, args.events = 50, 1000, 20_000
        args.latency_warmup = min(args.latency_warmup, 100)
    global OUT
    OUT = sys.stderr if args.json else sys.stdout
    from chaos import raise_on_sigterm
    from scratch import scratch_dir

    raise_on_sigterm()  # a SIGTERM stops the services, the broker and Redis and removes the data folder
    with_tls: dict[str, Any] = {}
    without: dict[str, Any] = {}
    with scratch_dir("apportion-bench-live-", args.keep) as root:
        if not args.tls_cost:
            ok = bench(args, tls=not args.no_tls, figures=with_tls, tmp=root)
        else:
            say("== with TLS")
            ok = bench(args, tls=True, figures=with_tls, tmp=root / "tls")
            say("== without TLS (APPORTION_NO_TLS=1)")
            bench(args, tls=False, figures=without, tmp=root / "no-tls")
            say(tls_cost_table(with_tls, without))
    if args.json:
        print(json.dumps({"with_tls": with_tls, "without_tls": without} if args.tls_cost else with_tls, indent=1))
    return 0 if ok else 1


#: where the text figures go: stdout, or stderr when ``--json`` keeps stdout for the JSON
OUT: TextIO = sys.stdout


def say(line: str) -> None:
    print(line, file=OUT, flush=True)


#: How each figure reads, and whether more is better (the sign of TLS's cost).
FIGURES = {
    "latency_p50_ms": ("submit-to-StartWorkload p50, ms", False),
    "latency_p95_ms": ("submit-to-StartWorkload p95, ms", False),
    "latency_p99_ms": ("submit-to-StartWorkload p99, ms", False),
    "placements_per_s": ("sustained placements/s", True),
    "last_started_s": ("last JobStarted after first submission, s", False),
    "cpu_s_per_1000_placed": ("CPU s per 1,000 to the last JobPlaced", False),
    "cpu_s_per_1000_started": ("CPU s per 1,000 to the last JobStarted", False),
    "raw_consume_per_s": ("raw kafka-python consume, events/s", True),
    "accounting_per_s": ("accounting rebuild, events/s", True),
}


def tls_cost_table(with_tls: dict[str, Any], without: dict[str, Any]) -> str:
    """The figures of both runs and what TLS costs in each, one line per figure both runs measured."""
    lines = [f"{'figure':<42} {'with TLS':>12} {'without':>12} {'TLS costs':>10}"]
    for key, (label, more_is_better) in FIGURES.items():
        if key not in with_tls or key not in without:
            continue
        a, b = with_tls[key], without[key]
        cost = (b - a) / b if more_is_better else (a - b) / b
        lines.append(f"{label:<42} {a:>12,.2f} {b:>12,.2f} {100 * cost:>9.0f}%")
    return "\n".join(lines)


def bench(args: argparse.Namespace, *, tls: bool, figures: dict[str, Any], tmp: Path) -> bool:
    """One run of the benchmarks on a fresh local stack (with TLS or without) keeping its data in ``tmp`` (the
    broker's and Redis's, the services' logs and state); fills ``figures``; true when every target is met. The
    stack is stopped on every way out."""
    if tls:
        os.environ.pop("APPORTION_NO_TLS", None)
    else:
        os.environ["APPORTION_NO_TLS"] = "1"  # infra/ starts the servers without TLS; the clients follow

    from apportion.bus.stack import LocalStack

    tmp.mkdir(parents=True, exist_ok=True)
    stack = None
    bootstrap, redis_url = os.environ.get("KAFKA_BOOTSTRAP"), os.environ.get("REDIS_URL")
    try:
        if not (bootstrap and redis_url):
            if args.broker_times:  # infra/kafka/log4j2.properties: the request logger at DEBUG
                os.environ["KAFKA_JVM_OPTS"] = f"{os.environ.get('KAFKA_JVM_OPTS', '')} {REQUEST_LOG_OPT}".strip()
            stack = LocalStack(tmp / "stack")
            stack.start()
            bootstrap, redis_url = stack.bootstrap, stack.redis_url
        if args.ingest_only:
            return accounting_ingest(bootstrap, redis_url, args.events, figures)
        return measure(args, bootstrap, redis_url, stack, tmp, figures)
    finally:
        if stack is not None:
            stack.stop()


def measure(
    args: argparse.Namespace, bootstrap: str, redis_url: str, stack: Any, tmp: Path, figures: dict[str, Any]
) -> bool:
    """Latency, throughput and ingest (:func:`bench`) on a running Kafka and Redis (``stack``: the
    :class:`LocalStack` this process started, or ``None``), the services' data in ``tmp``."""
    # one job at a time needs few nodes; the throughput run one GPU a job
    nodes = args.latency_nodes if args.latency_only else max(8, (args.jobs + 7) // 8 + 1)
    ok = True
    run = LiveRun(bootstrap, redis_url, tmp, nodes, *server_pids(stack))
    try:
        run.start()
        kept = "" if args.keep else " (removed at the end; --keep)"
        say(f"stack {bootstrap}; namespace {run.ns}; {nodes} simulated nodes x 8 GPUs; logs in {tmp / 'logs'}{kept}")

        # ---- 1. latency on an idle cluster (after the warm-up), and where it goes
        warm_up(run, args.latency_warmup, figures)
        broker_log = stack.datadir / "kafka" / "kafka.log" if stack is not None and args.broker_times else None
        log_from = broker_log.stat().st_size if broker_log is not None else 0
        ok &= latency(run, args.latency_jobs, figures)
        if broker_log is not None:
            with broker_log.open("rb") as f:
                f.seek(log_from)
                logged = f.read().decode("utf-8", "replace").splitlines()
            times, path = broker_times(logged), broker_path(logged)
            figures["broker_times_ms"], figures["broker_path_ms"] = times, path
            say(broker_times_table(times))
            say(broker_path_table(path))
        if args.latency_only:
            raise StopAfter()

        # ---- 2. sustained throughput, and the CPU it took
        got = throughput(run, args.jobs)
        figures.update(got)
        placed, started = got["cpu_per_1000_to_last_placed"], got["cpu_per_1000_to_last_started"]
        figures["cpu_s_per_1000_placed"], figures["cpu_s_per_1000_started"] = placed["total"], started["total"]
        say(
            f"sustained: {args.jobs} submissions published in {got['publish_s']:.2f} s "
            f"({got['submissions_per_s']:,.0f}/s); last JobPlaced {got['last_placed_s']:.2f} s after the first "
            f"submission -> {got['placements_per_s']:,.0f} placements/s; last JobStarted at "
            f"{got['last_started_s']:.2f} s"
        )
        say(budget_table({"to last JobPlaced": placed, "to last JobStarted": started}, measurement=run.cpu.measurement))
        ok &= got["placements_per_s"] >= 2500
    except BenchError as exc:
        say(f"FAIL: {exc}")
        ok = False
    except StopAfter:
        args.events = 0
    finally:
        run.close()
    if (not ok and "placements_per_s" not in figures) or not args.events:
        return ok and "latency_p50_ms" in figures

    # ---- 3. accounting ingest vs raw consume, on a fresh namespace
    ok &= accounting_ingest(bootstrap, redis_url, args.events, figures)
    say("all targets met" if ok else "SOME TARGETS MISSED")
    return ok


#: The JVM flag that turns the broker's request log on (infra/kafka/log4j2.properties).
REQUEST_LOG_OPT = "-Dapportion.kafka.request.log=DEBUG"

#: Request kinds :func:`broker_times_table` prints, in the order one decision meets them (a fetch's times are
#: mostly its long poll, so it is left out).
BROKER_REQUESTS = (
    "PRODUCE",
    "LIST_OFFSETS",
    "ADD_PARTITIONS_TO_TXN",
    "PRODUCE transactional",
    "ADD_PARTITIONS_TO_TXN verify",
    "END_TXN",
    "WRITE_TXN_MARKERS",
)

#: The broker's times of a request (Kafka's request log), as :func:`broker_times` names them: in its request queue,
#: in a request handler thread, waiting on another request or a purgatory (``remote``: for a transactional produce,
#: the partition leader's check with the transaction coordinator), in the response queue, sending.
BROKER_TIMES = {
    "total": "totalTimeMs",
    "queue": "requestQueueTimeMs",
    "local": "localTimeMs",
    "remote": "remoteTimeMs",
    "respq": "responseQueueTimeMs",
    "send": "sendTimeMs",
}


def _logged(lines: list[str]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(line, kind, request)`` of each request line of the broker's request log (``kafka.request.logger`` at
    DEBUG: ``[time] DEBUG Completed request:{json} (kafka.request.logger)``); other lines are skipped. The kind
    is the API name; a produce in a transaction is ``PRODUCE transactional`` and an ``ADD_PARTITIONS_TO_TXN`` of
    version 4 or later (the one a partition leader sends the transaction coordinator to check a transactional
    produce, KIP-890) is ``ADD_PARTITIONS_TO_TXN verify``."""
    marker, tail = "Completed request:", " (kafka.request.logger)"
    for line in lines:
        at = line.find(marker)
        if at < 0 or not line.endswith(tail):
            continue
        d = json.loads(line[at + len(marker) : -len(tail)])
        header = d["requestHeader"]
        kind = header["requestApiKeyName"]
        if kind == "PRODUCE" and d.get("request", {}).get("transactionalId"):
            kind = "PRODUCE transactional"
        elif kind == "ADD_PARTITIONS_TO_TXN" and header["requestApiVersion"] >= 4:
            kind = "ADD_PARTITIONS_TO_TXN verify"
        yield line, kind, d


def broker_times(lines: list[str]) -> dict[str, dict[str, float]]:
    """Median broker times in ms per request kind, from the broker's request log (``kafka.request.logger`` at
    DEBUG: a line ``... Completed request:{json} (kafka.request.logger)`` per request).

    Kinds as :func:`_logged` names them; each holds ``n`` and the median of each of :data:`BROKER_TIMES`."""
    seen: dict[str, list[dict[str, Any]]] = {}
    for _, kind, d in _logged(lines):
        seen.setdefault(kind, []).append(d)
    return {
        kind: {"n": len(ds), **{name: statistics.median(d[key] for d in ds) for name, key in BROKER_TIMES.items()}}
        for kind, ds in seen.items()
    }


#: One submission's way through the broker (:func:`broker_path`): each step's name, and the two moments it lies
#: between (``<request>.start``/``.end`` on the broker's clock; ``ack`` is the end of the probe's produce).
PATH_STEPS = (
    ("ack -> the dispatcher's fetch arrives (< 0: it waited there)", "ack", "fetch.start"),
    ("  fetch at the broker", "fetch.start", "fetch.end"),
    ("-> key end offsets asked (LIST_OFFSETS, own connection)", "fetch.end", "ends.start"),
    ("  LIST_OFFSETS at the broker", "ends.start", "ends.end"),
    ("fetch -> ADD_PARTITIONS_TO_TXN arrives (decide, sign, send)", "fetch.end", "add.start"),
    ("  ADD_PARTITIONS_TO_TXN at the broker", "add.start", "add.end"),
    ("-> transactional PRODUCE arrives", "add.end", "produce.start"),
    ("  PRODUCE at the broker", "produce.start", "produce.end"),
    ("-> END_TXN arrives", "produce.end", "end.start"),
    ("  (LIST_OFFSETS answered -> END_TXN arrives)", "ends.end", "end.start"),
    ("  END_TXN at the broker", "end.start", "end.end"),
    ("-> commit markers written (WRITE_TXN_MARKERS)", "end.end", "markers.end"),
    ("ack -> commit markers written", "ack", "markers.end"),
)


def _requests(lines: list[str]) -> list[dict[str, Any]]:
    """The request log's requests in order of their end: ``kind`` (as :func:`broker_times` names it), ``client``,
    ``start`` and ``end`` (ms on the broker's clock: the line's time, milliseconds, minus the request's total
    time) and ``submission`` (a fetch that returned records of the submissions topic)."""
    from datetime import datetime

    out = []
    for line, kind, d in _logged(lines):
        if not line.startswith("["):
            continue
        end = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp() * 1000
        parts = (
            [
                p
                for t in d.get("response", {}).get("responses", [])
                if str(t.get("topic", "")).endswith("submissions")
                for p in t.get("partitions", [])
            ]
            if kind == "FETCH"
            else []
        )
        out.append(
            {
                "kind": kind,
                "client": d["requestHeader"].get("clientId"),
                "start": end - d["totalTimeMs"],
                "end": end,
                "submission": any(p.get("recordsSizeInBytes", 0) > 0 for p in parts),
            }
        )
    return sorted(out, key=lambda r: r["end"])


def broker_path(
    lines: list[str],
    probe: str = "bench-latency",
    reader: str = "dispatcher-reader",
    writer: str = "dispatcher",
    asker: str = "dispatcher-ends",
) -> dict[str, tuple[int, float]]:
    """``(n, median ms)`` of each :data:`PATH_STEPS` step of the latency probe's submissions, from the broker's
    request log: the probe's produce (its end is the ack), the dispatcher reader's fetch that returned a
    submission, then, both after that fetch, the key topic's ``LIST_OFFSETS`` on the reader's own connection for
    them (``asker``: rule D10.proven-user, waited for before the commit) and the dispatcher's
    ``ADD_PARTITIONS_TO_TXN``, then its transactional ``PRODUCE`` and ``END_TXN``, and the broker's
    ``WRITE_TXN_MARKERS``, each the first of its kind that ends after the one it follows. The gaps between them
    are the clients' and the hand-offs' time; the log's clock has milliseconds, so each figure is within about
    1 ms. A submission with a request missing is left out."""
    reqs = _requests(lines)

    def after(kind: str, client: str | None, t: float, submission: bool = False) -> dict[str, Any] | None:
        return next(
            (
                r
                for r in reqs
                if r["kind"] == kind
                and client in (None, r["client"])
                and r["end"] > t
                and (r["submission"] or not submission)
            ),
            None,
        )

    steps: dict[str, list[float]] = {name: [] for name, _, _ in PATH_STEPS}
    for ack in (r for r in reqs if r["kind"] == "PRODUCE" and r["client"] == probe):
        at: dict[str, float] = {"ack": ack["end"], "ack.start": ack["start"]}
        for name, kind, client, since in (
            ("fetch", "FETCH", reader, "ack.start"),
            ("ends", "LIST_OFFSETS", asker, "fetch.end"),
            ("add", "ADD_PARTITIONS_TO_TXN", writer, "fetch.end"),
            ("produce", "PRODUCE transactional", writer, "add.end"),
            ("end", "END_TXN", writer, "produce.end"),
            ("markers", "WRITE_TXN_MARKERS", None, "end.end"),
        ):
            r = after(kind, client, at[since], submission=name == "fetch")
            if r is None:
                break
            at[f"{name}.start"], at[f"{name}.end"] = r["start"], r["end"]
        else:
            for step, a, b in PATH_STEPS:
                steps[step].append(at[b] - at[a])
    return {step: (len(v), statistics.median(v)) for step, v in steps.items() if v}


def broker_path_table(path: dict[str, tuple[int, float]]) -> str:
    """:func:`broker_path`, one line a step."""
    lines = [f"  {'a submission at the broker (median ms)':<60}{'n':>6}{'ms':>8}"]
    lines += [f"  {step:<60}{n:>6}{ms:>8.1f}" for step, (n, ms) in path.items()]
    return "\n".join(lines)


def broker_times_table(times: dict[str, dict[str, float]]) -> str:
    """:func:`broker_times` of :data:`BROKER_REQUESTS`, one line each (kinds the run did not send are left out)."""
    lines = [f"  {'broker request (median ms)':<32}{'n':>6}" + "".join(f"{name:>8}" for name in BROKER_TIMES)]
    for kind in BROKER_REQUESTS:
        if kind in times:
            t = times[kind]
            lines.append(f"  {kind:<32}{t['n']:>6.0f}" + "".join(f"{t[name]:>8.2f}" for name in BROKER_TIMES))
    return "\n".join(lines)


#: The hops of one submission, in order: the moments :func:`moments` reads from the records.
HOPS = (
    ("client send -> ack (broker append)", "sent", "acked"),
    ("ack -> dispatcher read (JobQueued ts)", "acked", "queued"),
    ("read -> decision (JobPlaced ts)", "queued", "placed"),
    ("decision -> StartWorkload appended", "placed", "command_appended"),
    ("appended -> visible to a reader (commit)", "command_appended", "command_seen"),
    ("StartWorkload seen -> JobStarted appended", "command_seen", "started_appended"),
    ("JobStarted appended -> visible", "started_appended", "started_seen"),
)


def moments(w: CommandWatcher, jid: str, sent: float, acked: float) -> dict[str, float] | None:
    """Wall times (epoch s) of one job's hops from its records: the client's send and ack, the dispatcher's
    event times (``JobQueued`` at the read, ``JobPlaced`` at the decision), the broker's append times (the
    signed topics are ``LogAppendTime``, ms) and the watcher's arrival times. ``None`` when one is missing."""
    keys = {k: (k, jid) for k in ("JobQueued", "JobPlaced", "StartWorkload", "JobStarted")}
    if any(k not in w.stamps for k in keys.values()):
        return None
    st = {k: w.stamps[v] for k, v in keys.items()}
    return {
        "sent": sent,
        "acked": acked,
        "queued": datetime.fromisoformat(st["JobQueued"][2]).timestamp(),
        "placed": datetime.fromisoformat(st["JobPlaced"][2]).timestamp(),
        "command_appended": st["StartWorkload"][1],
        "command_seen": st["StartWorkload"][0],
        "started_appended": st["JobStarted"][1],
        "started_seen": st["JobStarted"][0],
    }


def quarter_medians(values: list[float]) -> list[float]:
    """The median of each quarter of ``values`` in their order (fewer than four when there are fewer values):
    whether a run's latencies still fall as it goes, i.e. whether the warm-up was long enough."""
    parts = (values[k * len(values) // 4 : (k + 1) * len(values) // 4] for k in range(4))
    return [statistics.median(q) for q in parts if q]


def one_at_a_time(run: LiveRun, n: int, prefix: str) -> tuple[list[float], list[tuple[str, float, float]]]:
    """``n`` one-GPU submissions (ids ``prefix0``...), each sent when the previous one's ``JobStarted`` was seen, as
    the CLI's submit sends one (:func:`apportion.client.publish`): each one's wall ms from the producer's ack to
    its ``StartWorkload`` at the watcher, and ``(job id, sent, acked)`` (epoch s) of each."""
    from apportion.bus.producer import EventProducer
    from apportion.client import client_linger_ms

    w = run.watcher
    assert w is not None
    lat, times = [], []
    probe = EventProducer(run.bootstrap, client_id="bench-latency", linger_ms=client_linger_ms(1))
    try:
        for i in range(n):
            jid = f"{prefix}{i}"
            sent = time.time()
            run.submit(jid, "bench/a" if i % 2 else "bench/b", 1.0, producer=probe)
            probe.flush()
            acked, t0 = time.time(), time.perf_counter()
            t1 = w.wait_for(("StartWorkload", jid), 30)
            if t1 is None:
                raise BenchError(f"no StartWorkload for {jid} within 30 s")
            lat.append((t1 - t0) * 1000)
            if w.wait_for(("JobStarted", jid), 30) is None:
                raise BenchError(f"no JobStarted for {jid} within 30 s")
            times.append((jid, sent, acked))
    finally:
        probe.close()
    return lat, times


def warm_up(run: LiveRun, n: int, figures: dict[str, Any]) -> None:
    """``n`` submissions as :func:`latency` sends them, before it, on the stack just started: the broker's JVM
    compiles its hot paths and every process makes its connections and caches during the first hundreds of
    jobs, which an idle cluster that has been running has done. Their p50 is printed and kept apart
    (``latency_warmup_p50_ms``), out of the latency figures."""
    if n <= 0:
        return
    lat, _ = one_at_a_time(run, n, "warm")
    figures["latency_warmup_p50_ms"] = statistics.median(lat)
    quarters = " / ".join(f"{q:.1f}" for q in quarter_medians(lat))
    say(f"warm-up: {n} submissions one at a time on the stack just started, not counted below:")
    say(f"  p50 {statistics.median(lat):.1f} ms; by quarter, in submission order: {quarters} ms")


def latency(run: LiveRun, n: int, figures: dict[str, Any]) -> bool:
    """``n`` one-GPU submissions one at a time on an idle cluster (:func:`one_at_a_time`, after
    :func:`warm_up`): wall ms from the producer's ack to the ``StartWorkload`` at a reader, p50 and p99 (target
    p50 <= 15 ms), then each hop's median and p95 from the records' times (:data:`HOPS`). Sets ``latency_*``
    figures; true when the target is met."""
    from apportion.sim.report import percentile

    w = run.watcher
    assert w is not None
    cpu0 = run.cpu.sample()
    lat, times = one_at_a_time(run, n, "lat")
    cpu = run.cpu.per_1000(cpu0, run.cpu.sample(), n)  # CPU s per 1,000 = ms per submission
    p50, p95, p99 = statistics.median(lat), percentile(lat, 95), percentile(lat, 99)
    figures.update(latency_p50_ms=p50, latency_p95_ms=p95, latency_p99_ms=p99)
    say(
        f"submit-to-StartWorkload latency over {len(lat)} jobs: p50 {p50:.1f} ms, p95 {p95:.1f} ms, "
        f"p99 {p99:.1f} ms (target p50 <= 15 ms; load average {os.getloadavg()[0]:.1f})"
    )
    quarters = quarter_medians(lat)
    figures["latency_p50_by_quarter_ms"] = quarters
    say("  p50 by quarter, in submission order: " + " / ".join(f"{q:.1f}" for q in quarters) + " ms")
    rows = [m for jid, sent, acked in times if (m := moments(w, jid, sent, acked)) is not None]
    hops = {}
    say(f"  {'hop (record times; broker times are ms)':<44}{'p50 ms':>9}{'p95 ms':>9}")
    for label, a, b in HOPS:
        d = [1000 * (m[b] - m[a]) for m in rows]
        hops[label] = (statistics.median(d), percentile(d, 95))
        say(f"  {label:<44}{hops[label][0]:>9.1f}{hops[label][1] or 0:>9.1f}")
    figures["latency_hops_ms"] = hops
    # each submission's hops in submission order (--json): where one run's tail comes from
    figures["latency_hops_each_ms"] = {label: [round(1000 * (m[b] - m[a]), 2) for m in rows] for label, a, b in HOPS}
    figures["latency_cpu_ms_per_job"] = cpu
    say(f"  CPU ms per timed submission, each process (it and all it set off, {run.nodes} nodes' reports included):")
    say("  " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
    return p50 <= 15


def server_pids(stack: Any) -> tuple[int | None, int | None]:
    """The broker's (node 1's) and Redis's process ids of a :class:`LocalStack` this process started."""
    if stack is None:
        return None, None
    pidfile = stack.datadir / "redis" / "redis.pid"
    return stack.node_pid(1), int(pidfile.read_text().strip()) if pidfile.is_file() else None


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
    from apportion.identity.keys import BatchSigner, Identity

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
    say(
        f"accounting ingest: {n:,} job events; raw kafka-python consume {raw_rate:,.0f} events/s "
        f"({raw:.2f} s); accounting start-up rebuild (read + decode + fold + first snapshot) "
        f"{acc_rate:,.0f} events/s ({acc:.2f} s) = {100 * acc_rate / raw_rate:.0f}% of raw (target >= 50%)"
    )
    # on a shared machine the wall rates swing with the load; the CPU each took (this process, every thread) less
    say(
        f"  CPU: raw consume {raw_cpu:.2f} s ({got / raw_cpu:,.0f} events/CPU-s), accounting {acc_cpu:.2f} s "
        f"({n / acc_cpu:,.0f} events/CPU-s) = {100 * raw_cpu / acc_cpu:.0f}% of raw"
    )
    say(
        f"  stricter baseline, raw consume with the compiled CRC-32C ({crc}): {got_c / raw_c:,.0f} events/s, "
        f"CPU {raw_c_cpu:.2f} s ({got_c / raw_c_cpu:,.0f} events/CPU-s); accounting = "
        f"{100 * acc_rate / (got_c / raw_c):.0f}% of it by wall, {100 * raw_c_cpu / acc_cpu:.0f}% by CPU"
    )
    return acc_rate >= 0.5 * raw_rate


if __name__ == "__main__":
    sys.exit(main())
