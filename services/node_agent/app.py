"""Node agent wiring: the :class:`~services.node_agent.service.NodeAgent` runtime on Kafka.

Consumes ``apportion.commands`` and ``NodeLost`` of ``apportion.nodes``; produces node and job events (what
each means, checkpoints, restarts, stopping: :mod:`services.node_agent.service`). The commands consumer is a
static group member that starts at the end of the topic the first time; the nodes are registered once its
partitions are assigned and before its first record is handled. Outages: the producer and the consumer are
built again until the broker answers, the consumer loop never exits, undelivered reports wait in the
producer for ``PRODUCER_PATIENCE_MS`` (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from apportion.clock import Clock
from apportion.events import Event, NodeLost, StartWorkload, StopWorkload
from apportion.gpu import GpuProbe, SimulatedProbe, open_probe, simulated_inventory
from services.node_agent import logic
from services.node_agent.config import NodeAgentSettings
from services.node_agent.logic import NodeSpec
from services.node_agent.service import NodeAgent
from services.node_agent.store import Journal

log = logging.getLogger("apportion.node_agent")

#: How long, ms, the agent's producer keeps an event it could not deliver yet (a broker outage) before it
#: gives up on it (``delivery_timeout_ms``; kafka-python's default is 2 minutes).
PRODUCER_PATIENCE_MS = 6 * 3600 * 1000


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
    from apportion.bus.resilience import connect
    from apportion.bus.service import consume, wire
    from apportion.identity import report_signer
    from apportion.metrics import node_agent_metrics
    from apportion.topics import COMMANDS, NODES

    w = wire(settings, clock, redis=False)
    clock, conn = w.clock, w.conn
    log.info("record-batch CRC-32C: %s", use_compiled_crc32c())
    nodes, prefix = build_nodes(settings)
    journal = Journal(settings.journal_path())
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
    metrics = node_agent_metrics(w.registry)
    # the agent's reports wait out a broker outage of up to PRODUCER_PATIENCE_MS in the producer's buffer
    producer = await connect(
        lambda: EventProducer(
            conn.bootstrap,
            client_id=f"node-agent-{settings.agent_name()}",
            delivery_timeout_ms=PRODUCER_PATIENCE_MS,
        ),
        "the producer",
        w.readiness,
        stop,
    )
    # every report is signed with its node's key (DESIGN section 10; readers ignore what is not)
    signer = await connect(
        lambda: report_signer(
            [n.node_id for n, _ in nodes], key_dir=settings.node_key_dir, bootstrap=conn.bootstrap, now=clock.now()
        ),
        "the report signer",
        w.readiness,
        stop,
    )
    if producer is None or signer is None:  # stopped while waiting for Kafka
        if producer is not None:
            producer.close()
        w.stop_metrics()
        return

    async def flush() -> None:
        await asyncio.to_thread(producer.flush, 30.0)

    async def emit(ev: Event) -> None:
        # Queued, not awaited: the idempotent acks=all producer keeps per-key order and retries for
        # delivery_timeout_ms; waiting for each ack here serialised the agent (one broker round trip per
        # JobStarted and per heartbeat of each hosted node), which at 1440x delayed starts by ~2,000 event
        # seconds in the main job. A send that still fails is logged and counted; after a restart the journal
        # re-publishes an adopted replica's JobStarted (or reports it JobLost), so a lost JobStarted cannot
        # hide a run for ever. The restart reports themselves are flushed before the journal marks them done.
        try:
            fut = producer.send(ev, signer.value(ev))
        except Exception as exc:  # noqa: BLE001 - the buffer stayed full through an outage: never stop the agent
            _send_failed(exc, ev, metrics)
            return
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
        flush=flush,
        retention_s=settings.retention_s,
        ended_cap=settings.ended_cap,
        require_fenced_lost=settings.require_fenced_lost,
        sim_util_seed=settings.sim_util_seed,
    )
    loop = asyncio.get_running_loop()

    wanted = (StartWorkload, StopWorkload, NodeLost)

    def make_consumer(handler):  # runs in a worker thread
        def relevant(event: Event, delivery: object) -> None:  # heartbeats etc. never reach the loop
            if isinstance(event, wanted):
                handler(event, delivery)

        static = settings.instance_id()
        static_member: dict[str, Any] = {"group_instance_id": static} if static else {}
        c = EventConsumer(
            conn.bootstrap,
            [COMMANDS.name, NODES.name],
            settings.consumer_group(),
            relevant,
            dead_letters=producer,
            name=settings.producer_name,
            clock=clock.now,
            auto_offset_reset="latest",
            **static_member,
        )
        metrics["reader"].watch(lambda: c.stats)
        c.lag.sink = metrics["reader"].set_lag
        try:
            c.wait_assigned(deadline_s=60.0)
        except BaseException:
            c.close()
            raise
        # Register (and settle the journal's orphans) now: after the assignment, so no command sent in reply
        # is missed, and before the first record is handled, so every command is judged against this
        # registration (a command queued before it is never executed late).
        asyncio.run_coroutine_threadsafe(started(), loop).result()
        return c

    async def started() -> None:
        await agent.start()
        w.became_ready(ready)

    try:
        await consume(make_consumer, agent.on_event, stop)
    finally:
        await agent.shutdown()
        await asyncio.to_thread(producer.close)
        w.stop_metrics()
        for _, p in nodes[:1]:
            p.close()
