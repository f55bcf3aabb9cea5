"""Plumbing every service shares: settings base, JSON logs, metrics and readiness, signals, the consumer loop.

Nothing here connects or starts anything at import time; ``app.py`` of each
service calls these from its ``run(settings, stop_event)``.

* :class:`ServiceSettings` - pydantic-settings base, env prefix ``APPORTION_``:
  ``APPORTION_KAFKA_BOOTSTRAP``, ``APPORTION_REDIS_URL`` (falling back to
  ``KAFKA_BOOTSTRAP``/``REDIS_URL`` and the local stack's ``stack.env``, see
  :mod:`apportion.settings`), ``APPORTION_METRICS_PORT`` (0 = off),
  ``APPORTION_LOG_LEVEL``, ``APPORTION_LOG_JSON``, and the clock:
  ``APPORTION_TIME_SCALE``, ``APPORTION_CLOCK_EPOCH_WALL``,
  ``APPORTION_CLOCK_EPOCH_EVENT`` (ISO-8601 with offset).
* :func:`setup_logging` - one JSON object per line on stderr.
* :func:`start_metrics` - a Prometheus endpoint on its own registry (so
  several services can run in one test process).
* :func:`install_signal_handlers` - SIGTERM/SIGINT set the stop event.
* :func:`follow` - the one consumer loop (poll in a worker thread, handle on
  the event loop, a failed poll retried with backoff), and :func:`consume`,
  which drives an :class:`apportion.bus.consumer.EventConsumer` through it:
  each event is handled *on the event loop* and the poll thread waits for
  the handler to finish, so the wrapper commits an offset only after its
  effect is done (STYLE rule 8).
* :func:`close_quietly` - close clients whose broker may be gone.
* :func:`serve` - the body of every ``__main__``.

Staying up (wait for Kafka and Redis, supervised sessions, ``/ready``) is
:mod:`apportion.bus.resilience`; the consumers and the records' merge order
are :mod:`apportion.bus.consumer`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from pydantic_settings import BaseSettings, SettingsConfigDict

from apportion.bus.resilience import Backoff, Readiness
from apportion.clock import Clock, make_clock
from apportion.settings import Connection

log = logging.getLogger("apportion.service")

T = TypeVar("T")


class ServiceSettings(BaseSettings):
    """Settings common to every service (env prefix ``APPORTION_``).

    Attributes:
        kafka_bootstrap: Kafka ``host:port``; ``None`` resolves as :mod:`apportion.settings`.
        redis_url: Redis URL; ``None`` resolves likewise.
        metrics_port: Prometheus endpoint port; 0 disables it.
        metrics_host: interface the endpoint binds to.
        log_level: ``DEBUG``, ``INFO``, ...
        log_json: JSON lines (True) or plain text (False).
        time_scale: event seconds per wall second (1 = real time).
        clock_epoch_wall, clock_epoch_event: pin of the scaled clock; give
            every service the same values so they agree on event time.
    """

    model_config = SettingsConfigDict(env_prefix="APPORTION_", extra="ignore")

    kafka_bootstrap: str | None = None
    redis_url: str | None = None
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"
    log_json: bool = True
    time_scale: float = 1.0
    clock_epoch_wall: datetime | None = None
    clock_epoch_event: datetime | None = None

    def connection(self) -> Connection:
        """Resolved Kafka and Redis addresses."""
        return Connection.resolve(self.kafka_bootstrap, self.redis_url)

    def make_clock(self) -> Clock:
        """The clock these settings describe (wall, or scaled with the epochs)."""
        return make_clock(self.time_scale, self.clock_epoch_wall, self.clock_epoch_event)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, service, and any ``extra``."""

    _SKIP = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "service": self.service,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in self._SKIP:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(service: str, level: str = "INFO", json_lines: bool = True) -> None:
    """Configure the root logger for a service process (call once, from ``main``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter(service) if json_lines else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("kafka").setLevel(max(logging.WARNING, root.level))


#: Seconds a metrics client may take to send its request or read the answer before its connection is closed.
METRICS_IO_TIMEOUT_S = 5.0

#: Most connections the metrics endpoint serves at once; one more is closed at once, unanswered.
METRICS_MAX_CONNECTIONS = 32


def _bounded_http_server() -> type:
    from http.server import ThreadingHTTPServer

    class _Bounded(ThreadingHTTPServer):
        """A threading HTTP server with a bound on its threads and on each connection's idle time: a local
        process (a job on the node, anyone on loopback) that opens connections and sends nothing holds at most
        :data:`METRICS_MAX_CONNECTIONS` threads, each for at most :data:`METRICS_IO_TIMEOUT_S`."""

        daemon_threads = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.slots = threading.BoundedSemaphore(METRICS_MAX_CONNECTIONS)
            self.refused = 0
            super().__init__(*args, **kwargs)

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self.slots.acquire(blocking=False):
                self.refused += 1
                self.shutdown_request(request)
                return
            request.settimeout(METRICS_IO_TIMEOUT_S)
            try:
                super().process_request(request, client_address)
            except BaseException:
                self.slots.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

    return _Bounded


def start_metrics(
    port: int, host: str = "127.0.0.1", readiness: Readiness | None = None
) -> tuple[Any, Callable[[], None]]:
    """A fresh Prometheus registry (with the process collectors) and, when ``port`` > 0, an HTTP endpoint
    serving it. The families every service registers are defined in :mod:`apportion.metrics`.

    The endpoint also answers ``/ready`` (200 when ``readiness`` says ready, else 503; a JSON object naming
    each dependency's state, :class:`apportion.bus.resilience.Readiness`) and ``/healthz`` (200 while the
    process serves); the metrics are at ``/metrics``, and every other path is 404.

    Returns:
        ``(registry, stop)``: register metrics on ``registry``; call ``stop()``
        on shutdown (a no-op when the endpoint is off).
    """
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import MetricsHandler

    from apportion.metrics import add_process_collectors

    registry = CollectorRegistry()
    add_process_collectors(registry)
    if port <= 0:
        return registry, lambda: None
    ready = readiness or Readiness()

    class Handler(MetricsHandler.factory(registry)):  # type: ignore[misc] # prometheus_client's factory is untyped
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                return super().do_GET()
            if path not in ("/ready", "/healthz"):
                self.send_error(404, "not found: the paths are /metrics, /ready and /healthz")
                return None
            ok, details = ready.check() if path == "/ready" else (True, {"service": "serving"})
            body = (json.dumps({"ready": ok, **details}) + "\n").encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return None

        def log_message(self, format: str, *args: Any) -> None:  # the base class's name
            pass  # no access log on stderr (the service's log is JSON lines)

    server = _bounded_http_server()((host, port), Handler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return registry, stop


@dataclass
class Wiring:
    """What every service's ``run`` begins with (:func:`wire`).

    Attributes:
        clock: the event-time source.
        conn: resolved Kafka and Redis addresses.
        readiness: what ``/ready`` answers (:class:`apportion.bus.resilience.Readiness`).
        registry: the Prometheus registry served on the metrics port.
        stop_metrics: stops the endpoint.
        current: ``{"svc": ...}``, the service object of the session running now (its reader stats are
            what the metrics count; a session started again replaces it).
    """

    clock: Clock
    conn: Connection
    readiness: Readiness
    registry: Any
    stop_metrics: Callable[[], None]
    current: dict[str, Any]

    def watch_reader(self, collector: Any) -> None:
        """Count the current session's reader edge (``svc.intake.stats``) on ``collector``."""
        collector.watch(lambda: self.current["svc"].intake.stats if self.current else None)

    def watch_consumer(self, collector: Any, consumer: Any) -> None:
        """Count ``consumer``'s own reader stats and lag on ``collector`` (a service whose consumer handles
        records itself, :class:`apportion.bus.consumer.EventConsumer`)."""
        collector.watch(lambda: consumer.stats)
        consumer.lag.sink = collector.set_lag

    def became_ready(self, ready: asyncio.Event | None = None) -> None:
        """The session is ready: ``/ready`` says so (while the dependencies answer), ``ready`` is set."""
        self.readiness.set(True)
        if ready is not None:
            ready.set()

    async def supervise(self, name: str, session: Callable[[], Awaitable[None]], stop: asyncio.Event) -> None:
        """:func:`apportion.bus.resilience.supervise` the sessions until ``stop``; then stop the endpoint."""
        from apportion.bus.resilience import supervise

        try:
            await supervise(name, session, stop, self.readiness)
        finally:
            self.stop_metrics()


