"""The node agent without Kafka: commands in, processes and timers, job and node events out through ``emit``.

Consumes ``apportion.commands`` (every partition, filtering by the node ids
it hosts, see :mod:`services.node_agent.logic`) and ``NodeLost`` from
``apportion.nodes`` (a hosted node declared lost is fenced and rejoins:
its replicas are stopped, then it registers again); produces ``NodeRegistered``
and ``NodeHeartbeat`` on ``apportion.nodes`` and ``JobStarted``,
``JobCheckpointed``, ``JobCompleted``, ``JobFailed``, ``WorkloadRefused`` on
``apportion.jobs``.

Checkpoints (``docs/checkpoints.md``). Each process runs in its job's
persistent checkpoint directory (the same for every attempt), learns it and
its attempt number from the environment, and reports a checkpoint by
atomically rewriting its progress file. The agent stats those files every
``progress_poll_wall_s`` wall seconds and once more after the process exits
(before reporting the exit), and publishes ``JobCheckpointed`` once per new
value (:func:`services.node_agent.logic.observe_progress`). A simulated
workload publishes its own (:meth:`NodeAgent._simulate`): the simulator's model.

:class:`NodeAgent` is the runtime (state, journal, workload tasks) behind an
``emit`` coroutine, so service tests drive it with a list sink, a
:class:`~apportion.clock.ManualClock` and a :class:`~apportion.gpu.FakeGpuProbe`;
:func:`services.node_agent.app.run` connects it to Kafka, building it with
:func:`hosted_nodes` and :meth:`NodeAgent.from_settings` and publishing through a
:class:`SignedSender`.

Offsets. The commands consumer group is new the first time an agent runs:
it starts at the *end* of the topic (old commands were for earlier agents),
and waits for its partition assignment before registering its nodes, so no
command sent in reply to the registration is missed; it registers before it
handles the first record, so a command queued before this registration is
refused (``before_registration``), never executed late. Later starts resume
from the committed offsets; the journal (:mod:`services.node_agent.store`,
kept by default under the agent's state directory) makes redelivered
commands harmless and keeps the newest fencing token across restarts.

Membership. The consumer is a *static* group member (``group.instance.id``
= ``<topic prefix>node-agent.<agent>``, KIP-345): after a crash the restarted
agent takes its old member's place at once, where a dynamic member waited
out the old one's session timeout (45 s) before it got its partitions back.

Restarts. Replicas running when the agent died are adopted if still alive,
or reported ``JobLost`` (:meth:`NodeAgent.start`); the agent never reports
its own failure as a workload's ``JobFailed``.

Stopping. ``StopWorkload`` sends SIGTERM to the workload's process group,
then SIGKILL after ``grace_s`` event seconds (scaled clock: shorter in wall
time). A simulated workload is cancelled and reports exit code -15; one
started with ``progress_s`` first publishes the progress it had at the
SIGTERM when the stop has a grace period (``docs/checkpoints.md``, "Simulated
workloads": it also checkpoints at its interval while it runs).
Shutdown of the agent (SIGTERM) stops its workloads the same way with
``grace_s = 5`` and reports them ``JobLost`` (the dispatcher requeues them:
the agent's stop is not the workload's failure).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from apportion.clock import Clock
from apportion.domain.admission import UNAUTHENTICATED
from apportion.events import Event, NodeLost, StartWorkload, StopWorkload
from apportion.gpu import GpuProbe, SimulatedProbe, control_devices, open_probe, sim_node_ids, simulated_inventory
from services.node_agent import connfilter, landlock, logic
from services.node_agent.config import NodeAgentSettings
from services.node_agent.logic import AgentState, NodeSpec, ProgressWatch, RunKey, Workload
from services.node_agent.sandbox import (
    Accounts,
    Cgroup,
    PrivateMounts,
    Sandbox,
    cgroups,
    child_setup,
    disk_mb_per_gpu,
    disk_use,
    free_bytes,
    landlock_scopes,
    memory_mb_per_gpu,
    not_world_writable,
    own_dir,
    private_dir,
    protect_agent_files,
)
from services.node_agent.store import Journal, Orphan

log = logging.getLogger("apportion.node_agent")

Emit = Callable[[Event], Awaitable[None]]
EmitMany = Callable[[Sequence[Event]], Awaitable[None]]

SHUTDOWN_GRACE_S = 5.0

#: ``JobFailed.reason`` of a replica the OOM killer struck in its cgroup (not on a stop).
OOM = "oom"

#: The event types :meth:`NodeAgent.on_event` acts on; the consumer hands it no others (heartbeats and the rest
#: of ``apportion.nodes`` never reach the event loop).
HANDLED: tuple[type[Event], ...] = (StartWorkload, StopWorkload, NodeLost)

#: How long, ms, the agent's producer keeps an event it could not deliver yet (a broker outage) before it
#: gives up on it (``delivery_timeout_ms``; kafka-python's default is 2 minutes).
PRODUCER_PATIENCE_MS = 6 * 3600 * 1000


def hosted_nodes(settings: NodeAgentSettings) -> tuple[list[tuple[NodeSpec, GpuProbe]], str]:
    """The nodes this agent hosts with their GPU probes, and the node-id prefix it answers for.

    Simulated mode (``sim_nodes > 0``): ``sim_nodes`` nodes ``node_prefix`` + index sharing one
    :class:`~apportion.gpu.SimulatedProbe`, prefix ``node_prefix``. Real mode: one node
    (:meth:`NodeAgentSettings.real_node_id`) on NVML, or the declared inventory when no driver answers
    (:func:`apportion.gpu.open_probe` says so), prefix ``""``.
    """
    if settings.sim_nodes > 0:
        inv = simulated_inventory(
            settings.gpus_per_node, settings.gpu_model, reason="simulated nodes", device_files=settings.gpu_device_files
        )
        probe = SimulatedProbe(inv)
        ids = sim_node_ids(settings.node_prefix, settings.sim_nodes, settings.sim_node_start)
        log.info(
            "hosting %d simulated node(s) %s..%s, %d x %s each",
            len(ids),
            ids[0],
            ids[-1],
            inv.gpu_count,
            settings.gpu_model,
        )
        return [(NodeSpec(i, inv.gpus, inv.model, True), probe) for i in ids], settings.node_prefix
    p = open_probe(
        settings.gpus_per_node,
        settings.gpu_model,
        force_simulated=settings.force_simulated,
        device_files=settings.gpu_device_files,
    )
    inv = p.inventory
    return [(NodeSpec(settings.real_node_id(), inv.gpus, inv.model, inv.simulated), p)], ""


def agent_secrets(settings: NodeAgentSettings) -> list[Path | str | None]:
    """The agent's own secret files and directories: its nodes' key directory, the Kafka password file, the
    development keyring and the stack.env in force (made unreadable to others at start)."""
    from apportion.identity.keys import keyring_dir
    from apportion.settings import stack_env, stack_env_path

    password = os.environ.get("APPORTION_KAFKA_PASSWORD_FILE") or stack_env().get("APPORTION_KAFKA_PASSWORD_FILE")
    return [settings.node_key_dir, password, keyring_dir(), stack_env_path()]


def sandbox_of(settings: NodeAgentSettings, probes: list[GpuProbe]) -> Sandbox | None:
    """The isolation of process replicas the settings ask for (``job_isolation``), or ``None`` (logged).

    Not root: the sandbox refuses every process (it cannot switch accounts). No cgroup hierarchy found: the
    processes run as their users without cgroups (an error in the log).
    """
    if not settings.job_isolation:
        log.warning("job isolation is off: processes run as the agent, with its files and GPUs in reach")
        return None
    account_map = Accounts.read_map(settings.account_map_file) if settings.account_map_file else {}
    accounts = Accounts(account_map)
    driver = None
    if accounts.agent_uid != 0:
        log.log(
            logging.WARNING if settings.sim_nodes else logging.ERROR,
            "the agent is not root: it cannot run jobs as their users, so it refuses every process start "
            "(simulated workloads are unaffected)",
        )
        return Sandbox(accounts, None)
    try:
        driver = cgroups(settings.cgroup_root, settings.cgroup_parent_path(), settings.cgroup_version)
    except OSError as exc:
        log.error("cannot use the cgroups under %s: %s", settings.cgroup_root, exc)
    if driver is None:
        log.error(
            "no cgroup hierarchy under %s: replicas run without memory, device or process limits", settings.cgroup_root
        )
    memory = settings.sandbox_memory_mb_per_gpu
    if memory is None:
        total_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
        memory = memory_mb_per_gpu(total_mb, (p.inventory.gpu_count for p in probes))
    disk = settings.sandbox_disk_mb_per_gpu
    if disk is None:
        free = free_bytes([settings.checkpoint_root_path(), settings.job_log_path()])
        disk = disk_mb_per_gpu(free, (p.inventory.gpu_count for p in probes))
    mounts = PrivateMounts.available()
    closed = settings.closed_ports()
    if mounts is None:
        log.warning(
            "no mount and IPC namespaces for jobs here: replicas share the node's /tmp, /var/tmp, /run/lock, "
            "/dev/shm and IPC objects (each has its TMPDIR)"
        )
    box = Sandbox(
        accounts,
        driver,
        memory_mb_per_gpu=memory,
        cpu_weight_per_gpu=settings.sandbox_cpu_weight_per_gpu,
        pids_max=settings.sandbox_pids_max,
        job_path=settings.job_path,
        job_lang=settings.job_lang,
        shared_devices=control_devices(),
        private_mounts=mounts,
        closed_ports=closed,
        closed_addresses=connfilter.resolve(settings.connection().hosts()) if closed else (),
        landlock_scopes=landlock_scopes(),
        disk_mb_per_gpu=disk,
        disk_poll_wall_s=settings.sandbox_disk_poll_wall_s,
    )
    if box.closed_ports and (driver is None or not driver.closes_ports):
        log.error(
            "jobs may connect to the control plane's ports on loopback and on its addresses (%s; %s): no cgroup v2 "
            "hierarchy here takes a BPF connect filter; close them to job accounts with the node's firewall",
            ", ".join(map(str, box.closed_ports)),
            ", ".join(box.closed_addresses) or "none but loopback",
        )
    log.info(
        "job isolation: accounts of the jobs' users%s, cgroup v%s under %s, %d MiB, CPU weight %d and %d MiB of "
        "disk (measured every %g s) per GPU, %d processes%s%s",
        f" ({len(account_map)} mapped)" if account_map else "",
        driver.version if driver else "-",
        settings.cgroup_parent_path(),
        memory,
        settings.sandbox_cpu_weight_per_gpu,
        disk,
        settings.sandbox_disk_poll_wall_s,
        settings.sandbox_pids_max,
        f", ports {', '.join(map(str, box.closed_ports))} closed on loopback"
        + "".join(f", {a}" for a in box.closed_addresses)
        if box.closed_ports and driver is not None and driver.closes_ports
        else "",
        f", a Landlock domain each scoping {landlock.scope_names(box.landlock_scopes)}" if box.landlock_scopes else "",
    )
    return box


class SignedSender:
    """The agent's one publish path: every report signed with its node's key, queued, never awaited.

    Queued, not awaited: the idempotent acks=all producer keeps per-key order and retries for
    ``delivery_timeout_ms`` (:data:`PRODUCER_PATIENCE_MS`); waiting for each ack serialised the agent (one
    broker round trip per ``JobStarted`` and per heartbeat of each hosted node), which at 1440x delayed starts
    by ~2,000 event seconds in the main job. A send that still fails is logged and counted
    (``send_errors``); after a restart the journal re-publishes an adopted replica's ``JobStarted`` (or
    reports it ``JobLost``), so a lost ``JobStarted`` cannot hide a run for ever. The restart reports
    themselves are flushed (:meth:`flush`) before the journal marks them done.

    Args:
        producer: ``send(event, value) -> future`` with ``add_errback``, and ``flush(timeout_s)``
            (:class:`apportion.bus.producer.EventProducer`).
        signer: ``value(event) -> bytes``, the signed record value, and ``values(events) -> [bytes]``, those of
            a group (:class:`apportion.identity.keys.ReportSigner`).
        metrics: the agent's metrics (``send_errors`` is counted).
    """

    def __init__(self, producer: Any, signer: Any, metrics: dict) -> None:
        self._producer = producer
        self._signer = signer
        self._metrics = metrics

    async def emit(self, ev: Event) -> None:
        """Queue ``ev`` signed; a send refused at once (the buffer stayed full through an outage) is counted."""
        self._queue([ev], lambda: [self._signer.value(ev)])

    async def emit_many(self, evs: Sequence[Event]) -> None:
        """Queue ``evs`` in order, each node's reports among them under one batch signature (``signer.values``)."""
        self._queue(evs, lambda: self._signer.values(evs))

    def _queue(self, evs: Sequence[Event], sign: Callable[[], list[bytes]]) -> None:
        try:
            values = sign()
        except Exception as exc:  # noqa: BLE001 - counted and logged: never stop the agent
            for ev in evs:
                self.failed(ev, exc)
            return
        for ev, value in zip(evs, values, strict=True):
            try:
                fut = self._producer.send(ev, value)
            except Exception as exc:  # noqa: BLE001 - the buffer stayed full through an outage: never stop the agent
                self.failed(ev, exc)
                continue
            fut.add_errback(self.failed, ev)  # kafka-python calls failed(ev, exception)

    async def flush(self) -> None:
        """Wait (at most 30 wall seconds) until every queued event is acknowledged."""
        await asyncio.to_thread(self._producer.flush, 30.0)

    def failed(self, ev: Event, exc: BaseException) -> None:
        """``ev`` could not be delivered (after the producer's own retries): logged and counted.

        The event comes first: kafka-python's ``Future.add_errback(f, *args)`` calls ``f(*args, exception)``.
        (An errback that took the exception first would raise inside kafka-python's errback handler on every
        failed delivery instead of counting it.)
        """
        log.error("could not publish %s %s: %s", ev.type, getattr(ev, "job_id", getattr(ev, "node_id", "")), exc)
        self._metrics["send_errors"].inc()


