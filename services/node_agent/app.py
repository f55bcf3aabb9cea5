"""Node agent wiring: the :class:`~services.node_agent.service.NodeAgent` runtime on Kafka.

Consumes ``apportion.commands`` and ``NodeLost`` of ``apportion.nodes``; produces node and job events (what
each means, checkpoints, restarts, stopping: :mod:`services.node_agent.service`). The commands consumer is a
static group member that starts at the end of the topic the first time; the nodes are registered once its
partitions are assigned and before its first record is handled (:func:`apportion.bus.service.consume`'s
``on_assigned``). Outages: the producer and the signer are built again until the broker answers, the
consumer loop never exits, undelivered reports wait in the producer for
:data:`~services.node_agent.service.PRODUCER_PATIENCE_MS` (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging

from apportion.clock import Clock
from apportion.settings import topic_name
from services.node_agent.config import NodeAgentSettings
from services.node_agent.service import HANDLED, PRODUCER_PATIENCE_MS, NodeAgent, SignedSender, hosted_nodes

log = logging.getLogger("apportion.node_agent")


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
    from apportion.bus.intake import IdLedger
    from apportion.bus.producer import EventProducer
    from apportion.bus.resilience import connect
    from apportion.bus.service import close_quietly, consume, wire
    from apportion.metrics import node_agent_metrics
    from apportion.signers import report_signer
    from apportion.topics import COMMANDS, NODES

    w = wire(settings, clock, redis=False)
    clock, conn = w.clock, w.conn
    nodes, prefix = hosted_nodes(settings)
    metrics = node_agent_metrics(w.registry)
    name = f"node-agent-{settings.agent_name()}"
    producer = await connect(
        lambda: EventProducer(conn.bootstrap, client_id=name, delivery_timeout_ms=PRODUCER_PATIENCE_MS),
        "the producer",
        w.readiness,
        stop,
    )
    # every report is signed with its node's key (rule D10.authentication; readers ignore what is not)
    node_ids = [n.node_id for n, _ in nodes]
    signer = await connect(
        lambda: report_signer(node_ids, key_dir=settings.node_key_dir, bootstrap=conn.bootstrap, now=clock.now()),
        "the report signer",
        w.readiness,
        stop,
    )

    def stop_the_rest() -> None:  # the metrics endpoint and the GPU probe (the hosted nodes share one)
        w.stop_metrics()
        for _, p in nodes[:1]:
            p.close()

    if producer is None or signer is None:  # stopped while waiting for Kafka
        await close_quietly(producer)
        stop_the_rest()
        return
    sender = SignedSender(producer, signer, metrics)
    agent = NodeAgent.from_settings(settings, nodes, prefix, sender, clock, metrics, group_commit=True)

    loop = asyncio.get_running_loop()

    def journaled() -> None:  # before the commands' offsets are committed: their group on disk, then reported
        asyncio.run_coroutine_threadsafe(agent.end_group(), loop).result()

    def make_consumer(handler):  # runs in a worker thread
        c = EventConsumer(
            conn.bootstrap,
            [topic_name(COMMANDS), topic_name(NODES)],
            settings.consumer_group(),
            handler,
            dedup=IdLedger(window_s=settings.retention_s),  # a command older than that is refused anyway
            dead_letters=producer,
            name=settings.producer_name,
            clock=clock.now,
            auto_offset_reset="latest",
            group_instance_id=settings.instance_id(),
            before_commit=journaled,
        )
        w.watch_consumer(metrics["reader"], c)
        return c

    async def started() -> None:  # after the assignment (no reply missed), before the first command is judged
        await agent.start()
        w.became_ready(ready)

    try:
        await consume(make_consumer, agent.on_event, stop, only=HANDLED, on_assigned=started)
    finally:  # the broker may be gone: the producer's close gives up quietly, the rest stops all the same
        await agent.shutdown()
        await close_quietly(producer)
        stop_the_rest()
