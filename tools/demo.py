"""The main job (``make run``): the whole system on a real GPU trace.

1. Starts a local Kafka and Redis (or uses ``KAFKA_BOOTSTRAP``/``REDIS_URL``
   when they are set) under a fresh topic namespace, so runs never mix.
2. Publishes the reference budget tree (``infra/budgets/philly.yaml``: one
   budget per Philly virtual cluster, share = its nodes / 352 x 0.98).
3. Starts the four services as processes - policy, accounting, dispatcher
   and one node agent hosting the 32 simulated 8-GPU nodes of the reference
   cluster - all on one accelerated clock (``--time-scale`` event seconds per
   wall second).
4. Replays the submissions of the Philly trace slice (default: the first 3
   days of ISO week 44 of 2017) as ``JobSubmitted`` events at their trace
   times, with a progress bar (off a terminal, a plain line at each tenth:
   :class:`PlainProgress`). Reference rules: a seeded 25% of jobs run
   unallocated (min runtime 0), the rest min(duration, 2 h); gangs are
   ceil(n / 8) replicas.
5. At the end of the slice stops the services (:func:`stop_settled`: the node
   agent first, the rest once the dispatcher has folded the end of every run),
   reads the whole log back and reports per budget share vs occupancy, wait
   p50/p95, preemptions, utilisation and protection violations
   (:func:`apportion.audit.report.log_report`), next to the same trace
   through the deterministic simulator with the same seed, and says whether
   they agree within ``--tolerance-pp`` percentage points.
6. Runs ``audit verify`` on the run's log and read models
   (:func:`audit_verify`: rule D11.verify-clean, "verify passes on every log the
   stack writes") and prints its verdict; the exit code is 0 only when the
   comparison agrees and verify passes.
7. Stops Kafka and Redis if it started them.

Everything it writes is in its run directory (``--dir``): the logs, the
report, the exported log, the keyring and the stack's data stay there; the
services' own state (the node agent's journal and job files, the policy's
data, in ``state``) is removed when the run ends.

Run ``python tools/demo.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

from apportion.privatefiles import open_private_append, private_dir, write_private
from apportion.settings import default_data_dir, topic_name

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the main job."""
    ap = argparse.ArgumentParser(
        prog="python tools/demo.py",
        description="apportion main job: the live stack (Kafka, Redis, four services, 32 simulated 8-GPU nodes) "
        "replays a slice of the real Philly GPU trace on an accelerated clock and compares the outcome "
        "with the simulator.",
    )
    ap.add_argument("--trace", type=Path, default=None, help="trace CSV (default: <data>/philly/philly.csv)")
    ap.add_argument(
        "--budgets",
        type=Path,
        default=REPO / "infra" / "budgets" / "philly.yaml",
        help="budget file with tree and cluster (default: infra/budgets/philly.yaml)",
    )
    ap.add_argument(
        "--slice",
        default="week44+3d",
        help="trace slice: week44, week44+3d, weeks39-45, YYYY-MM-DD..YYYY-MM-DD (default week44+3d)",
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1440.0,
        help="event seconds per wall second (default 1440: a day per minute, a week in 7 minutes)",
    )
    ap.add_argument("--seed", type=int, default=1, help="seed of the unallocated draw (default 1)")
    ap.add_argument("--dir", type=Path, default=REPO / ".run" / "demo", help="logs, report and stack data")
    ap.add_argument(
        "--tolerance-pp",
        type=float,
        default=2.0,
        help="agreement tolerance with the simulator, percentage points (default 2: about three "
        "times the simulator's own spread between seeds; measured live difference 0.26)",
    )
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    return ap.parse_args(argv)


#: Wall seconds between a simulated node's heartbeats, and the dispatcher's heartbeat timeout (six of them).
HEARTBEAT_WALL_S = 0.5
HB_TIMEOUT_WALL_S = 6 * HEARTBEAT_WALL_S


