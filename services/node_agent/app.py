"""Node agent wiring: commands in, processes and timers, job and node events out.

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
value (:func:`services.node_agent.logic.observe_progress`).

:class:`NodeAgent` is the runtime (state, journal, workload tasks) behind an
``emit`` coroutine, so service tests drive it with a list sink, a
:class:`~apportion.clock.ManualClock` and a :class:`~apportion.gpu.FakeGpuProbe`;
:func:`run` connects it to Kafka.

Offsets. The commands consumer group is new the first time an agent runs:
it starts at the *end* of the topic (old commands were for earlier agents),
and waits for its partition assignment before registering its nodes, so no
command sent in reply to the registration is missed. Later starts resume
from the committed offsets; the journal (:mod:`services.node_agent.store`)
makes redelivered commands harmless.

Stopping. ``StopWorkload`` sends SIGTERM to the workload's process group,
then SIGKILL after ``grace_s`` event seconds (scaled clock: shorter in wall
time). A simulated workload is cancelled and reports exit code -15.
Shutdown of the agent (SIGTERM) stops its workloads the same way with
``grace_s = 5`` and reports them ``JobFailed(reason="stopped")``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import stat
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

from apportion.clock import Clock
from apportion.events import Event, JobFailed, NodeLost, StartWorkload, StopWorkload, det_id
from apportion.gpu import GpuProbe, SimulatedProbe, open_probe, simulated_inventory
from services.node_agent import logic
from services.node_agent.config import NodeAgentSettings
from services.node_agent.logic import AgentState, NodeSpec, ProgressWatch, RunKey, Workload
from services.node_agent.store import Journal, Orphan

log = logging.getLogger("apportion.node_agent")

Emit = Callable[[Event], Awaitable[None]]

SHUTDOWN_GRACE_S = 5.0


class NodeAgent:
    """The agent runtime for one or many nodes.

    Args:
        nodes: hosted nodes with their GPU probes (``[(spec, probe)]``).
        emit: coroutine publishing one event (in production it queues the event on the idempotent
            producer without waiting for the ack; see :func:`run`).
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
            of running processes (when started with ``poll_progress``).
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
    ) -> None:
        self.journal = journal or Journal(None)
        self.state: AgentState = logic.initial_state([n for n, _ in nodes], claim_prefix, ended=self.journal.known())
        self._probes = {n.node_id: p for n, p in nodes}
        self._emit = emit
        self.clock = clock
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_min_wall_s = heartbeat_min_wall_s
        self._tasks: dict[RunKey, asyncio.Task[None]] = {}
        self._procs: dict[RunKey, asyncio.subprocess.Process] = {}
        self._killers: dict[RunKey, asyncio.Task[None]] = {}
        self._lock = asyncio.Lock()
        self._metrics = metrics or {}
        self._hb_task: asyncio.Task[None] | None = None
        self.checkpoint_root = checkpoint_root
        self.job_log_dir = job_log_dir
        self.progress_poll_wall_s = progress_poll_wall_s
        self._progress: dict[RunKey, ProgressWatch] = {}
        self._poll_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, heartbeats: bool = True, poll_progress: bool = True) -> None:
        """Report orphans from the journal, register the nodes, start heartbeats and progress polling."""
        now = self.clock.now()
        for o in self.journal.orphans():
            if Journal.still_alive(o):
                try:
                    os.killpg(o.pid, signal.SIGKILL)  # type: ignore[arg-type]
                except ProcessLookupError:
                    pass
            node_id, job_id, attempt, replica = o.key
            if o.progress_file is not None:  # its last checkpoint first (an id already published is a duplicate)
                await self._look_at_orphan(o)
            await self._emit(
                JobFailed(
                    event_id=det_id("WorkloadEnded", *o.key),
                    ts=now,
                    producer=logic.PRODUCER,
                    job_id=job_id,
                    attempt=attempt,
                    replica=replica,
                    node_id=node_id,
                    exit_code=None,
                    reason="agent_restarted",
                )
            )
            self.journal.ended(o.key)
            self.state = replace(self.state, ended=self.state.ended | {o.key})
        regs = logic.registered_events(self.state, now)
        for ev in regs:
            await self._emit(ev)
        self.state = logic.with_registered(self.state, regs)
        log.info("registered %d node(s)", len(self.state.nodes), extra={"nodes": sorted(self.state.nodes)[:8]})
        if heartbeats:
            self._hb_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeats")
        if poll_progress and self.checkpoint_root is not None:
            self._poll_task = asyncio.create_task(self._progress_loop(), name="progress")

    async def heartbeat(self) -> None:
        """Publish one heartbeat per hosted node."""
        now = self.clock.now()
        for node_id in sorted(self.state.nodes):
            probe = self._probes[node_id]
            await self._emit(logic.heartbeat_event(self.state, node_id, now, probe.sample()))
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
        once after it exits, so a checkpoint written on SIGTERM is published.
        """
        for t in (self._hb_task, self._poll_task):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        async with self._lock:
            keys = [k for k, w in self.state.running.items() if not w.stopping]
            for k in keys:
                w = replace(self.state.running[k], stopping=True, grace_s=grace_s)
                self.state = replace(self.state, running={**self.state.running, k: w})
                self._signal(w, grace_s)
        await self.idle()

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
            if "checkpoints" in self._metrics:
                self._metrics["checkpoints"].inc()
            await self._emit(seen.event)

    # ------------------------------------------------------------------ commands

    async def on_event(self, event: Event, _delivery: object = None) -> None:
        """Handle one decoded event: a command, or ``NodeLost`` of a hosted node (others are ignored)."""
        if isinstance(event, NodeLost):
            await self.on_lost(event)
            return
        if not isinstance(event, (StartWorkload, StopWorkload)):
            return
        async with self._lock:
            now = self.clock.now()
            if isinstance(event, StartWorkload):
                action = logic.decide_start(self.state, event, now)
            else:
                action = logic.decide_stop(self.state, event, now)
            if not isinstance(action, logic.Ignore) and "commands" in self._metrics:
                self._metrics["commands"].labels(type=event.type).inc()
            if event.node_id in self.state.nodes and not isinstance(action, logic.Refuse):
                self.state = logic.with_token(self.state, event.fencing_token)
            await self._act(action)

    async def _act(self, action: logic.Action) -> None:
        if isinstance(action, logic.Ignore):
            log.debug("ignored command: %s", action.why)
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
                key = (ev.node_id, ev.job_id, ev.attempt, ev.replica)  # type: ignore[attr-defined]
                self.journal.ended(key)
                await self._emit(ev)
            for w in action.workloads:
                self._signal(w, action.grace_s)

    async def on_lost(self, event: NodeLost) -> None:
        """Fence a hosted node declared lost: stop its replicas, register it again once they exited."""
        async with self._lock:
            action = logic.decide_lost(self.state, event, self.clock.now(), SHUTDOWN_GRACE_S)
            if isinstance(action, logic.Ignore):
                log.debug("ignored NodeLost of %s: %s", event.node_id, action.why)
                return
            log.warning(
                "node %s was declared lost (last heartbeat %s): stopping %d replica(s), then rejoining",
                event.node_id,
                event.last_heartbeat.isoformat(),
                len(action.stop.workloads),
            )
            self.state = logic.with_rejoining(self.state, action)
            for ev in action.stop.events:
                self.journal.ended((ev.node_id, ev.job_id, ev.attempt, ev.replica))  # type: ignore[attr-defined]
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
        if not w.simulated:
            if self.checkpoint_root is not None:
                log_dir = str(self.job_log_dir) if self.job_log_dir is not None else None
                w = replace(w, files=logic.job_files(str(self.checkpoint_root), log_dir, w))
            env = dict(os.environ)
            env.update(w.process_env())
            try:
                outputs = _open_outputs(w.files)
                try:
                    if w.files is not None:
                        os.makedirs(w.files.checkpoint_dir, mode=0o700, exist_ok=True)
                        self._progress[w.key] = logic.ProgressWatch(stamp=_stamp(w.files.progress_file))
                    proc = await asyncio.create_subprocess_exec(
                        *w.command,
                        env=env,  # type: ignore[misc]
                        start_new_session=True,
                        cwd=w.files.checkpoint_dir if w.files is not None else None,
                        stdout=outputs[0],
                        stderr=outputs[1],
                    )
                finally:
                    for f in outputs:
                        if f is not None:
                            f.close()
            except OSError as exc:
                self._progress.pop(w.key, None)
                self.journal.ended(w.key)
                self.state = replace(
                    self.state,
                    ended=self.state.ended | {w.key},
                    waiting={k: v for k, v in self.state.waiting.items() if k != w.key},
                )
                await self._emit(logic.exit_event(w, None, now, reason=f"spawn failed: {exc}"))
                return
            pid = proc.pid
            self._procs[w.key] = proc
        watch = self._progress.get(w.key)
        self.journal.started(
            w.key,
            pid,
            w.files.progress_file if w.files is not None and watch is not None else None,
            watch.stamp if watch is not None else None,
        )
        self.state = logic.with_launched(self.state, w)
        self._tasks[w.key] = asyncio.create_task(self._watch(w), name=f"workload {w.key}")
        self._gauge()
        await self._emit(logic.started_event(w, now, pid))

    async def _watch(self, w: Workload) -> None:
        """Wait for ``w`` to end, then report it and launch what waited for its GPUs."""
        code: int | None
        try:
            if w.simulated:
                try:
                    await self.clock.sleep(w.duration_s or 0.0)
                    code = 0
                except asyncio.CancelledError:
                    if self._stopping(w.key):
                        code = -signal.SIGTERM
                    else:
                        raise
            else:
                code = await self._procs[w.key].wait()
        finally:
            self._procs.pop(w.key, None)
            k = self._killers.pop(w.key, None)
            if k is not None:
                k.cancel()
        async with self._lock:
            current = self.state.running.get(w.key, w)
            if w.key in self._progress:  # a last look: the checkpoint written on SIGTERM goes before the exit
                await self._look_at_progress(current)
                del self._progress[w.key]
            self.journal.ended(w.key)
            self.state = logic.with_exited(self.state, w.key)
            await self._emit(logic.exit_event(current, code, self.clock.now()))
            for nxt in logic.ready_to_launch(self.state):
                await self._launch(nxt)
            await self._rejoin_ready()
            self._gauge()
        self._tasks.pop(w.key, None)

    def _stopping(self, key: RunKey) -> bool:
        w = self.state.running.get(key)
        return w is not None and w.stopping

    def _signal(self, w: Workload, grace_s: float) -> None:
        """SIGTERM ``w`` now; SIGKILL after ``grace_s`` event seconds."""
        task = self._tasks.get(w.key)
        if w.simulated:
            if task is not None:
                task.cancel()
            return
        proc = self._procs.get(w.key)
        if proc is None or proc.returncode is not None:
            return
        _killpg(proc.pid, signal.SIGTERM)

        async def kill_later() -> None:
            await self.clock.sleep(grace_s)
            if proc.returncode is None:
                log.warning("workload %s ignored SIGTERM for %.1fs: SIGKILL", w.key, grace_s)
                _killpg(proc.pid, signal.SIGKILL)

        self._killers[w.key] = asyncio.create_task(kill_later())

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
    regular file: it vanished, permissions, or it was swapped for a link or
    FIFO after the stat (opened without following links and non-blocking,
    then checked again).
    """
    stamp = _stamp(path)
    if stamp is None or stamp == known:
        return stamp, None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return stamp, None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return stamp, None
        return stamp, os.read(fd, logic.MAX_PROGRESS_BYTES + 1)
    except OSError:
        return stamp, None
    finally:
        os.close(fd)


