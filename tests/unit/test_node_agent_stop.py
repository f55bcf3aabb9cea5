"""FAULT (the broker is gone as the node agent stops): the producer's close raises (it cannot flush or reach the
broker), and the agent stops all the same: the close gives up quietly (:func:`apportion.bus.service.close_quietly`,
logged at DEBUG), the metrics endpoint is stopped and the GPU probe closed, and ``run`` returns instead of raising
the close's error.

Both ways the agent stops: after its consumer loop ends (``stop`` set while it ran), and while it still waited for
Kafka (the producer made, the report signer not yet). The Kafka clients are replaced by stand-ins that record what
was done to them (the faults are the point: a real broker cannot be made to fail a close on demand)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError

from services.node_agent import app
from services.node_agent.config import NodeAgentSettings


class GoneBroker:
    """A producer whose broker is gone: ``close`` raises (kafka-python's error when it cannot flush in time)."""

    def __init__(self) -> None:
        self.closes = 0

    def close(self) -> None:
        self.closes += 1
        raise KafkaTimeoutError("Failed to flush buffered records within 30 seconds")


class Agent:
    """The node agent's runtime, reduced to what the app's stop calls on it."""

    shutdowns = 0

    @classmethod
    def from_settings(cls, *args: Any, **kwargs: Any) -> Agent:
        return cls()

    async def on_event(self, ev: Any, delivery: Any) -> None:  # pragma: no cover - no record is consumed
        raise AssertionError("no record is consumed")

    async def shutdown(self) -> None:
        type(self).shutdowns += 1


class Probe:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("when", ["after its consumer loop", "while the signer waited for Kafka"])
async def test_a_stop_with_the_broker_gone_still_stops_the_metrics_and_the_probe(
    when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apportion.bus import resilience, service

    producer, probe, stopped_metrics = GoneBroker(), Probe(), []
    real_wire = service.wire

    def wire(*args: Any, **kwargs: Any) -> Any:
        w = real_wire(*args, **kwargs)
        stop_metrics = w.stop_metrics

        def recorded() -> None:
            stopped_metrics.append(True)
            stop_metrics()

        w.stop_metrics = recorded
        return w

    async def connect(make: Any, what: str, readiness: Any, stop: asyncio.Event) -> Any:
        if what == "the producer":
            return producer
        return None if when.startswith("while") else object()  # the signer: None when stopped while waiting

    consumed = []

    async def consume(*args: Any, **kwargs: Any) -> None:  # the loop, until ``stop``
        consumed.append(True)

    monkeypatch.setattr(service, "wire", wire)
    monkeypatch.setattr(service, "consume", consume)
    monkeypatch.setattr(resilience, "connect", connect)
    monkeypatch.setattr(app, "NodeAgent", Agent)
    monkeypatch.setattr(Agent, "shutdowns", 0)
    monkeypatch.setattr(app, "hosted_nodes", lambda settings: ([(SimpleNamespace(node_id="sim-0"), probe)], "sim-"))
    settings = NodeAgentSettings(
        kafka_bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0", sim_nodes=1, metrics_port=0
    )
    stop = asyncio.Event()
    stop.set()

    await app.run(settings, stop)

    assert producer.closes == 1
    assert stopped_metrics == [True]
    assert probe.closed == 1
    ran = when.startswith("after")  # stopped while waiting: no agent ran, nothing to shut down
    assert (consumed, Agent.shutdowns) == (([True], 1) if ran else ([], 0))
