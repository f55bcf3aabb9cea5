"""Plumbing every service shares: settings base, JSON logs, metrics, signals, consumer bridge.

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
* :func:`consume` - drive an :class:`apportion.bus.consumer.EventConsumer`
  (kafka-python, blocking) from asyncio: polls run in a worker thread, each
  event is handled *on the event loop* and the poll thread waits for the
  handler to finish, so the wrapper commits an offset only after its effect
  is done (STYLE rule 8).
* :class:`AssignedConsumer` - whole topics from a chosen start (the
  services that rebuild from the log); each record then goes through the
  reader edge every service shares, :class:`apportion.bus.intake.Intake`
  (screen, de-duplicate by id and payload, dead-letter with the reason,
  apply without letting an error stop the service).
* :func:`record_order` - the deterministic merge order of those records.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

from apportion.bus.resilience import Backoff, Readiness
from apportion.clock import Clock, make_clock
from apportion.settings import Connection

log = logging.getLogger("apportion.service")


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


def start_metrics(
    port: int, host: str = "127.0.0.1", readiness: Readiness | None = None
) -> tuple[Any, Callable[[], None]]:
    """A fresh Prometheus registry (with the process collectors) and, when ``port`` > 0, an HTTP endpoint
    serving it. The families every service registers are defined in :mod:`apportion.metrics`.

    The endpoint also answers ``/ready`` (200 when ``readiness`` says ready, else 503; a JSON object naming
    each dependency's state, :class:`apportion.bus.resilience.Readiness`) and ``/healthz`` (200 while the
    process serves); every other path is the metrics.

    Returns:
        ``(registry, stop)``: register metrics on ``registry``; call ``stop()``
        on shutdown (a no-op when the endpoint is off).
    """
    from http.server import ThreadingHTTPServer

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
            if path not in ("/ready", "/healthz"):
                return super().do_GET()
            ok, details = ready.check() if path == "/ready" else (True, {"service": "serving"})
            body = (json.dumps({"ready": ok, **details}) + "\n").encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return None

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # no access log on stderr (the service's log is JSON lines)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return registry, stop


def install_signal_handlers(stop: asyncio.Event) -> None:
    """Make SIGTERM and SIGINT set ``stop`` (graceful shutdown). Main thread only."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass


AsyncHandler = Callable[[Any, Any], Awaitable[None]]