@dataclass
class Services:
    """The service processes of one run."""

    procs: dict[str, subprocess.Popen[bytes]]

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def stop(self, timeout_s: float = 20.0, only: tuple[str, ...] | None = None) -> None:
        """SIGTERM every process (or those named in ``only``), then SIGKILL what is left after ``timeout_s``."""
        procs = [p for n, p in self.procs.items() if only is None or n in only]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def start_services(
    env: dict[str, str],
    logs: Path,
    nodes: int,
    gpus: int,
    scale: float,
    principals: dict[str, dict[str, str]] | None = None,
) -> Services:
    """Start policy, accounting, dispatcher and one node agent hosting ``nodes`` simulated nodes.

    ``principals``: per service name, the environment that makes it its own Kafka (and Redis) principal
    (:func:`service_principals`), replacing the caller's credentials in ``env``; ``None``: ``env`` as it is.
    """
    private_dir(logs)  # the services' logs hold every job's command and environment: 0700, files 0600
    hb_wall = HEARTBEAT_WALL_S
    cmds = {
        "policy": ["services.policy"],
        "accounting": ["services.accounting", "--snapshot-interval-s", "3600"],
        # heartbeats come every max(interval, 0.5 wall s) = 0.5 * scale event s: allow 6 of them
        "dispatcher": [
            "services.dispatcher",
            "--heartbeat-timeout-s",
            str(HB_TIMEOUT_WALL_S * scale),
            "--tick-wall-s",
            str(min(0.2, 300.0 / scale)),
        ],
        "node_agent": [
            "services.node_agent",
            "--sim-nodes",
            str(nodes),
            "--gpus-per-node",
            str(gpus),
            "--node-prefix",
            "n",
            "--heartbeat-interval-s",
            str(hb_wall * scale),
        ],
    }
    procs = {}
    for name, cmd in cmds.items():
        f = open_private_append(logs / f"{name}.log")  # kept open for the child
        own = env
        if principals is not None:
            own = {k: v for k, v in env.items() if not k.startswith(("APPORTION_KAFKA_", "APPORTION_REDIS_"))}
            own.update(
                APPORTION_KAFKA_BOOTSTRAP=env["APPORTION_KAFKA_BOOTSTRAP"],
                APPORTION_REDIS_URL=env["APPORTION_REDIS_URL"],
                **principals.get(name, {}),
            )
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", *cmd], env=own, stdin=subprocess.DEVNULL, stdout=f, stderr=f, cwd=REPO
        )
    return Services(procs)


#: The name of the main job's one node agent: Kafka principal ``node-agent.demo``.
DEMO_AGENT = "demo"

#: The simulator's ``checkpoint_on_stop`` in the main job: what the node agent's simulated workloads do (each
#: saves its progress on SIGTERM when the stop has a grace period, ``services.node_agent.logic.sim_stop_progress_s``).
SIM_ON_STOP: Final = "all"


def service_principals(kafka_secrets: Path | None, redis_secrets: Path | None) -> dict[str, dict[str, str]] | None:
    """Each service of the main job as its own Kafka principal (and the dispatcher and accounting as their own
    Redis users), as ``apportion stack up`` starts them (``docs/security.md``); ``None`` on a broker without
    secrets (plaintext development flag), where the services keep the caller's credentials."""
    from apportion.bus.security import service_credentials

    if kafka_secrets is None:
        return None
    names = ("policy", "accounting", "dispatcher", "node_agent")
    return {n: service_credentials(n, DEMO_AGENT, kafka_secrets, redis_secrets) for n in names}


