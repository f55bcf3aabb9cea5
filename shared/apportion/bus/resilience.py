"""Staying up: wait for Kafka and Redis, retry with backoff, report readiness.

Every service runs its connected part as a *session* under :func:`supervise`: a session that raises
(broker or Redis gone, a publish that timed out, a consumer that cannot commit) is logged with what it
was waiting for, the service reports itself not ready, waits (:class:`Backoff`: 0.5 s doubling to 30 s)
and starts the session again; it never exits because a dependency is down, however long. A session
begins with :func:`wait_reachable` for each dependency, which logs one clear line per try
(``waiting for Kafka at 127.0.0.1:9092 (connection refused); next try in 2.0 s``) instead of a traceback.

Readiness (:class:`Readiness`) is what ``/ready`` on the metrics port answers: 200 once the service's
session says it is ready *and* its dependencies answer now (a TCP connect to the Kafka bootstrap, a Redis
``PING``), else 503 with the reason. ``/healthz`` answers 200 while the process serves at all.

A publish that must not be lost (a dead letter: the offset of its record is stored only after it) goes
through :func:`publish_until_acked`, which retries a timed-out send with the same backoff until the broker
acknowledges it or the service stops (then it raises, so nothing after it is stored).

Nothing connects at import time.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger("apportion.bus.resilience")

#: First wait after a failure, and the longest, wall seconds (doubling in between).
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0

#: Wall seconds a readiness probe may take (a TCP connect, a Redis PING).
PROBE_TIMEOUT_S = 1.0

#: kafka-python client settings every consumer and producer of the services takes: its reconnect backoff
#: doubles up to ``reconnect_backoff_max_ms``, 30 s by default, so a client that kept trying through a long
#: outage (the dispatcher's consumer, polled on while its term is blind) went on failing for up to 30 s
#: after the broker was back and ``/ready`` said 200. 1 s, the Java client's default, instead.
KAFKA_RECONNECT: dict[str, Any] = {"reconnect_backoff_max_ms": 1000}

Probe = Callable[[], None]
T = TypeVar("T")


class Backoff:
    """Waits between retries: ``first_s``, doubling up to ``max_s``; :meth:`reset` after a success."""

    def __init__(self, first_s: float = BACKOFF_FIRST_S, max_s: float = BACKOFF_MAX_S) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s

    def next(self) -> float:
        """The wait before the next try (seconds); the one after doubles, capped at ``max_s``."""
        d = self._next
        self._next = min(2 * d, self.max_s)
        return d

    def reset(self) -> None:
        """Start again from ``first_s`` (after a try that succeeded)."""
        self._next = self.first_s


def describe(exc: BaseException) -> str:
    """One line for a failure: the exception's class and message (no traceback)."""
    name = type(exc).__name__
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if msg.startswith(name):  # kafka-python's errors begin with their own class name
        msg = msg[len(name) :].lstrip(": ")
    return f"{name}: {msg}" if msg and msg != "None" else name


#: ``OSError`` numbers that say the machine's storage is away or full, not that the work is at fault.
STORAGE_OUTAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})


def is_outage(exc: BaseException | None) -> bool:
    """True when ``exc`` (or an exception it was raised from) says the broker, Redis or the machine's storage
    is away, not that the work is at fault: any kafka-python or redis-py error, a ``ConnectionError``, a
    ``TimeoutError`` (socket timeouts included) or an ``OSError`` of :data:`STORAGE_OUTAGE_ERRNOS` (a full
    disk: a node agent cannot write its journal), followed through ``raise ... from`` and the exception being
    handled (unless ``from None`` hid it). What retries work until it passes (the consumer's bound on
    redelivery, rule D4.dead-letters) never gives up on one of these, however long the outage."""
    from kafka.errors import KafkaError
    from redis.exceptions import RedisError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KafkaError | RedisError | ConnectionError | TimeoutError):
            return True
        if isinstance(exc, OSError) and exc.errno in STORAGE_OUTAGE_ERRNOS:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ if exc.__cause__ is not None or exc.__suppress_context__ else exc.__context__
    return False