def _open_outputs(files: logic.JobFiles | None) -> tuple[BinaryIO | None, BinaryIO | None]:
    """Open (append) the stdout and stderr files of a process, creating their directory; ``None`` = inherit."""
    if files is None or files.stdout is None or files.stderr is None:
        return None, None
    os.makedirs(os.path.dirname(files.stdout), mode=0o700, exist_ok=True)
    out = open(files.stdout, "ab")  # closed by the caller once the process has its copy
    try:
        return out, open(files.stderr, "ab")
    except OSError:
        out.close()
        raise


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------- composition root


def build_nodes(settings: NodeAgentSettings) -> tuple[list[tuple[NodeSpec, GpuProbe]], str]:
    """Hosted nodes with their probes, and the claimed id prefix, from settings."""
    if settings.sim_nodes > 0:
        inv = simulated_inventory(settings.gpus_per_node, settings.gpu_model, reason="simulated nodes")
        probe = SimulatedProbe(inv)
        ids = logic.node_ids(settings.node_prefix, settings.sim_nodes, settings.sim_node_start)
        log.info(
            "hosting %d simulated node(s) %s..%s, %d x %s each",
            len(ids),
            ids[0],
            ids[-1],
            inv.gpu_count,
            settings.gpu_model,
        )
        return [(NodeSpec(i, inv.gpus, inv.model, True), probe) for i in ids], settings.node_prefix
    p = open_probe(settings.gpus_per_node, settings.gpu_model, force_simulated=settings.force_simulated)
    inv = p.inventory
    return [(NodeSpec(settings.real_node_id(), inv.gpus, inv.model, inv.simulated), p)], ""