class NodeAgent:
    """The agent runtime for one or many nodes.

    Args:
        nodes: hosted nodes with their GPU probes (``[(spec, probe)]``).
        emit: coroutine publishing one event (in production it queues the event on the idempotent
            producer without waiting for the ack: :class:`SignedSender`).
        clock: event time source.
        journal: run journal (default in memory).
        claim_prefix: node-id prefix this agent answers for (sim mode).
        heartbeat_interval_s: event seconds between heartbeats.
        heartbeat_min_wall_s: minimum wall seconds between heartbeats.
        metrics: optional dict of prometheus metrics (``commands``, ``refused``,
            ``running``, ``heartbeats``, ``checkpoints``, ``checkpoint_problems``).
        checkpoint_root: directory holding each job's persistent checkpoint
            directory (``docs/checkpoints.md``); ``None``: processes get no
            checkpoint directory, run in the agent's working directory and
            report no checkpoints.
        job_log_dir: directory of the per-job stdout/stderr files; ``None``:
            processes inherit the agent's output.
        progress_poll_wall_s: wall seconds between looks at the progress files
            of running processes (when started with ``poll_progress``), and
            at whether adopted processes still live.
        flush: coroutine waiting until every emitted event is acknowledged;
            awaited after the restart reports, before the journal marks them
            done (default: nothing to wait for).
        retention_s: event seconds ended replicas are remembered (duplicate
            starts refused) and a command stays executable.
        ended_cap: most ended replicas remembered, whatever their age.
        require_fenced_lost: ignore a ``NodeLost`` without a fencing token.
        sim_util_seed: seed of the GPU utilisation simulated workloads report
            (:func:`logic.simulated_utilisation`); ``None``: they report none.
        idle_after_s: event seconds a replica's GPUs stay idle before its heartbeat calls it ``idle``.
        sandbox: how process replicas are isolated (:mod:`services.node_agent.sandbox`: their user's
            account, a cgroup each); ``None``: processes run as the agent, with the clean environment but no
            other fence (tests of other concerns; never on a node that runs other people's code).
        group_commit: a command opens a group (:meth:`end_group` closes it, the consumer does before it
            commits its offsets): the group's journal lines are written with one write and one fsync, and
            every report made while it is open (heartbeats included) is published after that, in order.
            ``False``: each line is fsynced and each report published as it comes.
        emit_many: coroutine publishing a group's reports in order (one signature per node's share of
            them: :meth:`SignedSender.emit_many`); default ``emit`` on each.
    """

    def __init__(
        self,
        nodes: list[tuple[NodeSpec, GpuProbe]],
        emit: Emit,
        clock: Clock,
        *,
        journal: Journal | None = None,
        claim_prefix: str = "",
        heartbeat_interval_s: float = 10.0,
        heartbeat_min_wall_s: float = 0.5,
        metrics: dict | None = None,
        checkpoint_root: Path | None = None,
        job_log_dir: Path | None = None,
        progress_poll_wall_s: float = 1.0,
        flush: Callable[[], Awaitable[None]] | None = None,
        retention_s: float = logic.RETENTION_S,
        ended_cap: int = 100_000,
        require_fenced_lost: bool = False,
        sim_util_seed: int | None = None,
        dispatcher_key: str | None = None,
        sandbox: Sandbox | None = None,
        idle_after_s: float = logic.IDLE_AFTER_S,
        group_commit: bool = False,
        emit_many: EmitMany | None = None,
    ) -> None:
        self.sandbox = sandbox
        self._disk_task: asyncio.Task[None] | None = None
        self.group_commit = group_commit
        self._emit_many = emit_many
        #: reports made while a group is open, published once its journal lines are on disk (None: no group)
        self._held: list[Event] | None = None
        #: event seconds a replica's GPUs stay idle before its heartbeat calls it idle
        self.idle_after_s = idle_after_s
        self._idle: dict[RunKey, datetime] = {}
        self._idle_logged: set[RunKey] = set()
        self._cgroups: dict[RunKey, Cgroup] = {}
        self.sim_util_seed = sim_util_seed
        #: the dispatcher's public key (base64): a NodeLost it did not sign is disregarded; None: not checked
        self.dispatcher_key = dispatcher_key
        self.journal = journal or Journal(None)
        self.state: AgentState = logic.initial_state(
            [n for n, _ in nodes],
            claim_prefix,
            ended=self.journal.known(),
            fencing_token=self.journal.fencing_token,
            lost_runs=self.journal.lost_runs(),
            retention_s=retention_s,
            require_fenced_lost=require_fenced_lost,
        )
        self._flush = flush
        self.ended_cap = ended_cap
        self._adopted: dict[RunKey, Orphan] = {}
        self._shutdown_keys: set[RunKey] = set()
        self._sleeping: set[RunKey] = set()
        #: simulated replicas signalled -> event time of their SIGTERM (the progress a stop saves)
        self._sigterm_at: dict[RunKey, datetime] = {}
        self._probes = {n.node_id: p for n, p in nodes}
        self._send = emit
        self.clock = clock
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_min_wall_s = heartbeat_min_wall_s
        self._tasks: dict[RunKey, asyncio.Task[None]] = {}
        self._procs: dict[RunKey, asyncio.subprocess.Process] = {}
        self._killers: dict[RunKey, asyncio.Task[None]] = {}
        self._limits: dict[RunKey, asyncio.Task[None]] = {}  # replicas' time limits (StartWorkload.time_limit_s)
        self._lock = asyncio.Lock()
        self._metrics = metrics or {}
        self._hb_task: asyncio.Task[None] | None = None
        self.checkpoint_root = checkpoint_root
        self.job_log_dir = job_log_dir
        self.progress_poll_wall_s = progress_poll_wall_s
        self._progress: dict[RunKey, ProgressWatch] = {}
        self._poll_task: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(
        cls,
        settings: NodeAgentSettings,
        nodes: list[tuple[NodeSpec, GpuProbe]],
        claim_prefix: str,
        sender: SignedSender,
        clock: Clock,
        metrics: dict,
        *,
        group_commit: bool = False,
    ) -> NodeAgent:
        """The agent the settings describe: its journal, checkpoint and job-output directories (logged, with a
        warning when a real node's checkpoints would land in a temporary directory), timers and limits.

        Args:
            settings: the agent's configuration (:mod:`services.node_agent.config`).
            nodes, claim_prefix: from :func:`hosted_nodes`.
            sender: publishes and flushes the agent's events.
            clock: event-time source.
            metrics: :func:`apportion.metrics.node_agent_metrics`.
            group_commit: journal and report per poll of commands (the caller closes each group before it
                commits the poll: :meth:`end_group`).
        """
        for configured, setting in (
            (settings.state_dir, "--state-dir"),
            (settings.checkpoint_root, "--checkpoint-root"),
            (settings.job_log_dir, "--job-log-dir"),
        ):
            if configured is not None:
                not_world_writable(configured, setting)
        if settings.state_dir is None:  # the temporary default, at a name another account could take first
            private_dir(settings.data_dir())
        journal = Journal(settings.journal_path())  # makes the state directory, which is protected next
        protect_agent_files(
            agent_secrets(settings),
            settings.data_dir(),
            [settings.checkpoint_root_path(), settings.job_log_path()],
            settings.journal_path(),
        )
        log.info("journal %s", journal.path or "in memory only (a restart cannot adopt runs)")
        checkpoint_root, job_log_dir = settings.checkpoint_root_path(), settings.job_log_path()
        log.info(
            "job checkpoint directories under %s, job output under %s",
            checkpoint_root,
            job_log_dir,
            extra={"checkpoint_root": str(checkpoint_root), "job_log_dir": str(job_log_dir)},
        )
        if settings.checkpoint_root is None and settings.state_dir is None:
            # a real node runs processes; simulated nodes run them only for commands without a duration
            log.log(
                logging.INFO if settings.sim_nodes else logging.WARNING,
                "checkpoint root %s is a temporary directory: set APPORTION_CHECKPOINT_ROOT (or --state-dir) "
                "to persistent storage, shared by the nodes if jobs are to resume on another node",
                checkpoint_root,
            )
        return cls(
            nodes,
            sender.emit,
            clock,
            group_commit=group_commit,
            emit_many=sender.emit_many,
            journal=journal,
            claim_prefix=claim_prefix,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            heartbeat_min_wall_s=settings.heartbeat_min_wall_s,
            metrics=metrics,
            checkpoint_root=checkpoint_root,
            job_log_dir=job_log_dir,
            progress_poll_wall_s=settings.progress_poll_wall_s,
            flush=sender.flush,
            retention_s=settings.retention_s,
            ended_cap=settings.ended_cap,
            require_fenced_lost=settings.require_fenced_lost,
            sim_util_seed=settings.sim_util_seed,
            dispatcher_key=settings.dispatcher_public_key(),
            sandbox=sandbox_of(settings, [p for _, p in nodes]),
            idle_after_s=settings.idle_after_s,
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self, heartbeats: bool = True, poll_progress: bool = True, watch_disk: bool = True) -> None:
        """Settle the journal's orphans, register the nodes, start heartbeats, progress polling and (``watch_disk``,
        where the sandbox has a disk limit) the measurement of the jobs' directories (:meth:`check_disk`).

        Orphans (replicas running when the previous agent process died), each
        after its last checkpoint is published:

        * a process still alive (same pid and start time) is **adopted**: it
          keeps running, its ``JobStarted`` is published again as journalled
          (same id and content), it is watched until it exits and can be
          stopped; its exit code is not ours to read, so an exit without a stop
          is reported ``JobLost`` (requeued, resuming from its checkpoint);
        * a simulated workload with time left is adopted for the rest of its
          duration (to the journal's ``sim_until``, still checkpointing at its
          interval, from its original start); one whose duration ran out
          completes (``JobCompleted``);
        * anything else (the process is gone, cannot be verified, or its node
          is no longer hosted: killed) is reported ``JobLost``: the failure
          is the agent's, never ``JobFailed``.

        The reports are flushed before the journal marks them done, so a crash
        in between reports them again (same ids). Then the journal is pruned
        (and compacted when it grew), and only then are the nodes registered:
        every command is judged against this registration.
        """
        now = self.clock.now()
        reported: list[tuple[RunKey, bool]] = []
        for o in self.journal.orphans():
            node_id, job_id, attempt, replica = o.key
            hosted = node_id in self.state.nodes
            if o.progress_file is not None:  # its last checkpoint first (an id already published is a duplicate)
                await self._look_at_orphan(o)
            if hosted and o.pid and Journal.still_alive(o):
                await self._adopt(o, None)
                continue
            if hosted and o.pid is None and o.sim_until is not None:
                if o.sim_until > now:
                    await self._adopt(o, (o.sim_until - now).total_seconds())
                    continue
                w = self._orphan_workload(o, None)
                await self._emit(logic.exit_event(w, 0, now))
                reported.append((o.key, False))
                continue
            if o.pid and Journal.still_alive(o):  # alive but its node is no longer ours
                _killpg(o.pid, signal.SIGKILL)
            if o.pid and self.sandbox is not None and (cg := self.sandbox.reopen(o.key)) is not None:
                self._cgroups[o.key] = cg  # what it left behind (a child in its own session) goes with it
                await self._clear_cgroup(o.key)
            if o.pid:
                await self._clear_tmp(o.key)
            log.warning("replica %s was running when the agent stopped and is gone: reported lost", o.key)
            if (node_id, job_id, attempt) not in {(k[0], k[1], k[2]) for k, lost in reported if lost}:
                await self._emit(logic.lost_event(node_id, job_id, attempt, now))
            reported.append((o.key, True))
        if reported:
            try:
                if self._flush is not None:
                    await self._flush()
            except Exception as exc:  # noqa: BLE001 - reported again on the next start (same ids)
                log.error("could not flush the restart reports (%s): they are sent again on the next start", exc)
            else:
                for key, lost in reported:
                    self.journal.ended(key, now, lost=lost)
            self.state = replace(self.state, ended=self.state.ended | {k for k, _ in reported})
            self.state = logic.with_lost_runs(self.state, {(k[1], k[2]) for k, lost in reported if lost})
        self._prune(now)
        regs = logic.registered_events(self.state, now)
        for ev in regs:
            await self._emit(ev)
        self.state = logic.with_registered(self.state, regs)
        log.info("registered %d node(s)", len(self.state.nodes), extra={"nodes": sorted(self.state.nodes)[:8]})
        if heartbeats:
            self._hb_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeats")
        if poll_progress and self.checkpoint_root is not None:
            self._poll_task = asyncio.create_task(self._progress_loop(), name="progress")
        if watch_disk and self._disk_limited():
            self._disk_task = asyncio.create_task(self._disk_loop(), name="disk")

    def _orphan_workload(self, o: Orphan, sim_s: float | None) -> Workload:
        """The :class:`Workload` an orphan stands for (its command is not journalled: an empty argv).

        A simulated orphan journalled with its resume point (``sim_progress``) and start keeps its
        checkpoint model: its whole duration is ``sim_progress + (sim_until - started_at)``, counted from
        its original start (:meth:`_simulate` publishes the last checkpoint passed while the agent was down).
        Otherwise it runs ``sim_s`` more seconds, without checkpoints.
        """
        files = None
        if o.progress_file is not None:
            files = logic.JobFiles(os.path.dirname(o.progress_file), o.progress_file)
        progress = every = None
        if o.pid is None and o.sim_progress is not None and o.sim_until is not None and o.started_at is not None:
            progress, every = o.sim_progress, o.sim_every
            sim_s = o.sim_progress + (o.sim_until - o.started_at).total_seconds()
        return Workload(
            *o.key,
            gpus=o.gpus,
            command=None if o.pid is None else (),
            duration_s=sim_s,
            files=files,
            started_at=o.started_at,
            adopted=o.pid is not None,
            progress_s=progress,
            checkpoint_interval_s=every,
            time_limit_s=o.time_limit_s,
        )

    async def _adopt(self, o: Orphan, sim_s: float | None) -> None:
        """Run orphan ``o`` on (a live process, or a simulated workload for ``sim_s`` more seconds)."""
        w = self._orphan_workload(o, sim_s)
        log.info("adopted %s after a restart (%s)", o.key, f"pid {o.pid}" if o.pid else f"{sim_s:.1f} s left")
        if o.pid:
            self._adopted[o.key] = o
            if self.sandbox is not None and (cg := self.sandbox.reopen(o.key)) is not None:
                self._cgroups[o.key] = cg
            if w.files is not None:
                self._progress[o.key] = ProgressWatch(stamp=_stamp(w.files.progress_file))
        self.state = logic.with_launched(self.state, w)
        self._tasks[o.key] = asyncio.create_task(self._watch(w), name=f"workload {o.key}")
        if o.time_limit_s is not None:  # counted from its start, not from the adoption
            ran = (self.clock.now() - o.started_at).total_seconds() if o.started_at is not None else 0.0
            self._limits[o.key] = asyncio.create_task(
                self._limit(o.key, o.time_limit_s, max(o.time_limit_s - ran, 0.0)), name=f"limit {o.key}"
            )
        self._gauge()
        if o.started_at is not None:  # the same event as before the restart: readers de-duplicate it
            await self._emit(logic.started_event(w, o.started_at, o.pid))

    def _prune(self, now) -> None:
        """Forget ended replicas beyond the retention window (journal and state); compact a grown journal.

        Compaction rewrites about as many lines as are live, and happens once the
        file holds twice that plus 1,000: amortised, a constant per line written.
        """
        gone = self.journal.prune(now, self.state.retention_s, self.ended_cap)
        if gone:
            self.state = logic.forgotten(self.state, gone)
        if self.journal.needs_compaction():
            self.journal.compact()

    async def heartbeat(self) -> None:
        """Publish one heartbeat per hosted node: each running replica's GPU utilisation in this sample, and how
        long its GPUs have been idle (:func:`logic.idle_since`, counted over the heartbeats' samples)."""
        now = self.clock.now()
        for node_id in sorted(self.state.nodes):
            gpus = logic.sampled_gpus(self.state, node_id, self._probes[node_id].sample(), self.sim_util_seed)
            idle = logic.idle_since(self.state, node_id, gpus, now, self._idle)
            self._idle = {k: t for k, t in self._idle.items() if k[0] != node_id} | idle
            hb = logic.heartbeat_event(self.state, node_id, now, gpus, idle=idle, idle_after_s=self.idle_after_s)
            for r in hb.running:
                key = (node_id, r.job_id, r.attempt, r.replica)
                if r.idle and (key not in self._idle_logged):  # once per idle spell, not at every heartbeat
                    log.info("%s attempt %d replica %d on %s: GPUs idle for %.0f s", *key[1:], node_id, r.idle_s)
            self._idle_logged = {k for k in self._idle_logged if k[0] != node_id} | {
                (node_id, r.job_id, r.attempt, r.replica) for r in hb.running if r.idle
            }
            await self._emit(hb)
            if "heartbeats" in self._metrics:
                self._metrics["heartbeats"].inc()

    async def _heartbeat_loop(self) -> None:
        while True:
            if self.clock.wall_seconds(self.heartbeat_interval_s) >= self.heartbeat_min_wall_s:
                await self.clock.sleep(self.heartbeat_interval_s)
            else:  # a fast clock: cap the rate in wall time
                await asyncio.sleep(self.heartbeat_min_wall_s)
            await self.heartbeat()

    async def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop heartbeats and every workload (SIGTERM, SIGKILL after ``grace_s``); wait for them.

        Progress polling stops too; each workload's progress file is still read
        once after it exits, so a checkpoint written on SIGTERM is published. An open group is closed first.

        Before any workload is stopped, each hosted node is registered again with no GPUs (and flushed):
        the dispatcher then places nothing on a node whose agent is going away, so the ``JobLost`` of its
        replicas requeues them for other nodes, or until the agent registers again at its next start.
        """
        await self.end_group()
        for t in (self._hb_task, self._poll_task, self._disk_task):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        for ev in logic.registered_events(self.state, self.clock.now()):
            await self._emit(ev.model_copy(update={"gpu_count": 0, "gpus": ()}))
        if self._flush is not None:
            try:
                await self._flush()
            except Exception as exc:  # noqa: BLE001 - stopping anyway: the heartbeat timeout declares the node lost
                log.error("could not flush the withdrawal of the nodes (%s)", exc)
        async with self._lock:
            keys = [k for k, w in self.state.running.items() if not w.stopping]
            self._shutdown_keys.update(keys)  # the agent's failure, not theirs: reported lost
            for k in keys:
                w = replace(self.state.running[k], stopping=True, grace_s=grace_s)
                self.state = replace(self.state, running={**self.state.running, k: w})
                self._signal(w, grace_s)
        await self.idle()
        if self.sandbox is not None and self.sandbox.driver is not None:
            self.sandbox.driver.release()

    async def idle(self) -> None:
        """Wait until no workload task is left (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    # ------------------------------------------------------------------ checkpoints

    async def poll_progress(self) -> None:
        """Look once at the progress file of every running process; publish new checkpoints."""
        async with self._lock:
            for key in sorted(self._progress):
                w = self.state.running.get(key)
                if w is not None:
                    await self._look_at_progress(w)

    async def _progress_loop(self) -> None:
        while True:
            await asyncio.sleep(self.progress_poll_wall_s)
            try:
                await self.poll_progress()
            except Exception:  # a surprise in one look must not end polling for every workload
                log.exception("progress poll failed")

    # ------------------------------------------------------------------ disk

    def _disk_limited(self) -> bool:
        return (
            self.checkpoint_root is not None and self.sandbox is not None and self.sandbox.disk_mb_per_gpu is not None
        )

    async def check_disk(self) -> list[str]:
        """Measure the directories of every job with a process replica running here (:func:`logic.disk_checks`;
        each walk in a worker thread, never on the event loop, and bounded: :func:`disk_use`); stop the replicas of
        each job over its limit as at a time limit (SIGTERM, the default grace, SIGKILL), their exits reported
        ``JobFailed`` reason ``disk_quota``. Returns the jobs stopped, in order."""
        if not self._disk_limited():
            return []
        assert self.checkpoint_root is not None and self.sandbox is not None and self.sandbox.disk_mb_per_gpu
        log_dir = str(self.job_log_dir) if self.job_log_dir is not None else None
        stopped = []
        for check in logic.disk_checks(self.state, str(self.checkpoint_root), log_dir, self.sandbox.disk_mb_per_gpu):
            use = await asyncio.to_thread(disk_use, check.roots, check.limit_bytes)
            if not use.over(check.limit_bytes):
                continue
            async with self._lock:
                signalled = False
                for key in check.replicas:
                    self.state, w = logic.with_limit_reached(self.state, key, logic.DISK_QUOTA)
                    if w is not None:
                        self._signal(w, w.grace_s)
                        signalled = True
            if signalled:
                stopped.append(check.job_id)
                log.warning(
                    "job %s is over its disk limit of %d bytes on this node (%s): stopping its replicas %s",
                    check.job_id,
                    check.limit_bytes,
                    f"{use.unreadable} cannot be listed" if use.unreadable else f"at least {use.used_bytes} bytes",
                    [k[3] for k in check.replicas],
                )
        return stopped

    async def _disk_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sandbox.disk_poll_wall_s if self.sandbox is not None else 5.0)
            try:
                await self.check_disk()
            except Exception:  # a surprise in one pass must not end the measuring for every job
                log.exception("disk measurement failed")

    async def _look_at_orphan(self, o: Orphan) -> None:
        """Publish the checkpoint an orphan's progress file holds, if it changed since the orphan started."""
        path = o.progress_file or ""
        stamp, raw = _look(path, o.progress_stamp)
        seen = logic.observe_progress(ProgressWatch(stamp=o.progress_stamp), o.key, stamp, raw, self.clock.now())
        if seen.problem is not None:
            log.warning("ignored progress report of orphan %s (%s): %s", o.key, path, seen.problem)
        if seen.event is not None:
            log.info("checkpoint of orphan %s at %.3f s", o.key, seen.event.progress_s)
            await self._emit(seen.event)

    async def _look_at_progress(self, w: Workload) -> None:
        """Stat (and, if it changed, read) ``w``'s progress file; publish or log the outcome (lock held)."""
        watch = self._progress.get(w.key)
        if watch is None or w.files is None:
            return
        path = w.files.progress_file
        stamp, raw = _look(path, watch.stamp)
        seen = logic.observe_progress(watch, w.key, stamp, raw, self.clock.now())
        self._progress[w.key] = seen.watch
        if seen.problem is not None:
            log.warning(
                "ignored progress report of %s attempt %d replica %d (%s): %s",
                w.job_id,
                w.attempt,
                w.replica,
                path,
                seen.problem,
            )
            if "checkpoint_problems" in self._metrics:
                self._metrics["checkpoint_problems"].inc()
        if seen.event is not None:
            log.info(
                "checkpoint of %s attempt %d replica %d at %.3f s",
                w.job_id,
                w.attempt,
                w.replica,
                seen.event.progress_s,
            )
            await self._publish_checkpoint(seen.event)

    # ------------------------------------------------------------------ commands

    async def on_event(self, event: Event, delivery: object = None) -> None:
        """Handle one decoded event: a command, or ``NodeLost`` of a hosted node (others are ignored).

        ``delivery``: where it was read (:class:`apportion.bus.consumer.Delivery`); its ``value`` is the
        record's bytes, on which a loss's signature is checked.
        """
        if isinstance(event, NodeLost):
            await self.on_lost(event, getattr(delivery, "value", None))
            return
        if not isinstance(event, (StartWorkload, StopWorkload)):
            return
        self._open_group()
        async with self._lock:
            now = self.clock.now()
            if isinstance(event, StartWorkload):
                account = (  # a start without a command runs no process: no account to find
                    self.sandbox.accounts.resolve(event.user)
                    if self.sandbox is not None and event.command is not None
                    else None
                )
                action = logic.decide_start(self.state, event, now, account)
            else:
                action = logic.decide_stop(self.state, event, now)
            if not isinstance(action, logic.Ignore) and "commands" in self._metrics:
                self._metrics["commands"].labels(type=event.type).inc()
            if event.node_id in self.state.nodes:
                self._saw_token(event.fencing_token)
            await self._act(action)

    # ------------------------------------------------------------------ group commit

    def _open_group(self) -> None:
        if self.group_commit and self._held is None:
            self.journal.hold()
            self._held = []

    async def _emit(self, ev: Event) -> None:
        """Publish ``ev``, or hold it until the open group's journal lines are on disk."""
        if self._held is not None:
            self._held.append(ev)
        else:
            await self._send(ev)

    async def end_group(self) -> None:
        """Close the open group: its journal lines in one write and fsync (off the event loop), then its reports.

        Lines and reports that arrive while the write is under way (a workload ending, a heartbeat) join the
        group and go out in a further round, so no report is ever published before its journal line and the
        file keeps the order in which the agent acted. Returns once everything held is written and published
        (queued on the producer); the consumer commits the group's commands after that.
        """
        if self._held is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            lines = self.journal.take()
            held, self._held = self._held, []
            if not lines and not held:
                break
            if lines:
                try:
                    await loop.run_in_executor(None, self.journal.append, lines)
                except BaseException:  # not on disk: nothing of it is published; the next close tries again
                    self.journal.put_back(lines)
                    self._held[:0] = held
                    raise
            if self._emit_many is not None and held:
                await self._emit_many(held)
            else:
                for ev in held:
                    await self._send(ev)
        self._held = None
        self.journal.release()

    def _saw_token(self, token: int | None) -> None:
        """Remember a newer valid token, in the journal first (fsynced, with its group when one is open, before the
        command is committed), so a restart keeps refusing older ones."""
        before = self.state.fencing_token
        self.state = logic.with_token(self.state, token)
        if self.state.fencing_token != before and self.state.fencing_token is not None:
            self.journal.token(self.state.fencing_token)
            log.info("fencing token %d (was %s)", self.state.fencing_token, before)

    async def _act(self, action: logic.Action) -> None:
        if isinstance(action, logic.Ignore):
            if action.reason is None:
                log.debug("ignored command: %s", action.why)
                return
            log.warning("disregarded %s", action.why)
            if "refused" in self._metrics:
                self._metrics["refused"].labels(reason=action.reason).inc()
        elif isinstance(action, logic.Refuse):
            log.warning(
                "refused %s attempt %d on %s: %s",
                action.event.job_id,
                action.event.attempt,
                action.event.node_id,
                action.event.reason,
            )
            if "refused" in self._metrics:
                self._metrics["refused"].labels(reason=action.event.reason.split(":")[0]).inc()
            await self._emit(action.event)
        elif isinstance(action, logic.Launch):
            await self._launch(action.workload)
        elif isinstance(action, logic.Defer):
            log.info("start of %s waits for GPUs held by stopping %s", action.workload.key, action.blocked_by)
            self.state = logic.with_deferred(self.state, action.workload)
        elif isinstance(action, logic.Stop):
            self.state = logic.with_stopping(self.state, action)
            for ev in action.events:
                self.journal.ended(logic.ended_key(ev), ev.ts)
                await self._emit(ev)
            for w in action.workloads:
                self._signal(w, action.grace_s)

    async def on_lost(self, event: NodeLost, raw: bytes | None = None) -> None:
        """Fence a hosted node declared lost: stop its replicas, register it again once they exited.

        With :attr:`dispatcher_key` set, a loss whose record value ``raw`` that key did not sign is
        disregarded (``unauthenticated``), before its token is looked at: another node's agent may
        write ``apportion.nodes`` (rule D10.authentication).
        """
        if self.dispatcher_key is not None and event.node_id in self.state.nodes:
            from apportion.identity.canonical import signer_of

            if signer_of(raw, appended=True) != self.dispatcher_key:
                log.warning("disregarded NodeLost of %s: not signed by the dispatcher's key", event.node_id)
                if "refused" in self._metrics:
                    self._metrics["refused"].labels(reason=UNAUTHENTICATED).inc()
                return
        self._open_group()
        async with self._lock:
            action = logic.decide_lost(self.state, event, self.clock.now(), SHUTDOWN_GRACE_S)
            if event.node_id in self.state.nodes:
                self._saw_token(event.fencing_token)
            if isinstance(action, logic.Ignore):
                if action.reason is not None:
                    log.warning("disregarded NodeLost: %s", action.why)
                    if "refused" in self._metrics:
                        self._metrics["refused"].labels(reason=action.reason).inc()
                else:
                    log.debug("ignored NodeLost of %s: %s", event.node_id, action.why)
                return
            if event.fencing_token is None:
                log.warning(
                    "obeying NodeLost of %s without a fencing token (a dispatcher that does not stamp it)",
                    event.node_id,
                )
            log.warning(
                "node %s was declared lost (last heartbeat %s, token %s): stopping %d replica(s)%s",
                event.node_id,
                event.last_heartbeat.isoformat(),
                event.fencing_token,
                len(action.stop.workloads),
                ", then rejoining" if action.register else "",
            )
            self.state = logic.with_rejoining(self.state, action)
            for ev in action.stop.events:
                self.journal.ended(logic.ended_key(ev), ev.ts)
                await self._emit(ev)
            for w in action.stop.workloads:
                self._signal(w, action.stop.grace_s)
            await self._rejoin_ready()

    async def _rejoin_ready(self) -> None:
        """Register again every rejoining node with nothing left on it (lock held)."""
        ready = logic.ready_to_rejoin(self.state)
        if not ready:
            return
        regs = logic.registered_events(self.state, self.clock.now(), only=ready)
        for ev in regs:
            await self._emit(ev)
        self.state = logic.with_registered(self.state, regs)
        log.info("node(s) %s registered again after being lost", ", ".join(ready))

    # ------------------------------------------------------------------ workloads

    async def _launch(self, w: Workload) -> None:
        """Start ``w`` (process or simulated), journal it, report JobStarted (lock held).

        A process gets its job's checkpoint directory (created if missing) as
        working directory and in its environment, and its output goes to its
        per-job files, when the agent has those roots configured. The progress
        file's stamp is taken before the process starts, so a report left by an
        earlier attempt is not published again for this one.
        """
        now = self.clock.now()
        pid = None
        w = replace(w, started_at=now)
        if w.command is not None:  # not simulated: a process
            command = w.command
            if self.checkpoint_root is not None:
                log_dir = str(self.job_log_dir) if self.job_log_dir is not None else None
                w = replace(w, files=logic.job_files(str(self.checkpoint_root), log_dir, w))
            box = self.sandbox
            env = w.process_env(box.job_path, box.job_lang) if box is not None else w.process_env()
            cgroup: Cgroup | None = None
            try:
                if box is not None and w.account is None:  # never the agent's account (rule 10a decides first)
                    raise OSError("no account to run it as")
                outputs = _open_outputs(w.files, w.account)
                try:
                    mounts = box.private_mounts if box is not None else None
                    if w.files is not None:
                        own_dir(w.files.checkpoint_dir, w.account)
                        if w.files.tmp_dir is not None:
                            own_dir(w.files.tmp_dir, w.account)
                        self._progress[w.key] = logic.ProgressWatch(stamp=_stamp(w.files.progress_file))
                        if mounts is not None:
                            mounts = mounts.for_dirs(d for d in (w.files.checkpoint_dir, w.files.tmp_dir) if d)
                    if box is not None:
                        cgroup = box.cgroup_for(w.key, len(w.gpus), self._gpu_files(w))
                    proc = await asyncio.create_subprocess_exec(
                        *command,
                        env=env,
                        start_new_session=True,
                        cwd=w.files.checkpoint_dir if w.files is not None else None,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=outputs[0],
                        stderr=outputs[1],
                        preexec_fn=child_setup(
                            cgroup.procs_files() if cgroup else (),
                            w.account,
                            mounts.setup if mounts else None,
                            box.landlock_scopes,
                            None
                            if box.disk_mb_per_gpu is None
                            else logic.disk_limit_bytes(len(w.gpus), box.disk_mb_per_gpu),
                        )
                        if box is not None
                        else None,
                    )
                finally:
                    for f in outputs:
                        if f is not None:
                            f.close()
            except (OSError, ValueError, subprocess.SubprocessError) as exc:  # ValueError: a NUL in the argv
                if cgroup is not None:
                    cgroup.kill()
                    cgroup.remove()
                await self._clear_tmp(w.key)
                self._progress.pop(w.key, None)
                self.journal.ended(w.key, now)
                self.state = replace(
                    self.state,
                    ended=self.state.ended | {w.key},
                    waiting={k: v for k, v in self.state.waiting.items() if k != w.key},
                )
                await self._emit(logic.exit_event(w, None, now, reason=f"spawn failed: {exc}"))
                return
            pid = proc.pid
            self._procs[w.key] = proc
            if cgroup is not None:
                self._cgroups[w.key] = cgroup
        watch = self._progress.get(w.key)
        self.journal.started(
            w.key,
            pid,
            w.files.progress_file if w.files is not None and watch is not None else None,
            watch.stamp if watch is not None else None,
            ts=now,
            gpus=w.gpus,
            sim_until=now + timedelta(seconds=logic.sim_remaining_s(w)) if w.simulated else None,
            sim_progress=w.progress_s if w.simulated else None,
            sim_every=w.checkpoint_interval_s if w.simulated else None,
            time_limit_s=w.time_limit_s,
        )
        self.state = logic.with_launched(self.state, w)
        self._tasks[w.key] = asyncio.create_task(self._watch(w), name=f"workload {w.key}")
        if w.time_limit_s is not None:
            self._limits[w.key] = asyncio.create_task(self._limit(w.key, w.time_limit_s), name=f"limit {w.key}")
        self._gauge()
        await self._emit(logic.started_event(w, now, pid))

    async def _watch(self, w: Workload) -> None:
        """Wait for ``w`` to end, then report it and launch what waited for its GPUs."""
        code: int | None
        try:
            if w.simulated:
                self._sleeping.add(w.key)
                try:
                    if self._stopping(w.key):  # stopped before this task first ran: a cancel would skip the report
                        raise asyncio.CancelledError
                    if w.progress_s is None:  # a command from before checkpoints: the whole duration, no saves
                        await self.clock.sleep(w.duration_s or 0.0)
                    else:
                        await self._simulate(w)
                    code = 0
                except asyncio.CancelledError:
                    if self._stopping(w.key):
                        code = -signal.SIGTERM
                    else:
                        raise
            elif w.adopted:
                code = None
                orphan = self._adopted[w.key]
                while Journal.still_alive(orphan):
                    await asyncio.sleep(self.progress_poll_wall_s)
            else:
                code = await self._procs[w.key].wait()
        finally:
            oom = await self._clear_cgroup(w.key)
            if w.command is not None:
                await self._clear_tmp(w.key)
            self._sleeping.discard(w.key)
            self._procs.pop(w.key, None)
            self._adopted.pop(w.key, None)
            for tasks in (self._killers, self._limits):
                k = tasks.pop(w.key, None)
                if k is not None and k is not asyncio.current_task():
                    k.cancel()
        async with self._lock:
            current = self.state.running.get(w.key, w)
            if w.key in self._progress:  # a last look: the checkpoint written on SIGTERM goes before the exit
                await self._look_at_progress(current)
                del self._progress[w.key]
            term_at = self._sigterm_at.pop(w.key, None)
            if current.simulated and code is not None and code < 0 and term_at is not None:
                await self._save_on_sigterm(current, term_at)
            now = self.clock.now()
            shut = w.key in self._shutdown_keys
            lost = shut or (current.adopted and not current.stopping)
            if lost:  # stopped by the agent's own shutdown, or an adopted process (exit code unknown)
                log.warning(
                    "replica %s %s: reported lost",
                    w.key,
                    "stopped by the agent's shutdown" if shut else "adopted after a restart exited (outcome unknown)",
                )
                await self._emit(logic.lost_event(w.node_id, w.job_id, w.attempt, now))
                self.state = logic.with_lost_runs(self.state, {(w.job_id, w.attempt)})
            else:
                reason = OOM if oom and not current.stopping else None
                if reason is not None:
                    log.warning("replica %s was killed for memory (the cgroup's OOM killer)", w.key)
                elif code == -signal.SIGXFSZ and self._disk_limited() and not current.stopping:
                    reason = logic.DISK_QUOTA  # a file past the replica's limit (RLIMIT_FSIZE)
                    log.warning("replica %s was killed for writing a file beyond its disk limit", w.key)
                await self._emit(logic.exit_event(current, code, now, reason=reason))
            self.journal.ended(w.key, now, lost=lost)
            self.state = logic.with_exited(self.state, w.key)
            self._prune(now)
            for nxt in logic.ready_to_launch(self.state):
                await self._launch(nxt)
            await self._rejoin_ready()
            self._gauge()
        self._tasks.pop(w.key, None)

    async def _limit(self, key: RunKey, limit_s: float, left_s: float | None = None) -> None:
        """Stop replica ``key`` when it has run ``limit_s`` event seconds (its time limit): SIGTERM, the default
        grace, SIGKILL, as a preemption does; its exit is reported ``JobFailed`` reason ``time_limit``
        (:func:`logic.with_limit_reached`).
        ``left_s``: the event seconds still to wait (an adopted replica's limit runs from its start), default
        ``limit_s``."""
        await self.clock.sleep(limit_s if left_s is None else left_s)
        async with self._lock:
            self.state, w = logic.with_limit_reached(self.state, key, logic.TIME_LIMIT)
            if w is not None:
                log.info("replica %s reached its time limit of %.0f s: stopping it", key, limit_s)
                self._signal(w, w.grace_s)

    async def _simulate(self, w: Workload) -> None:
        """Run simulated workload ``w`` for :func:`logic.sim_remaining_s` event seconds from ``w.started_at``,
        publishing ``JobCheckpointed`` (:func:`logic.checkpointed_event`) at each multiple of its interval
        that its progress reaches (``docs/checkpoints.md``; the simulator's model).

        Deadlines are counted from the start, not from each wake-up, so a late wake (a coarse clock, an agent
        adopting the run after a restart) publishes the last checkpoint passed, stamped when it is seen, and
        the run still ends at ``started_at + duration - progress`` (the journal's ``sim_until``).
        """
        start = w.started_at or self.clock.now()
        saved = logic.sim_checkpoint_k(w, 0.0)  # the resume point: saved by an earlier attempt
        every = w.checkpoint_interval_s or 0.0
        while True:
            elapsed = (self.clock.now() - start).total_seconds()
            wake = logic.sim_next_wake_s(w, elapsed)
            if wake is None:  # its time is up (also after a late wake): it completes, no checkpoint at the end
                return
            k = logic.sim_checkpoint_k(w, elapsed)
            if k > saved:
                saved = k
                log.debug("simulated checkpoint of %s at %.3f s", w.key, k * every)
                await self._publish_checkpoint(logic.checkpointed_event(w.key, k * every, self.clock.now()))
            await self.clock.sleep(max(wake - elapsed, 1e-6))  # at least 1 µs: time must move for a wake

    async def _save_on_sigterm(self, w: Workload, term_at: datetime) -> None:
        """The last ``JobCheckpointed`` of simulated workload ``w`` stopped at ``term_at``: its progress then
        (:func:`logic.sim_stop_progress_s`), published before its exit report (lock held)."""
        start = w.started_at or term_at
        progress = logic.sim_stop_progress_s(w, (term_at - start).total_seconds())
        if progress is None:
            return
        log.debug("simulated workload %s saves %.3f s on SIGTERM", w.key, progress)
        await self._publish_checkpoint(logic.checkpointed_event(w.key, progress, self.clock.now()))

    async def _publish_checkpoint(self, event: Event) -> None:
        """Publish a ``JobCheckpointed`` (a process's progress file, or a simulated workload's) and count it."""
        if "checkpoints" in self._metrics:
            self._metrics["checkpoints"].inc()
        await self._emit(event)

    def _stopping(self, key: RunKey) -> bool:
        w = self.state.running.get(key)
        return w is not None and w.stopping

    def _signal(self, w: Workload, grace_s: float) -> None:
        """SIGTERM ``w`` now; SIGKILL after ``grace_s`` event seconds."""
        task = self._tasks.get(w.key)
        if w.simulated:
            self._sigterm_at.setdefault(w.key, self.clock.now())  # the progress it saves is the progress now
            if task is not None and w.key in self._sleeping:  # not yet started: it sees the stop when it starts
                task.cancel()
            return
        orphan = self._adopted.get(w.key)
        proc = self._procs.get(w.key)
        if orphan is not None:
            pid = orphan.pid or 0

            def alive() -> bool:
                return Journal.still_alive(orphan)
        elif proc is not None:
            pid = proc.pid

            def alive() -> bool:
                return proc.returncode is None
        else:
            return
        if not alive():
            return
        cgroup = self._cgroups.get(w.key)
        _killpg(pid, signal.SIGTERM)
        if cgroup is not None:  # every process of the replica, also those that left its process group
            cgroup.signal(signal.SIGTERM)

        async def kill_later() -> None:
            await self.clock.sleep(grace_s)
            if alive():
                log.warning("workload %s ignored SIGTERM for %.1fs: SIGKILL", w.key, grace_s)
                _killpg(pid, signal.SIGKILL)
                if cgroup is not None:
                    await asyncio.to_thread(cgroup.kill)

        self._killers[w.key] = asyncio.create_task(kill_later())

    def _gpu_files(self, w: Workload) -> list[str]:
        """The device files of ``w``'s GPUs, as its node's inventory names them (none for a declared GPU without)."""
        files = self._probes[w.node_id].inventory.device_files
        return [files[g] for g in w.gpus if g in files]

    async def _clear_cgroup(self, key: RunKey) -> bool:
        """Once a replica's main process is gone: kill whatever is left in its cgroup, remove it; True when
        the OOM killer struck in it."""
        cgroup = self._cgroups.pop(key, None)
        if cgroup is None:
            return False
        oom = False
        try:
            oom = cgroup.oom_kills() > 0
            await asyncio.to_thread(cgroup.kill)
            if not await asyncio.to_thread(cgroup.remove):
                log.error("cgroup %s of %s still holds processes %s: left in place", cgroup.name, key, cgroup.pids())
        except OSError as exc:
            log.error("could not clear the cgroup %s of %s: %s", cgroup.name, key, exc)
        return oom

    async def _clear_tmp(self, key: RunKey) -> None:
        """Remove a process replica's ``TMPDIR`` once none of its processes is left (a link planted at its name
        is not followed: left in place, logged)."""
        if self.checkpoint_root is None:
            return
        log_dir = str(self.job_log_dir) if self.job_log_dir is not None else None
        path = logic.tmp_dir(str(self.checkpoint_root), log_dir, key)
        try:
            await asyncio.to_thread(shutil.rmtree, path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("could not remove the temporary directory %s of %s: %s", path, key, exc)

    def _gauge(self) -> None:
        if "running" in self._metrics:
            self._metrics["running"].set(len(self.state.running))


def _stamp(path: str) -> logic.FileStamp | None:
    """``(inode, size, mtime_ns)`` of ``path``, or ``None`` when it is missing or not a regular file.

    ``lstat``: a symbolic link is not followed (a workload must not make the
    agent read, and log a piece of, a file of its choosing); it counts as absent.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _look(path: str, known: logic.FileStamp | None) -> tuple[logic.FileStamp | None, bytes | None]:
    """The progress file's stamp now, and its first ``MAX_PROGRESS_BYTES + 1`` bytes when the stamp is not ``known``.

    The content is ``None`` when unchanged, or when it cannot be read as a
    regular file with one name: it vanished, permissions, it was swapped for a
    link or FIFO after the stat (opened without following links and
    non-blocking, then checked again), or it is a hard link (a file the job
    linked there from elsewhere, which the agent, root, would read for it:
    where ``fs.protected_hardlinks`` is off, one the job itself cannot read).
    """
    stamp = _stamp(path)
    if stamp is None or stamp == known:
        return stamp, None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return stamp, None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return stamp, None
        return stamp, os.read(fd, logic.MAX_PROGRESS_BYTES + 1)
    except OSError:
        return stamp, None
    finally:
        os.close(fd)


def _open_outputs(
    files: logic.JobFiles | None, account: logic.Account | None = None
) -> tuple[BinaryIO | None, BinaryIO | None]:
    """Open (append) the stdout and stderr files of a process, creating their directory (the account's, 0700)
    and handing the files to ``account`` (mode 0600); ``None`` = inherit."""
    if files is None or files.stdout is None or files.stderr is None:
        return None, None
    own_dir(os.path.dirname(files.stdout), account)
    out = _open_owned(files.stdout, account)  # closed by the caller once the process has its copy
    try:
        return out, _open_owned(files.stderr, account)
    except OSError:
        out.close()
        raise


def _open_owned(path: str, account: logic.Account | None) -> BinaryIO:
    """``path`` opened to append (mode 0600), owned by ``account`` when given.

    The directory is the job's: a link, a FIFO or a device a job planted at the name of a later attempt's
    output is refused (``OSError``, a spawn failure), never followed or waited on (a FIFO without a reader
    would block the agent). So is a hard link (a file with more than one name: the job may have linked
    another file there, a world-writable one of root's, to have it handed over) and a file owned by anyone
    but the agent or ``account``; both are refused before the file is changed or written.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        if st.st_nlink != 1:
            raise OSError(errno.EPERM, f"has {st.st_nlink} links (a hard link)", path)
        owners = {os.geteuid()} | ({account.uid} if account is not None else set())
        if st.st_uid not in owners:
            raise OSError(errno.EPERM, f"belongs to uid {st.st_uid}", path)
        os.set_blocking(fd, True)
        if account is not None:
            os.fchown(fd, account.uid, account.gid)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