async def consume(
    make_consumer: Callable[[Callable[[Any, Any], None]], Any],
    handler: AsyncHandler,
    stop: asyncio.Event,
    poll_ms: int = 200,
    on_idle: Callable[[], Awaitable[None]] | None = None,
    backoff: Backoff | None = None,
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

    A consumer that cannot be built (broker down) is built again after a backoff, one log line per try. A
    poll that raises (the broker went away, a commit failed, the handler raised: the consumer rewound to
    the failing record, so it is delivered again) is logged and the same consumer polls again after a
    backoff: kafka-python reconnects by itself. Only ``stop`` ends the loop.
    """
    from apportion.bus.resilience import describe, pause

    loop = asyncio.get_running_loop()
    halted = threading.Event()
    backoff = backoff or Backoff()

    def sync_handler(event: Any, delivery: Any) -> None:
        if halted.is_set():
            raise _Halted()
        asyncio.run_coroutine_threadsafe(handler(event, delivery), loop).result()

    consumer = None
    while consumer is None:
        if stop.is_set():
            return
        try:
            consumer = await asyncio.to_thread(make_consumer, sync_handler)
        except Exception as exc:  # noqa: BLE001 - broker down at start: wait, never exit
            d = backoff.next()
            log.warning("cannot start the consumer (%s); next try in %.1f s", describe(exc), d)
            if await pause(stop, d):
                return
    backoff.reset()
    try:
        while not stop.is_set():
            try:
                await asyncio.to_thread(consumer.poll_once, poll_ms)
            except _Halted:
                break
            except Exception as exc:  # noqa: BLE001 - an outage or a failed handler: the record comes again
                d = backoff.next()
                log.warning("consumer poll failed (%s); polling again in %.1f s", describe(exc), d)
                if await pause(stop, d):
                    break
                continue
            backoff.reset()
            if on_idle is not None:
                await on_idle()
    finally:
        halted.set()
        await asyncio.to_thread(consumer.close)


class _Halted(Exception):
    """Raised in the poll thread once shutdown began (the record is redelivered later)."""


class AssignedConsumer:
    """Read whole topics from a chosen start, outside any group rebalance (kafka-python).

    Used by the services that rebuild their state from the log on start
    (policy; accounting when it has no usable checkpoint, else it seeks to
    the checkpoint's offsets with :meth:`seek`). Why not :class:`~apportion.bus.consumer.EventConsumer`
    or faust: both subscribe through a consumer group and resume from the
    committed offsets, while these services must read *every* partition of
    *several* topics from offset 0 (or from the tail) each time, know when
    they have caught up with the log as it was at start, and merge the
    topics in a deterministic order. Manual ``assign`` gives all of that
    directly. Offsets are still committed under ``group_id`` (after the
    effect is stored) so lag is visible with the usual Kafka tools.

    Args:
        bootstrap: Kafka ``host:port``.
        topics: physical topic names (:attr:`apportion.topics.Topic.name`).
        group_id: group to commit offsets under.
        tail: topic name -> how many records per partition to start before
            the end (e.g. ``{usage: 1}`` for the newest snapshot only);
            topics not listed start at offset 0.
        deadline_s: how long to wait for the topics' metadata.

    Raises:
        TimeoutError: a topic has no partitions after ``deadline_s``.
    """

    def __init__(
        self,
        bootstrap: str,
        topics: list[str],
        group_id: str,
        *,
        tail: dict[str, int] | None = None,
        deadline_s: float = 30.0,
    ) -> None:
        import time

        from kafka import KafkaConsumer, TopicPartition

        from apportion.bus.security import kafka_auth

        self._kc = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=8 * 1024 * 1024,
            **kafka_auth(),
        )
        parts = []
        end_at = time.monotonic() + deadline_s
        for t in topics:
            while not (ps := self._kc.partitions_for_topic(t)):
                if time.monotonic() > end_at:
                    self._kc.close()
                    raise TimeoutError(f"topic {t!r} has no partitions (not provisioned?)")
                self._kc.poll(timeout_ms=100)  # refreshes metadata
            parts += [TopicPartition(t, p) for p in sorted(ps)]
        self.partitions = parts
        from apportion.bus.consumer import LagMeter

        #: consumer lag per partition, measured after polls once its ``sink`` is set
        self.lag = LagMeter()
        self._kc.assign(parts)
        self.start_end = self._kc.end_offsets(parts)
        begin = self._kc.beginning_offsets(parts)
        #: log start offsets at start (records below them were deleted).
        self.start_begin = begin
        tail = tail or {}
        for tp in parts:
            back = tail.get(tp.topic)
            start = begin[tp] if back is None else max(begin[tp], self.start_end[tp] - back)
            self._kc.seek(tp, start)

    def seek(self, offsets: dict[str, int]) -> None:
        """Move each partition to the next offset given as ``"topic:partition" -> offset``.

        Partitions not named keep their start position. Call before
        :meth:`catch_up` (e.g. to resume from a checkpoint's offsets).
        """
        for tp in self.partitions:
            off = offsets.get(f"{tp.topic}:{tp.partition}")
            if off is not None:
                self._kc.seek(tp, off)

    def poll(self, timeout_ms: int = 200, max_records: int = 5000) -> list[Any]:
        """Next records (kafka-python ``ConsumerRecord``), partition by partition in offset order."""
        batch = self._kc.poll(timeout_ms=timeout_ms, max_records=max_records)
        self.lag.after_poll(self._kc, lambda: self.partitions)
        return [r for tp in sorted(batch, key=lambda tp: (tp.topic, tp.partition)) for r in batch[tp]]

    async def catch_up(self, stop: asyncio.Event) -> tuple[list[Any], list[Any]] | None:
        """Read up to the end offsets taken at start (in worker threads).

        Returns:
            ``(backlog, late)``: the records below the start's end offsets (the
            log as of the start, for a rebuild) and those appended meanwhile
            (to handle live afterwards); ``None`` when ``stop`` was set first.
        """
        ends = {(tp.topic, tp.partition): off for tp, off in self.start_end.items()}
        backlog: list[Any] = []
        late: list[Any] = []
        while not await asyncio.to_thread(self.caught_up):
            if stop.is_set():
                return None
            for rec in await asyncio.to_thread(self.poll, 200):
                (backlog if rec.offset < ends[(rec.topic, rec.partition)] else late).append(rec)
        return backlog, late

    def caught_up(self) -> bool:
        """True once every partition's position reached its end offset at start."""
        return all(self._kc.position(tp) >= self.start_end[tp] for tp in self.partitions)

    def commit(self, offsets: dict[str, int] | None = None) -> None:
        """Commit offsets under the group (observability; starts do not read them).

        Args:
            offsets: ``"topic:partition"`` -> next offset to commit; default
                the current positions of every partition.
        """
        from kafka.structs import OffsetAndMetadata

        if offsets is None:
            pos = {tp: self._kc.position(tp) for tp in self.partitions}
        else:
            pos = {tp: offsets[k] for tp in self.partitions if (k := f"{tp.topic}:{tp.partition}") in offsets}
        self._kc.commit({tp: OffsetAndMetadata(off, "", -1) for tp, off in pos.items()})

    def close(self) -> None:
        """Close the connection."""
        self._kc.close()


def record_order(rec: Any, event: Any) -> tuple:
    """Deterministic merge order of records from several topics.

    Same as :func:`apportion.bus.reader.log_order`: (event time, topic,
    partition, offset); undecodable records by their Kafka timestamp.
    """
    from apportion.timeutil import to_us

    t = to_us(event.ts) if event is not None else rec.timestamp * 1000
    return (t, rec.topic, rec.partition, rec.offset)


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