def _send_failed(exc: BaseException, ev: Event, metrics: dict) -> None:
    """Producer errback: a queued event could not be delivered (after the producer's own retries)."""
    log.error("could not publish %s %s: %s", ev.type, getattr(ev, "job_id", getattr(ev, "node_id", "")), exc)
    metrics["send_errors"].inc()


def _metrics(registry: object) -> dict:
    from prometheus_client import Counter, Gauge

    return {
        "commands": Counter("apportion_node_agent_commands", "Commands for hosted nodes", ["type"], registry=registry),
        "refused": Counter("apportion_node_agent_refused", "Commands refused", ["reason"], registry=registry),
        "running": Gauge("apportion_node_agent_running", "Workload replicas running", registry=registry),
        "heartbeats": Counter("apportion_node_agent_heartbeats", "Heartbeats sent", registry=registry),
        "checkpoints": Counter(
            "apportion_node_agent_checkpoints", "JobCheckpointed events published", registry=registry
        ),
        "checkpoint_problems": Counter(
            "apportion_node_agent_checkpoint_problems", "Progress reports ignored (invalid content)", registry=registry
        ),
        "send_errors": Counter(
            "apportion_node_agent_send_errors", "Events the producer failed to deliver", registry=registry
        ),
    }


async def run(
    settings: NodeAgentSettings, stop: asyncio.Event, *, clock: Clock | None = None, ready: asyncio.Event | None = None
) -> None:
    """Run the node agent until ``stop`` is set.

    Args:
        settings: configuration (see :mod:`services.node_agent.config`).
        stop: set it to shut down (SIGTERM does, from ``__main__``).
        clock: event-time source; default from settings.
        ready: set once the nodes are registered and commands are being consumed.
    """
    from apportion.bus.consumer import EventConsumer
    from apportion.bus.crc import use_compiled_crc32c
    from apportion.bus.producer import EventProducer
    from apportion.topics import COMMANDS, NODES
    from services._common import consume, start_metrics

    clock = clock or settings.make_clock()
    conn = settings.connection()
    log.info("record-batch CRC-32C: %s", use_compiled_crc32c())
    registry, stop_metrics = start_metrics(settings.metrics_port, settings.metrics_host)
    nodes, prefix = build_nodes(settings)
    journal = Journal(settings.state_dir / f"{settings.agent_name()}.journal" if settings.state_dir else None)
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
    producer = await asyncio.to_thread(EventProducer, conn.bootstrap, client_id=f"node-agent-{settings.agent_name()}")

    metrics = _metrics(registry)

    async def emit(ev: Event) -> None:
        # Queued, not awaited: the idempotent acks=all producer keeps per-key order and retries for
        # delivery_timeout_ms; waiting for each ack here serialised the agent (one broker round trip per
        # JobStarted and per heartbeat of each hosted node), which at 1440x delayed starts by ~2,000 event
        # seconds in the main job. A send that still fails is logged and counted; the journal reports the
        # run on the next start (agent_restarted), so a lost JobStarted cannot hide a run for ever.
        fut = producer.send(ev)
        fut.add_errback(_send_failed, ev, metrics)

    agent = NodeAgent(
        nodes,
        emit,
        clock,
        journal=journal,
        claim_prefix=prefix,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        heartbeat_min_wall_s=settings.heartbeat_min_wall_s,
        metrics=metrics,
        checkpoint_root=checkpoint_root,
        job_log_dir=job_log_dir,
        progress_poll_wall_s=settings.progress_poll_wall_s,
    )
    assigned = asyncio.Event()

    wanted = (StartWorkload, StopWorkload, NodeLost)

    def make_consumer(handler):  # runs in a worker thread
        def relevant(event: Event, delivery: object) -> None:  # heartbeats etc. never reach the loop
            if isinstance(event, wanted):
                handler(event, delivery)

        c = EventConsumer(
            conn.bootstrap,
            [COMMANDS.name, NODES.name],
            settings.consumer_group(),
            relevant,
            dead_letters=producer,
            name=settings.producer_name,
            clock=clock.now,
            auto_offset_reset="latest",
        )
        _wait_assigned(c, deadline_s=60.0)
        return c

    async def started_after_assignment() -> None:
        await assigned.wait()
        await agent.start()
        if ready is not None:
            ready.set()

    async def on_idle() -> None:
        if not assigned.is_set():
            assigned.set()
            await started_after_assignment()

    try:
        await consume(make_consumer, agent.on_event, stop, on_idle=on_idle)
    finally:
        await agent.shutdown()
        await asyncio.to_thread(producer.close)
        stop_metrics()
        for _, p in nodes[:1]:
            p.close()


def _wait_assigned(consumer: object, deadline_s: float) -> None:
    """Poll until the group assigned partitions and their positions are resolved.

    Adapter: :class:`apportion.bus.consumer.EventConsumer` has no public
    "wait for assignment"; this uses its underlying kafka-python consumer.
    Records fetched while waiting are not lost: each partition is sought
    back to the first record returned, so the wrapper's loop gets them.
    """
    import time

    kc = consumer._consumer  # type: ignore[attr-defined]
    end = time.monotonic() + deadline_s
    while not kc.assignment():
        if time.monotonic() > end:
            raise TimeoutError("no partition assignment for the commands consumer")
        for tp, recs in kc.poll(timeout_ms=100).items():
            if recs:
                kc.seek(tp, recs[0].offset)
    for tp in kc.assignment():
        kc.position(tp)