def wire(settings: ServiceSettings, clock: Clock | None = None, *, redis: bool = True) -> Wiring:
    """Clock, addresses, readiness probing Kafka (and Redis when ``redis``), the metrics and ``/ready`` endpoint.

    Also, for the whole process: kafka-python's record-batch CRC-32C in compiled code
    (:func:`apportion.bus.crc.use_compiled_crc32c`; every service reads and writes record batches, and the
    pure-Python CRC was the largest item of each reader's CPU), and at most two C-allocator arenas
    (:func:`apportion.bus.memory.limit_arenas`, so the resident set stays flat); both logged.
    """
    from apportion.bus.crc import use_compiled_crc32c
    from apportion.bus.memory import limit_arenas
    from apportion.bus.resilience import readiness_for

    log.info("record-batch CRC-32C: %s; malloc arenas limited: %s", use_compiled_crc32c(), limit_arenas())

    conn = settings.connection()
    readiness = readiness_for(conn.bootstrap, conn.redis_url if redis else None)
    registry, stop_metrics = start_metrics(settings.metrics_port, settings.metrics_host, readiness)
    return Wiring(clock or settings.make_clock(), conn, readiness, registry, stop_metrics, {})


def install_signal_handlers(stop: asyncio.Event) -> None:
    """Make SIGTERM and SIGINT set ``stop`` (graceful shutdown). Main thread only."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass


AsyncHandler = Callable[[Any, Any], Coroutine[Any, Any, None]]

#: Wall seconds :func:`consume` waits for a new consumer's partition assignment (``on_assigned``).
ASSIGNMENT_DEADLINE_S = 60.0


async def follow(
    poll: Callable[[int], T],
    handle: Callable[[T], Awaitable[None]] | None,
    stop: asyncio.Event,
    poll_ms: Callable[[], int] | int = 200,
    backoff: Backoff | None = None,
) -> None:
    """The one consumer loop every service runs: poll in a worker thread, handle on the loop, until ``stop``.

    Args:
        poll: ``poll(timeout_ms)``, blocking (``AssignedConsumer.poll`` returns records;
            ``EventConsumer.poll_once`` handles them itself and returns a count).
        handle: awaited with each poll's result (``None``: nothing to do after a poll).
        stop: set to end the loop.
        poll_ms: poll timeout, or a callable giving it before each poll (the dispatcher's pacer).
        backoff: waits after a failed poll (default :class:`apportion.bus.resilience.Backoff`).

    A poll that raises (the broker went away, a commit failed, a handler run inside the poll raised: the
    consumer rewound to the failing record, so it comes again, until its bound on redelivery dead-letters it,
    rule D4.dead-letters) is logged in one line and polled again after a backoff; kafka-python reconnects by
    itself. What ``handle`` raises propagates (a session's failure:
    :func:`apportion.bus.resilience.supervise` starts another).
    """
    from apportion.bus.resilience import describe, pause

    backoff = backoff or Backoff()
    while not stop.is_set():
        try:
            got = await asyncio.to_thread(poll, poll_ms() if callable(poll_ms) else poll_ms)
        except _Halted:
            return
        except Exception as exc:  # noqa: BLE001 - an outage or a failed handler: the record comes again
            d = backoff.next()
            log.warning("consumer poll failed (%s); polling again in %.1f s", describe(exc), d)
            if await pause(stop, d):
                return
            continue
        backoff.reset()
        if handle is not None:
            await handle(got)


async def consume(
    make_consumer: Callable[[Callable[[Any, Any], None]], Any],
    handler: AsyncHandler,
    stop: asyncio.Event,
    poll_ms: int = 200,
    on_idle: Callable[[], Awaitable[None]] | None = None,
    backoff: Backoff | None = None,
    *,
    only: tuple[type, ...] = (),
    on_assigned: Callable[[], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Run a blocking EventConsumer until ``stop`` is set, handling events on the loop; never exits on an error.

    Args:
        make_consumer: builds the consumer given the sync handler to install
            (called in a worker thread, since constructing it connects).
        handler: ``async handler(event, delivery)``; runs on this event loop.
        stop: set to end the loop; the consumer is closed before returning.
        poll_ms: poll timeout (bounds shutdown latency).
        on_idle: awaited after each poll (e.g. to publish debounced output).
        backoff: waits after failures (default :class:`apportion.bus.resilience.Backoff`).
        only: event types ``handler`` is given (empty: all); the others are consumed (their offsets
            committed) without a round trip to the event loop.
        on_assigned: awaited once the new consumer's partitions are assigned (``wait_assigned``, 60 wall
            seconds at most) and before its first record is handled, e.g. to register before any command
            is judged; a consumer whose assignment or ``on_assigned`` fails is closed and built again.

    A consumer that cannot be built (broker down) is built again after a backoff, one log line per try;
    then :func:`follow` polls it (a poll that raises is polled again). Only ``stop`` ends the loop.
    """
    from apportion.bus.resilience import describe, pause

    loop = asyncio.get_running_loop()
    halted = threading.Event()
    backoff = backoff or Backoff()

    def sync_handler(event: Any, delivery: Any) -> None:
        if halted.is_set():
            raise _Halted()
        if only and not isinstance(event, only):
            return
        asyncio.run_coroutine_threadsafe(handler(event, delivery), loop).result()

    def build() -> Any:  # in a worker thread
        c = make_consumer(sync_handler)
        if on_assigned is None:
            return c
        try:
            c.wait_assigned(deadline_s=ASSIGNMENT_DEADLINE_S)
            asyncio.run_coroutine_threadsafe(on_assigned(), loop).result()
        except BaseException:
            c.close()
            raise
        return c

    consumer = None
    while consumer is None:
        if stop.is_set():
            return
        try:
            consumer = await asyncio.to_thread(build)
        except Exception as exc:  # noqa: BLE001 - broker down at start: wait, never exit
            d = backoff.next()
            log.warning("cannot start the consumer (%s); next try in %.1f s", describe(exc), d)
            if await pause(stop, d):
                return
    backoff.reset()

    async def idle(_: object) -> None:
        if on_idle is not None:
            await on_idle()

    try:
        await follow(consumer.poll_once, idle, stop, poll_ms, backoff)
    finally:
        halted.set()
        await asyncio.to_thread(consumer.close)


def commit_quietly(consumer: Any, offsets: dict[str, int] | None = None) -> None:
    """``consumer.commit(offsets)`` for lag tools only (a start never reads group offsets): a failure (the
    broker is away) is logged, not raised. Blocking: call it from a worker thread."""
    from apportion.bus.resilience import describe

    try:
        consumer.commit(offsets)
    except Exception as exc:  # noqa: BLE001 - observability only; the service's own state holds its offsets
        log.warning("could not commit the group offsets (%s)", describe(exc))


async def open_in_thread(make: Callable[[], T]) -> T:
    """``make()`` in a worker thread, as ``asyncio.to_thread``, for a call that makes a client (a Kafka reader or
    producer). When the awaiting task is cancelled meanwhile (a caller's timeout at shutdown), the thread runs on
    and the client it then makes is closed (in the loop's executor) instead of being dropped with its network
    thread running."""
    made = asyncio.ensure_future(asyncio.to_thread(make))
    try:
        return await asyncio.shield(made)
    except asyncio.CancelledError:
        made.add_done_callback(_close_orphan)
        raise


def _close_orphan(made: asyncio.Future[Any]) -> None:
    if not made.cancelled() and made.exception() is None:
        asyncio.get_running_loop().run_in_executor(None, made.result().close)


async def close_quietly(*clients: Any) -> None:
    """``close()`` each client not ``None`` in a worker thread; a failure (its broker is gone) is only logged."""
    for c in clients:
        if c is None:
            continue
        try:
            await asyncio.to_thread(c.close)
        except Exception as exc:  # noqa: BLE001 - closing a client of a dependency that is gone
            log.debug("closing %s failed: %s", type(c).__name__, exc)


class _Halted(BaseException):
    """Raised in the poll thread once shutdown began (the record is redelivered later). A ``BaseException``,
    so the consumer never counts it as the handler failing on the record (rule D4.dead-letters)."""


def add_common_flags(ap: Any, settings_cls: type[ServiceSettings] | None = None) -> None:
    """Add the flags every service takes (connection, clock, metrics, logs) to an argparse parser.

    Each maps to a :class:`ServiceSettings` field; flags left out keep the
    environment's (``APPORTION_<NAME>``) or the default value. Call it last:
    with ``settings_cls``, every flag of the parser that names a field of it
    gets ``[default: ...; env APPORTION_<NAME>]`` appended to its help, taken
    from the model itself so ``--help`` cannot drift from the code.
    """
    g = ap.add_argument_group("connection and runtime (also APPORTION_* environment variables)")
    g.add_argument("--bootstrap", dest="kafka_bootstrap", help="Kafka host:port (default: the local stack's)")
    g.add_argument("--redis", dest="redis_url", help="Redis URL (default: the local stack's)")
    g.add_argument("--time-scale", type=float, help="event seconds per wall second (1 = real time)")
    g.add_argument("--metrics-port", type=int, help="Prometheus port (0: off)")
    g.add_argument("--log-level", help="DEBUG, INFO, WARNING")
    if settings_cls is not None:
        _document_defaults(ap, settings_cls)


def _document_defaults(ap: Any, settings_cls: type[ServiceSettings]) -> None:
    """Append each field's default and environment variable to the help of the flag that sets it."""
    from pydantic_core import PydanticUndefined

    prefix = settings_cls.model_config.get("env_prefix", "")
    for action in ap._actions:  # argparse has no public iterator over its actions
        field = settings_cls.model_fields.get(action.dest)
        if field is None or not action.help:
            continue
        default = field.default
        if default is PydanticUndefined or default is None or "(default" in action.help:
            shown = ""
        elif isinstance(default, bool):
            shown = f"default: {'on' if default else 'off'}; "
        else:
            shown = f"default: {default}; "
        action.help = f"{action.help} [{shown}env {prefix}{action.dest.upper()}]".replace("%", "%%")


def flag_overrides(ap: Any, argv: list[str] | None) -> dict[str, Any]:
    """Parse ``argv`` and keep only the flags given (settings overrides)."""
    return {k: v for k, v in vars(ap.parse_args(argv)).items() if v is not None}


def serve(service: str, settings: ServiceSettings, run: Callable[[Any, asyncio.Event], Awaitable[None]]) -> None:
    """Entry-point body of every service: JSON logs, SIGTERM/SIGINT -> graceful stop, run until stopped."""
    setup_logging(service, settings.log_level, settings.log_json)

    async def go() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await run(settings, stop)

    asyncio.run(go())