async def pause(stop: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds`` or until ``stop`` is set; True when stopped."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True


def kafka_probe(bootstrap: str) -> Probe:
    """A probe that passes when one ``host:port`` of ``bootstrap`` accepts a TCP connection."""
    addrs = []
    for part in bootstrap.split(","):
        host, _, port = part.strip().rpartition(":")
        addrs.append((host.strip("[]") or "127.0.0.1", int(port)))

    def probe() -> None:
        err: OSError | None = None
        for addr in addrs:
            try:
                socket.create_connection(addr, timeout=PROBE_TIMEOUT_S).close()
                return
            except OSError as exc:
                err = exc
        raise ConnectionError(f"no broker answers ({err})")

    return probe


def redis_probe(url: str) -> Probe:
    """A probe that passes when the Redis at ``url`` answers ``PING`` (with this process's credentials)."""

    def probe() -> None:
        import redis

        from apportion.bus.security import redis_auth

        r = redis.Redis.from_url(
            url, socket_timeout=PROBE_TIMEOUT_S, socket_connect_timeout=PROBE_TIMEOUT_S, **redis_auth(url)
        )
        try:
            r.ping()
        finally:
            r.close()

    return probe


class Readiness:
    """What ``/ready`` answers: the session's own state and live probes of the dependencies.

    Args:
        probes: dependency name (``"Kafka"``, ``"Redis"``) -> ``(address, probe)``; a probe raises when
            the dependency does not answer now.

    Attributes:
        ready: the session said it is ready (connected, caught up) and has not failed since.
        reason: why not, when not (``"starting"`` at first).
    """

    def __init__(self, probes: dict[str, tuple[str, Probe]] | None = None) -> None:
        self.probes = dict(probes or {})
        self.ready = False
        self.reason = "starting"
        self._lock = threading.Lock()

    def set(self, ready: bool, reason: str = "") -> None:
        """Record the session's state (thread-safe)."""
        with self._lock:
            self.ready, self.reason = ready, "" if ready else (reason or "not ready")

    def check(self) -> tuple[bool, dict[str, str]]:
        """``(ready, details)``: details name each dependency's state and the session's."""
        with self._lock:
            ready, reason = self.ready, self.reason
        details = {"service": "ready" if ready else reason}
        for name, (addr, probe) in self.probes.items():
            try:
                probe()
                details[name] = f"reachable at {addr}"
            except Exception as exc:  # noqa: BLE001 - any failure is "not reachable", said in the answer
                details[name] = f"unreachable at {addr} ({describe(exc)})"
                ready = False
        return ready, details


def readiness_for(bootstrap: str | None = None, redis_url: str | None = None) -> Readiness:
    """A :class:`Readiness` probing the Kafka at ``bootstrap`` and the Redis at ``redis_url`` (either optional)."""
    probes: dict[str, tuple[str, Probe]] = {}
    if bootstrap:
        probes["Kafka"] = (bootstrap, kafka_probe(bootstrap))
    if redis_url:
        probes["Redis"] = (redis_url, redis_probe(redis_url))
    return Readiness(probes)


async def wait_reachable(readiness: Readiness, stop: asyncio.Event, backoff: Backoff | None = None) -> bool:
    """Wait until every dependency of ``readiness`` answers, one log line per failed try; False when stopped."""
    backoff = backoff or Backoff()
    for name, (addr, probe) in readiness.probes.items():
        waited = False
        while True:
            if stop.is_set():
                return False
            try:
                await asyncio.to_thread(probe)
            except Exception as exc:  # noqa: BLE001 - any failure: wait and try again
                d = backoff.next()
                readiness.set(False, f"waiting for {name} at {addr}")
                log.warning("waiting for %s at %s (%s); next try in %.1f s", name, addr, describe(exc), d)
                waited = True
                if await pause(stop, d):
                    return False
                continue
            if waited:
                log.info("%s at %s reachable", name, addr)
            break
    return True


async def connect(
    factory: Callable[[], T], what: str, readiness: Readiness, stop: asyncio.Event, backoff: Backoff | None = None
) -> T | None:
    """``factory()`` (a client that connects when built, run in a worker thread) once the dependencies answer,
    again after each failure, one log line per try; ``None`` when ``stop`` was set first."""
    backoff = backoff or Backoff()
    while True:
        if not await wait_reachable(readiness, stop, backoff):
            return None
        try:
            return await asyncio.to_thread(factory)
        except Exception as exc:  # noqa: BLE001 - the broker went away again: wait and try again
            d = backoff.next()
            readiness.set(False, f"cannot connect {what}")
            log.warning("cannot connect %s (%s); next try in %.1f s", what, describe(exc), d)
            if await pause(stop, d):
                return None


async def supervise(
    name: str,
    session: Callable[[], Awaitable[None]],
    stop: asyncio.Event,
    readiness: Readiness,
    backoff: Backoff | None = None,
) -> None:
    """Run ``session()`` until ``stop`` is set, starting it again after each failure; never raises for one.

    Before each try the dependencies are waited for (:func:`wait_reachable`). A session that raises (or
    returns while ``stop`` is not set) is logged in one line, ``readiness`` goes to not ready, and the next
    try follows after a backoff, reset whenever the session had become ready. ``asyncio.CancelledError``
    and ``KeyboardInterrupt`` still propagate.
    """
    backoff = backoff or Backoff()
    while not stop.is_set():
        if not await wait_reachable(readiness, stop, backoff):
            return
        failure: BaseException | None = None
        try:
            await session()
        except Exception as exc:  # noqa: BLE001 - a dependency gone, a timed-out publish: start again
            failure = exc
        if stop.is_set():
            return
        if readiness.ready:
            backoff.reset()
        reason = describe(failure) if failure is not None else "session ended"
        readiness.set(False, reason)
        d = backoff.next()
        log.warning(
            "%s stopped (%s): starting again in %.1f s",
            name,
            reason,
            d,
            exc_info=failure if log.isEnabledFor(logging.DEBUG) else None,
        )
        if await pause(stop, d):
            return


def publish_until_acked(
    publish: Callable[[Any], Any],
    event: Any,
    stopped: Callable[[], bool],
    backoff: Backoff | None = None,
) -> Any:
    """``publish(event)`` (which waits for the ack), again after each failure until it succeeds.

    For what must never be lost nor end the service (a dead letter). Blocking: call it from a worker
    thread. The same event is sent again, so a copy that did reach the broker is a duplicate readers drop.

    Raises:
        the last failure once ``stopped()`` is true (so the caller stores nothing after it).
    """
    backoff = backoff or Backoff()
    while True:
        try:
            return publish(event)
        except Exception as exc:
            if stopped():
                raise
            d = backoff.next()
            log.warning("publishing %s failed (%s); retrying in %.1f s", event.type, describe(exc), d)
            time.sleep(d)  # a retry's backoff in a worker thread, not a synchronisation