def stop_settled(services: Services, bootstrap: str, quiet_s: float, deadline_s: float = 120.0) -> None:
    """Stop the services so that what they last wrote to Redis is what the log says (``audit verify`` compares).

    The node agent stops first (it reports its runs lost); the dispatcher folds those ends, declares the nodes
    lost once their heartbeats are overdue, and rewrites its read model within 0.5 s of a change. When the
    dispatcher's input topics have had no new record for ``quiet_s`` wall seconds (longer than the heartbeat
    timeout), the rest stop: each writes its read model and checkpoint on the way out.
    """
    from kafka import KafkaConsumer, TopicPartition

    from apportion.audit.verify import dispatcher_input_topics
    from apportion.bus.producer import READ_COMMITTED
    from apportion.bus.security import kafka_auth

    services.stop(only=("node_agent",))
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, **READ_COMMITTED, **kafka_auth()
    )
    try:
        parts = [
            TopicPartition(t, p)
            for t in dispatcher_input_topics()
            for p in sorted(consumer.partitions_for_topic(t) or ())
        ]
        ends, since = consumer.end_offsets(parts), time.monotonic()
        end = since + deadline_s
        while time.monotonic() - since < quiet_s:
            if services.dead() != ["node_agent"]:
                raise RuntimeError(f"service(s) {services.dead()} exited while settling; see their logs")
            if time.monotonic() > end:
                raise TimeoutError(f"the dispatcher's inputs were not quiet for {quiet_s:.0f} s in {deadline_s:.0f} s")
            time.sleep(0.5)  # polling the broker from the driver, bounded by the deadline
            now = consumer.end_offsets(parts)
            if now != ends:
                ends, since = now, time.monotonic()
    finally:
        consumer.close()
    services.stop()


def _wait_for(pred: Any, what: str, deadline_s: float, services: Services | None = None) -> None:
    end = time.monotonic() + deadline_s
    while not pred():
        if services is not None and services.dead():
            raise RuntimeError(f"service(s) {services.dead()} exited while waiting for {what}; see their logs")
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {deadline_s:.0f} s waiting for {what}")
        time.sleep(0.2)  # polling an external system from the driver, bounded by the deadline


def audit_verify(records: list[Any], redis_url: str, export: Path, con: Any) -> dict[str, Any]:
    """``apportion audit verify`` on the run's log, with the dispatcher settings the log records.

    Writes the log to ``export`` first (``apportion audit verify --from-file`` re-runs the check offline) and
    the read models beside it (``read_models.json``). Call it once every service has stopped, so the read
    models are the last ones written and the log holds every record they reflect.

    Returns:
        :meth:`apportion.audit.verify.VerifyReport.to_dict`, plus ``wall_s`` (the check's own time) and
        ``export`` (the file written).
    """
    import redis as redis_lib

    from apportion.audit.config import config_from_log
    from apportion.audit.source import verify_topics, write_export
    from apportion.audit.verify import read_models_from_redis, verify
    from apportion.bus.security import redis_auth
    from apportion.readmodel import dumps

    con.print("audit verify: read models, every snapshot, every decision re-run, every signed request ...")
    wanted = set(verify_topics())  # the dead letters too: what a service refused is a refused attack
    log = [r for r in records if r.topic in wanted]
    write_export(log, export, topic_names=wanted, exported_at=datetime.now(UTC).isoformat())
    r = redis_lib.Redis.from_url(redis_url, **redis_auth(redis_url))
    try:
        rows = read_models_from_redis(r)
    finally:
        r.close()
    write_private(export.parent / "read_models.json", dumps(rows).encode())
    t0 = time.perf_counter()
    cfg = config_from_log(log)
    rep = verify(log, read_models=rows, config=cfg, producer=cfg.producer if cfg else "dispatcher")
    return rep.to_dict() | {"wall_s": time.perf_counter() - t0, "export": str(export)}


def fresh_run_dir(run_dir: Path) -> Path:
    """Make ``run_dir`` private (the export, the logs and the stack's data hold every job's command and
    environment) with no logs and no service state of an earlier run (a journal of an earlier run's namespace
    must not be read back). Returns the folder of this run's service state (the node agent's journal and job
    files, the policy's data): ``run_dir/state``, removed again when the run ends."""
    state = run_dir / "state"
    for old in (run_dir / "logs", state):
        shutil.rmtree(old, ignore_errors=True)
    private_dir(run_dir)
    return state


