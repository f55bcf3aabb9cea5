"""Staying up without Kafka or Redis (apportion.bus.resilience and the shared consumer loop), no broker needed.

Faults are injected as callables that raise: a probe of a dependency that is down, a session that fails, a
publish that times out, a poll that raises. Waits are tiny backoffs; nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from apportion.bus.resilience import (
    Backoff,
    Readiness,
    connect,
    describe,
    kafka_probe,
    publish_until_acked,
    supervise,
    wait_reachable,
)
from apportion.bus.service import consume, start_metrics


def fast() -> Backoff:
    return Backoff(first_s=0.001, max_s=0.004)


def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    b = Backoff(first_s=0.5, max_s=3.0)
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.next() == 0.5


def test_describe_is_one_line_without_the_class_name_twice() -> None:
    class KafkaTimeoutError(Exception):
        pass

    assert describe(KafkaTimeoutError("KafkaTimeoutError: Failed to update metadata\nmore")) == (
        "KafkaTimeoutError: Failed to update metadata"
    )
    assert describe(ConnectionError()) == "ConnectionError"


class Flaky:
    """A probe (or factory) failing its first ``n`` calls."""

    def __init__(self, n: int, result: Any = None) -> None:
        self.n, self.calls, self.result = n, 0, result

    def __call__(self) -> Any:
        self.calls += 1
        if self.calls <= self.n:
            raise ConnectionError("refused")
        return self.result


def test_wait_reachable_logs_each_failed_try_and_returns_once_the_dependency_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = Flaky(3)
    r = Readiness({"Kafka": ("127.0.0.1:1", probe)})
    caplog.set_level("INFO", "apportion.bus.resilience")
    assert asyncio.run(wait_reachable(r, asyncio.Event(), fast())) is True
    assert probe.calls == 4
    lines = [rec.getMessage() for rec in caplog.records]
    assert sum("waiting for Kafka at 127.0.0.1:1 (ConnectionError: refused)" in m for m in lines) == 3
    assert lines[-1] == "Kafka at 127.0.0.1:1 reachable"


def test_wait_reachable_returns_false_when_stopped() -> None:
    async def go() -> bool:
        stop = asyncio.Event()
        stop.set()
        return await wait_reachable(Readiness({"Redis": ("x", Flaky(10**6))}), stop, fast())

    assert asyncio.run(go()) is False


def test_readiness_is_503_material_until_the_session_is_ready_and_while_a_probe_fails() -> None:
    down = Flaky(10**6)
    r = Readiness({"Kafka": ("k:1", lambda: None), "Redis": ("r:2", down)})
    ok, details = r.check()
    assert (ok, details["service"], details["Kafka"]) == (False, "starting", "reachable at k:1")
    r.set(True)
    ok, details = r.check()
    assert (ok, details["service"], details["Redis"]) == (
        False,
        "ready",
        "unreachable at r:2 (ConnectionError: refused)",
    )
    r.probes["Redis"] = ("r:2", lambda: None)
    assert r.check() == (True, {"service": "ready", "Kafka": "reachable at k:1", "Redis": "reachable at r:2"})


def test_a_kafka_probe_of_a_closed_port_fails() -> None:
    from apportion.bus.stack import free_ports

    [port] = free_ports(1)
    with pytest.raises(ConnectionError, match="no broker answers"):
        kafka_probe(f"127.0.0.1:{port}")()


def test_supervise_starts_a_failed_session_again_and_ends_when_stopped(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[int] = []
    r = Readiness()

    async def go() -> None:
        stop = asyncio.Event()

        async def session() -> None:
            runs.append(len(runs))
            if len(runs) < 3:
                raise ConnectionError("broker gone")
            r.set(True)
            stop.set()

        await supervise("svc", session, stop, r, fast())

    caplog.set_level("WARNING", "apportion.bus.resilience")
    asyncio.run(go())
    assert runs == [0, 1, 2]
    assert r.ready is True
    assert (
        sum("svc stopped (ConnectionError: broker gone): starting again in" in m.getMessage() for m in caplog.records)
        == 2
    )


def test_supervise_marks_not_ready_after_a_failure_of_a_ready_session() -> None:
    r = Readiness()
    seen: list[tuple[bool, str]] = []

    async def go() -> None:
        stop = asyncio.Event()

        async def session() -> None:
            seen.append((r.ready, r.reason))
            if len(seen) == 1:
                r.set(True)
                raise TimeoutError("publish timed out")
            stop.set()

        await supervise("svc", session, stop, r, fast())

    asyncio.run(go())
    assert seen == [(False, "starting"), (False, "TimeoutError: publish timed out")]


def test_connect_builds_the_client_again_after_failures() -> None:
    factory = Flaky(2, result="client")
    assert asyncio.run(connect(factory, "the producer", Readiness(), asyncio.Event(), fast())) == "client"
    assert factory.calls == 3


def test_a_publish_that_times_out_is_retried_until_acked() -> None:
    sent: list[Any] = []

    class Letter:
        type = "DeadLetter"

    def publish(ev: Any) -> str:
        sent.append(ev)
        if len(sent) < 3:
            raise TimeoutError("Timeout after waiting for 30.0 secs.")
        return "acked"

    letter = Letter()
    assert publish_until_acked(publish, letter, lambda: False, fast()) == "acked"
    assert sent == [letter, letter, letter]


def test_a_publish_that_fails_once_stopping_raises_so_nothing_after_it_is_stored() -> None:
    class Letter:
        type = "DeadLetter"

    def publish(ev: Any) -> None:
        raise TimeoutError("down")

    with pytest.raises(TimeoutError):
        publish_until_acked(publish, Letter(), lambda: True, fast())


class FakeConsumer:
    """An EventConsumer stand-in whose polls raise ``fail`` times, then hand one event to the handler."""

    def __init__(self, handler: Any, fail: int) -> None:
        self.handler, self.fail, self.polls, self.closed = handler, fail, 0, False

    def poll_once(self, timeout_ms: int) -> int:
        self.polls += 1
        if self.polls <= self.fail:
            raise ConnectionError("KafkaConnectionError: 111 ECONNREFUSED")
        self.handler("event", "delivery")
        return 1

    def close(self) -> None:
        self.closed = True


def test_the_consumer_loop_is_built_again_and_polls_again_after_failures_until_stopped() -> None:
    builds = Flaky(2)
    made: list[FakeConsumer] = []
    handled: list[Any] = []

    async def go() -> None:
        stop = asyncio.Event()

        def make(handler: Any) -> FakeConsumer:
            builds()
            made.append(FakeConsumer(handler, fail=3))
            return made[-1]

        async def handler(event: Any, delivery: Any) -> None:
            handled.append(event)
            stop.set()

        await consume(make, handler, stop, poll_ms=1, backoff=fast())

    asyncio.run(go())
    assert builds.calls == 3 and len(made) == 1
    assert (made[0].polls, handled, made[0].closed) == (4, ["event"], True)


class ScriptedConsumer:
    """A consumer stand-in whose one poll hands ``events`` to the handler in order; it records each step."""

    def __init__(self, handler: Any, events: list[Any], steps: list[str], assign_fails: bool = False) -> None:
        self.handler, self.events, self.steps, self.assign_fails = handler, events, steps, assign_fails

    def wait_assigned(self, deadline_s: float) -> None:
        self.steps.append(f"assigned within {deadline_s:g} s")
        if self.assign_fails:
            raise TimeoutError(f"no partition assignment within {deadline_s:g} s")

    def poll_once(self, timeout_ms: int) -> int:
        for e in self.events:
            self.handler(e, "delivery")
        return len(self.events)

    def close(self) -> None:
        self.steps.append("closed")


def test_consume_hands_the_handler_only_the_types_asked_for_and_runs_on_assigned_before_the_first_record() -> None:
    # the node agent's wiring: register (on_assigned) after the assignment and before any command is judged;
    # heartbeats (here ints and a str) are consumed without reaching the handler; a consumer whose assignment
    # times out is closed and built again
    steps: list[str] = []
    builds: list[ScriptedConsumer] = []

    async def go() -> None:
        stop = asyncio.Event()

        def make(handler: Any) -> ScriptedConsumer:
            builds.append(ScriptedConsumer(handler, [1, "start", 2.5, "stop"], steps, assign_fails=not builds))
            return builds[-1]

        async def registered() -> None:
            steps.append("registered")

        async def handler(event: Any, delivery: Any) -> None:
            steps.append(f"handled {event}")
            if event == "stop":
                stop.set()

        await consume(make, handler, stop, poll_ms=1, backoff=fast(), only=(str, float), on_assigned=registered)

    asyncio.run(go())
    assert len(builds) == 2
    assert steps == [
        "assigned within 60 s",
        "closed",
        "assigned within 60 s",
        "registered",
        "handled start",
        "handled 2.5",
        "handled stop",
        "closed",
    ]


def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_metrics_port_answers_ready_503_then_200_and_still_serves_metrics() -> None:
    from apportion.bus.stack import free_ports

    [port] = free_ports(1)
    r = Readiness({"Kafka": ("k:1", lambda: None)})
    _, stop = start_metrics(port, readiness=r)
    try:
        assert _get(port, "/ready") == (503, {"ready": False, "service": "starting", "Kafka": "reachable at k:1"})
        r.set(True)
        assert _get(port, "/ready") == (200, {"ready": True, "service": "ready", "Kafka": "reachable at k:1"})
        assert _get(port, "/healthz") == (200, {"ready": True, "service": "serving"})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert b"process_resident_memory_bytes" in resp.read()
    finally:
        stop()


def test_the_metrics_port_answers_404_on_any_other_path() -> None:
    from apportion.bus.stack import free_ports

    [port] = free_ports(1)
    _, stop = start_metrics(port)
    try:
        for path in ("/", "/admin", "/metricsx", "/metrics/", "/../etc/passwd", "/ready/x"):
            with pytest.raises(urllib.error.HTTPError) as exc:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
            assert exc.value.code == 404, path
            assert b"process_resident_memory_bytes" not in exc.value.read(), path
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?x=1", timeout=5) as resp:  # a query is fine
            assert (resp.status, b"process_resident_memory_bytes" in resp.read()) == (200, True)
    finally:
        stop()


def test_wire_probes_kafka_and_redis_only_when_asked_and_says_ready_once_told() -> None:
    from apportion.bus.service import ServiceSettings, wire

    settings = ServiceSettings(kafka_bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:2/0")
    assert list(wire(settings, redis=False).readiness.probes) == ["Kafka"]
    w = wire(settings)
    assert {k: addr for k, (addr, _) in w.readiness.probes.items()} == {
        "Kafka": "127.0.0.1:1",
        "Redis": "redis://127.0.0.1:2/0",
    }
    ready = asyncio.Event()
    assert (w.readiness.ready, ready.is_set()) == (False, False)
    w.became_ready(ready)
    assert (w.readiness.ready, ready.is_set()) == (True, True)


def test_wire_gives_every_service_the_compiled_crc32c(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accounting and the policy read record batches too: ``wire`` (every service's start) swaps the CRC in."""
    import kafka.record.default_records as records
    import kafka.record.util as util
    from aiokafka.record._crecords import crc32c_cython

    from apportion.bus.service import ServiceSettings, wire

    monkeypatch.setattr(util, "crc32c_c", None)  # as without the crc32c package
    monkeypatch.setattr(records, "calc_crc32c", util.calc_crc32c)  # kafka-python as shipped
    wire(ServiceSettings(kafka_bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:2/0"), redis=False)
    assert records.calc_crc32c is crc32c_cython


def test_idle_connections_to_the_metrics_port_are_bounded_in_number_and_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A local process that opens connections and sends nothing (a job flooding loopback) holds at most
    ``METRICS_MAX_CONNECTIONS`` of the endpoint's threads, each for at most ``METRICS_IO_TIMEOUT_S``: one
    more connection is closed unanswered, and the endpoint answers again once the idle ones time out."""
    import socket

    from apportion.bus import service
    from apportion.bus.stack import free_ports

    monkeypatch.setattr(service, "METRICS_MAX_CONNECTIONS", 3)
    monkeypatch.setattr(service, "METRICS_IO_TIMEOUT_S", 2.0)
    [port] = free_ports(1)
    _, stop = start_metrics(port)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    try:
        # the server accepts in order: once the third idle one holds its slot, a fourth finds none
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        extra.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        try:
            answer = extra.recv(1024)
        except ConnectionResetError:  # closed with the request unread
            answer = b""
        assert answer == b""  # closed unanswered (with a slot it would get "HTTP/1.0 200 OK")
        extra.close()
        for s in idle:  # each idle connection is closed by the server at its timeout, unanswered
            assert s.recv(1024) == b""
        assert _get(port, "/healthz") == (200, {"ready": True, "service": "serving"})
    finally:
        for s in idle:
            s.close()
        stop()