def _terminate_as_interrupt(_signum: int, frame: Any) -> None:
    """SIGTERM handler: raise KeyboardInterrupt so the ``finally`` blocks stop the services and the stack."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the main job; returns the process exit code (0: ran and agreed within tolerance)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    from apportion import events, topics
    from apportion.audit.report import log_report
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.bus.reader import read_log
    from apportion.bus.stack import LocalStack
    from apportion.cli.stack import dev_keyring
    from apportion.client import enrol
    from apportion.clock import ScaledClock
    from apportion.domain.admission import DISPATCHER, node_principal
    from apportion.gpu import sim_node_ids
    from apportion.identity.keys import Identity
    from apportion.sim.core import SimConfig, simulate
    from apportion.sim.traces import load_budget_file, load_trace, parse_slice
    from apportion.timeutil import from_us, s_to_us, to_us

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)  # `kill` stops what we started, as Ctrl-C does
    con = report_console(Console, args.json)
    trace = args.trace or default_data_dir() / "philly" / "philly.csv"
    if not trace.is_file():
        con.print(f"[red]error:[/] trace {trace} not found (set --trace or APPORTION_DATA_DIR)")
        return 2
    try:
        bf = load_budget_file(args.budgets)
        jobs = load_trace(trace, bf, args.seed, args.slice)
        lo, hi = parse_slice(args.slice)
    except ValueError as exc:  # TraceError and slice errors name the file, line and field
        con.print(f"[red]error:[/] {exc}", soft_wrap=True)
        return 2
    if not jobs or lo is None or hi is None:
        con.print(f"[red]error:[/] slice {args.slice!r} selects no jobs or is unbounded")
        return 2
    start_us, end_us = lo, hi
    gpus_per_node = bf.nodes[0].gpus
    con.print(
        f"[bold]apportion main job[/]: {len(jobs):,} jobs of {trace.name} in {args.slice} "
        f"({from_us(start_us):%Y-%m-%d} .. {from_us(end_us):%Y-%m-%d}), {len(bf.nodes)} nodes x "
        f"{gpus_per_node} GPUs, {len(bf.tree.leaves())} budgets, time scale {args.time_scale:g}, "
        f"seed {args.seed}; unallocated fraction {bf.unallocated_fraction:.0%}, "
        f"min runtime = min(duration, {bf.min_runtime_cap_s / 3600:g} h)"
    )

    run_dir = args.dir
    state = fresh_run_dir(run_dir)
    stack = None
    bootstrap, redis_url = os.environ.get("KAFKA_BOOTSTRAP"), os.environ.get("REDIS_URL")
    services: Services | None = None
    namespace = f"demo{datetime.now(UTC):%Y%m%d%H%M%S}."
    os.environ["APPORTION_TOPIC_PREFIX"] = namespace
    try:
        if not (bootstrap and redis_url):
            con.print("starting Kafka and Redis ...")
            stack = LocalStack(run_dir / "stack", provision_topics=False).start()
            bootstrap, redis_url = stack.bootstrap, stack.redis_url
        provision(bootstrap, node_agents=(DEMO_AGENT,))  # each service its own principal (service_principals)
        con.print(f"Kafka {bootstrap}, Redis {redis_url}, topic namespace {namespace!r}")

        # one clock for all: event time start_us - lead happens at wall t0 + startup allowance
        allowance_s = 30.0
        epoch_wall = datetime.now(UTC) + timedelta(seconds=allowance_s)
        epoch_event = from_us(start_us)
        clock = ScaledClock(args.time_scale, epoch_wall, epoch_event)
        env = dict(
            os.environ,
            APPORTION_KAFKA_BOOTSTRAP=bootstrap,
            APPORTION_REDIS_URL=redis_url,
            APPORTION_TOPIC_PREFIX=namespace,
            APPORTION_TIME_SCALE=str(args.time_scale),
            APPORTION_CLOCK_EPOCH_WALL=epoch_wall.isoformat(),
            APPORTION_CLOCK_EPOCH_EVENT=epoch_event.isoformat(),
            APPORTION_LOG_JSON="true",
            APPORTION_HEARTBEAT_MIN_WALL_S="0.5",
            # the node agent signs its reports with its nodes' keys, made and registered (as ops) on first use
            APPORTION_KEYRING=str(dev_keyring(run_dir / "keyring")),
            APPORTION_STATE_DIR=str(state / "node_agent"),
            APPORTION_FAUST_DIR=str(private_dir(state / "policy")),  # the policy makes its own folder in it
        )
        producer = EventProducer(bootstrap, client_id="demo", linger_ms=5)
        now = clock.now()
        for path, spec in bf.tree.to_mapping().items():
            producer.send(events.BudgetSet(path=path, share=spec["share"], by="demo", ts=now, producer="demo"))
        # each trace user's key, registered by the demo acting as ops: the dispatcher checks every signature
        signers = {u: Identity.generate(u) for u in sorted({j.user for j in jobs})}
        for ident in signers.values():
            producer.send(
                events.UserKeyRegistered(
                    user=ident.user, public_key=ident.public_key, by="demo", ts=now, producer="demo"
                )
            )
        producer.flush()
        # the node agent's keys, one per node, registered by the demo acting as ops (the agent signs its reports)
        enrol(  # and the dispatcher's, which signs every decision
            [DISPATCHER, *(node_principal(n) for n in sim_node_ids("n", len(bf.nodes)))],
            bootstrap=bootstrap,
            now=now,
            ring=Path(env["APPORTION_KEYRING"]),
        )
        own = service_principals(stack.kafka_secrets, stack.redis_secrets) if stack is not None else None
        services = start_services(env, run_dir / "logs", len(bf.nodes), gpus_per_node, args.time_scale, own)
        con.print(f"services started (logs in {run_dir / 'logs'}); waiting for {len(bf.nodes)} nodes to register")

        def registered() -> bool:
            recs = read_log(bootstrap, [topic_name(topics.NODES)])
            return sum(isinstance(r.event, events.NodeRegistered) for r in recs) >= len(bf.nodes)

        _wait_for(registered, "node registration", 90.0, services)
        if clock.now_us() > start_us:
            con.print(f"[yellow]start-up took longer than {allowance_s:.0f} s: the first submissions are late[/]")
        else:
            time.sleep(clock.wall_seconds((start_us - clock.now_us()) / 1e6))

        # ---- replay the trace at its own event times
        t_wall0 = time.monotonic()
        progress: Any = (  # bars on a terminal; a log gets plain lines, which rich would squeeze and cut
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("event time {task.fields[at]}"),
                TimeRemainingColumn(),
                console=con,
            )
            if con.is_terminal
            else PlainProgress(con.print)
        )
        with progress as prog:
            task = prog.add_task("submitting", total=len(jobs), at="")
            for i, j in enumerate(jobs):
                wait_us = j.submit_us - clock.now_us()
                if wait_us > 0:
                    producer.flush()
                    time.sleep(clock.wall_seconds(wait_us / 1e6))
                sub = from_us(j.submit_us)
                producer.send(
                    signers[j.user].sign(
                        events.JobSubmitted(
                            job_id=j.job_id,
                            budget=j.budget,
                            user=j.user,
                            gpus_per_replica=j.gpus_per_replica,
                            replicas=j.replicas,
                            min_runtime_s=j.min_runtime_s,
                            duration_s=j.duration_s,
                            submitted_at=sub,
                            ts=sub,
                            producer="demo/trace",
                        )
                    )
                )
                if i % 50 == 0:
                    prog.update(task, completed=i + 1, at=f"{clock.now():%Y-%m-%d %H:%M}")
                    if services.dead():
                        raise RuntimeError(f"service(s) {services.dead()} exited; see {run_dir / 'logs'}")
            producer.flush()
            prog.update(task, completed=len(jobs))
            hours = (end_us - start_us) // 3_600_000_000
            task2 = prog.add_task("event hours to the end of the slice", total=hours, at="")
            while (now_us := clock.now_us()) < end_us + s_to_us(600):
                prog.update(
                    task2,
                    completed=max(0, min(now_us, end_us) - start_us) // 3_600_000_000,
                    at=f"{clock.now():%Y-%m-%d %H:%M}",
                )
                if services.dead():
                    raise RuntimeError(f"service(s) {services.dead()} exited; see {run_dir / 'logs'}")
                time.sleep(0.25)
        wall_replay = time.monotonic() - t_wall0
        producer.close()
        # stopped before the log is read back, node agent first and the rest once the dispatcher has folded
        # the end of every run: the log then holds everything, and the read models agree with it
        con.print("stopping the node agent, then the services once the dispatcher has settled ...")
        stop_settled(services, bootstrap, quiet_s=2 * HB_TIMEOUT_WALL_S + 1)

        # ---- report: live log vs simulator, one definition for both
        con.print("reading the log back ...")
        recs = read_log(bootstrap, [topic_name(t) for t in topics.ALL_TOPICS])
        verdict = audit_verify(recs, redis_url, run_dir / "log.jsonl.gz", con)
        live = log_report(recs, bf.tree, start_us, end_us)
        con.print("simulating the same trace ...")
        t0 = time.perf_counter()
        # the simulated nodes register when the live ones did (before the slice: the start-up allowance), so
        # both runs have the same capacity integral K in their windows and so the same ratios r
        registered_at = min(
            (to_us(r.event.ts) for r in recs if isinstance(r.event, events.NodeRegistered)), default=start_us
        )
        # the live node agent's simulated workloads resume from the dispatcher's saved progress, checkpoint at
        # each interval and every one saves its progress on SIGTERM (docs/checkpoints.md): the simulator's
        # checkpoint_on_stop="all" (`apportion simulate --checkpoint-on-stop all`), so both model one workload
        sim_cfg = SimConfig(
            seed=args.seed, start_us=min(registered_at, start_us), until_us=end_us, checkpoint_on_stop=SIM_ON_STOP
        )
        sim = simulate(bf.tree, bf.nodes, jobs, sim_cfg)
        sim_wall = time.perf_counter() - t0
        simrep = log_report(sim.log, bf.tree, start_us, end_us)
        dead_letters = sum(1 for r in recs if r.topic == topic_name(topics.DEADLETTER))
        return _report(con, args, live, simrep, wall_replay, sim_wall, len(recs), dead_letters, verdict, Table)
    except (RuntimeError, TimeoutError) as exc:
        con.print(f"[red]error:[/] {exc}")
        return 1
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (see _terminate_as_interrupt)
        con.print("[yellow]interrupted[/]")
        return 130
    finally:
        if services is not None and services.alive():
            con.print("stopping services ...")
            services.stop()
        shutil.rmtree(state, ignore_errors=True)
        if stack is not None:
            con.print("stopping Kafka and Redis ...")
            stack.stop()


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _pp(x: float | None) -> str:  # no budget had allocated work waiting at a sample: no deficit to show
    return "-" if x is None else f"{x:.2f}"


def _secs(x: float | None) -> str:
    return "-" if x is None else (f"{x:.0f}s" if x < 3600 else f"{x / 3600:.1f}h")


#: Columns the report is laid out for: its tables and lines fit an 80-column terminal.
REPORT_WIDTH = 80


class PlainProgress:
    """The replay's progress where the output is no terminal (a log file, CI): a plain line per task at each tenth
    of its total and at its end (``submitting: 912/9,120 (10%), event time 2026-10-30 04:00``), where rich's bars
    would be drawn once, squeezed to 80 columns and cut (``209…``, ``0:00:…``). The part of rich's ``Progress``
    the replay uses: a context manager, :meth:`add_task`, :meth:`update`."""

    STEPS = 10

    def __init__(self, say: Callable[[str], Any]) -> None:
        self.say = say
        self.tasks: list[dict[str, Any]] = []

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def add_task(self, description: str, total: int, at: str = "") -> int:
        self.tasks.append({"description": description, "total": total, "completed": 0, "at": at, "told": 0})
        return len(self.tasks) - 1

    def update(self, task: int, completed: int, at: str | None = None) -> None:
        t = self.tasks[task]
        t["completed"] = completed
        if at is not None:
            t["at"] = at
        total = t["total"]
        step = self.STEPS if total <= 0 else min(self.STEPS, completed * self.STEPS // total)
        if step <= t["told"]:
            return
        t["told"] = step
        pct = 100 if total <= 0 else completed * 100 // total
        when = f", event time {t['at']}" if t["at"] else ""
        self.say(f"{t['description']}: {completed:,}/{total:,} ({pct}%){when}")


def report_console(Console: Any, to_stderr: bool) -> Any:
    """The console the main job prints on: the terminal's width up to :data:`REPORT_WIDTH` (80 columns when
    not a terminal); every line it prints wraps there."""
    return Console(stderr=to_stderr, width=min(REPORT_WIDTH, Console(stderr=to_stderr).width))


def report_tables(slice_: str, live: Any, sim: Any, wall_replay: float, sim_wall: float, Table: Any) -> list[Any]:
    """The report's three tables, each at most :data:`REPORT_WIDTH` columns wide for a budget path of up to 16
    characters: per budget a ``live`` row and a ``sim`` row under it (share vs occupancy; goodput and work lost),
    then the cluster's live and simulated figures side by side. No cell is ever cut."""
    from rich import box

    def table(title: str, *cols: str) -> Any:
        t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, title_justify="left")
        for col in cols:
            t.add_column(col, justify="left" if col in ("budget", "run", "") else "right", no_wrap=True)
        return t

    t = table(
        f"per budget over {slice_}: share vs occupancy (of capacity); preemptions (most of a job)",
        "budget",
        "run",
        "share",
        "alloc",
        "free",
        "wait p50/p95",
        "preempt (most)",
    )
    g = table(
        f"per budget over {slice_}: goodput and work lost (share deficit in pp)",
        "budget",
        "run",
        "deficit",
        "goodput",
        "lost GPU-h (%)",
        "done",
        "JCT p50/p95",
    )
    for a, b in zip(live.budgets, sim.budgets):
        for run, r in (("live", a), ("sim", b)):
            first, last = run == "live", run == "sim"
            t.add_row(
                a.path if first else "",
                run,
                _pct(a.abs_share) if first else "",
                _pct(r.alloc_share),
                _pct(r.free_share),
                f"{_secs(r.wait_p50_s)}/{_secs(r.wait_p95_s)}",
                f"{r.preemptions} ({r.max_preemptions_per_job})",
                end_section=last,
            )
            g.add_row(
                a.path if first else "",
                run,
                _pp(r.mean_deficit_pp),
                _pct(r.goodput),
                f"{r.lost_gpu_h:,.0f} ({r.lost_pct:.1f}%)",
                str(r.completed),
                f"{_secs(r.jct_p50_s)}/{_secs(r.jct_p95_s)}",
                end_section=last,
            )
    c = table("cluster", "", "live stack", "simulator")
    rows: tuple[tuple[str, Any], ...] = (
        ("jobs submitted / placed", lambda r: f"{r.jobs} / {r.placed}"),
        ("GPU utilisation", lambda r: _pct(r.utilisation)),
        ("wait p50 / p95", lambda r: f"{_secs(r.wait_p50_s)} / {_secs(r.wait_p95_s)}"),
        ("share deficit mean / max (pp)", lambda r: f"{_pp(r.mean_deficit_pp)} / {_pp(r.max_deficit_pp)}"),
        ("goodput", lambda r: _pct(r.goodput)),
        ("work lost GPU-h (% of held)", lambda r: f"{r.lost_gpu_h:,.0f} ({r.lost_pct:.1f}%)"),
        ("jobs completed", lambda r: str(r.completed)),
        ("JCT p50 / p95", lambda r: f"{_secs(r.jct_p50_s)} / {_secs(r.jct_p95_s)}"),
        ("preemptions", lambda r: str(r.preemptions)),
        (
            "preemptions per job-h / most of a job",
            lambda r: f"{r.preemptions_per_job_hour:.4f} / {r.max_preemptions_per_job}",
        ),
        ("protection violations", lambda r: str(r.violations)),
    )
    for label, cell in rows:
        c.add_row(label, cell(live), cell(sim))
    c.add_row("wall time", f"{wall_replay:.0f} s replay", f"{sim_wall:.1f} s")
    return [t, g, c]


def _report(
    con: Any,
    args: argparse.Namespace,
    live: Any,
    sim: Any,
    wall_replay: float,
    sim_wall: float,
    records: int,
    dead_letters: int,
    verdict: dict[str, Any],
    Table: Any,
) -> int:
    diffs = [(abs(a.alloc_share - b.alloc_share) * 100, a.path) for a, b in zip(live.budgets, sim.budgets)]
    diffs.append((abs(live.utilisation - sim.utilisation) * 100, "utilisation"))
    worst, worst_what = max(diffs)
    agree = worst <= args.tolerance_pp and live.violations == 0 and sim.violations == 0
    doc = {
        "slice": args.slice,
        "seed": args.seed,
        "time_scale": args.time_scale,
        "live": live.to_dict(),
        "simulator": sim.to_dict(),
        "max_difference_pp": worst,
        "max_difference_of": worst_what,
        "tolerance_pp": args.tolerance_pp,
        "agree": agree,
        "records": records,
        "dead_letters": dead_letters,
        "replay_wall_s": wall_replay,
        "simulator_wall_s": sim_wall,
        "audit_verify": verdict,
    }
    write_private(args.dir / "report.json", json.dumps(doc, indent=2).encode())
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0 if agree and verdict["ok"] else 1
    for table in report_tables(args.slice, live, sim, wall_replay, sim_wall, Table):
        con.print(table)
    con.print(
        f"{records:,} records in the log, {dead_letters} dead letters. Largest difference live vs simulator "
        f"(per-budget allocated share, utilisation): {worst:.2f} pp ({worst_what}); tolerance "
        f"{args.tolerance_pp:g} pp; protection violations {live.violations} live, {sim.violations} simulated: "
        + ("[green]agree[/]" if agree else "[red]DISAGREE[/]")
    )
    for v in live.violation_detail + sim.violation_detail:
        con.print(f"[red]protection violation:[/] {v}")
    con.print("Live waits include the stack's real latency times the time scale (20 ms is about 30 event-s at 1440x).")
    _print_verdict(con, verdict)
    con.print(f"report written to {args.dir / 'report.json'}")
    return 0 if agree and verdict["ok"] else 1


def _print_verdict(con: Any, v: dict[str, Any]) -> None:
    """The ``audit verify`` verdict in a few lines (the first mismatches, where they are)."""
    what = (
        f"{v['records']:,} records, {v['snapshots']} snapshots, {v['decision_ticks']} decision ticks re-run, "
        f"read models {'compared' if v['read_models'] else 'skipped'}, {v['signed_requests']} signed requests "
        f"re-checked, {v['wall_s']:.1f} s"
    )
    if v["ok"]:
        con.print(f"audit verify: [green]OK[/] ({what})")
        return
    n = len(v["mismatches"])
    con.print(f"audit verify: [red]FAILED[/], {n} mismatches, first at {v['first_offset']} ({what})")
    for m in v["mismatches"][:5]:
        con.print(f"  {m['check']} {m['offset'] or '-'} {m['at'] or '-'} {m['subject']}: {m['detail']}")
    if n > 5:
        con.print(f"  ... {n - 5} more in report.json")
    con.print("  offline:")
    con.print(f"  apportion audit verify --from-file {v['export']}", soft_wrap=True)  # a command to copy: uncut


if __name__ == "__main__":
    sys.exit(main())
