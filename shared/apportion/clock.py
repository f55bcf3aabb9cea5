"""Clocks: the ONE place outside tests that reads the wall clock.

Domain code never reads time; it is handed event time (rule D6.event-time).
Services get event time from a :class:`Clock` injected at the composition
root (``app.py``), so tests drive time by hand and demos run faster than
real time:

* :class:`WallClock` - production: event time is wall time (UTC).
* :class:`ScaledClock` - demos: event time runs ``scale`` times faster than
  the wall, from a pair of epochs::

      event_time = epoch_event + (wall - epoch_wall) * scale

  Every service given the same ``(scale, epoch_wall, epoch_event)`` (the
  environment variables ``APPORTION_TIME_SCALE``,
  ``APPORTION_CLOCK_EPOCH_WALL``, ``APPORTION_CLOCK_EPOCH_EVENT``, read by
  each service's ``config.py``) computes the same event time at the same
  wall instant, up to the hosts' clock skew times ``scale``.
* :class:`ManualClock` - tests: time moves only when the test calls
  :meth:`ManualClock.advance` (or a sync sleep, which advances it).

Units: :meth:`Clock.now` is an aware UTC ``datetime``; :meth:`Clock.now_us`
is integer microseconds since the epoch (:mod:`apportion.timeutil`);
``sleep`` takes **event-time** seconds (a simulated workload of
``duration_s`` sleeps ``duration_s`` and so takes ``duration_s / scale``
wall seconds on a scaled clock). :meth:`Clock.wall_seconds` converts an
event-time duration to wall seconds for timeouts handed to libraries.

Nothing here runs at import time.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

from apportion.timeutil import from_us, s_to_us, to_us


@runtime_checkable
class Clock(Protocol):
    """Source of event time for a service."""

    def now(self) -> datetime:
        """Current event time, aware UTC."""
        ...

    def now_us(self) -> int:
        """Current event time, integer microseconds since the Unix epoch."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of event time (asyncio). Negative or zero returns at once."""
        ...

    def sleep_sync(self, seconds: float) -> None:
        """Wait ``seconds`` of event time, blocking the calling thread."""
        ...

    def wall_seconds(self, event_seconds: float) -> float:
        """Wall-clock seconds that ``event_seconds`` of event time take."""
        ...


def _wall_us() -> int:
    """The wall clock in integer microseconds (the only raw read)."""
    return time.time_ns() // 1000


class WallClock:
    """Event time is wall time (production)."""

    def now(self) -> datetime:
        return from_us(_wall_us())

    def now_us(self) -> int:
        return _wall_us()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def sleep_sync(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wall_seconds(self, event_seconds: float) -> float:
        return event_seconds

    def __repr__(self) -> str:
        return "WallClock()"


class ScaledClock:
    """Accelerated event time: ``epoch_event + (wall - epoch_wall) * scale``.

    Args:
        scale: event seconds per wall second, > 0 (``60`` runs an hour a minute).
        epoch_wall: the wall instant the two timelines are pinned at (aware).
        epoch_event: the event time at ``epoch_wall`` (aware); e.g. the first
            submission of a trace being replayed.
        wall: microsecond wall-time source (tests inject a fake).

    Raises:
        ValueError: ``scale <= 0`` or a naive epoch.
    """

    def __init__(
        self, scale: float, epoch_wall: datetime, epoch_event: datetime, wall: WallClock | ManualClock | None = None
    ) -> None:
        if not scale > 0:
            raise ValueError(f"time scale must be > 0, got {scale}")
        self.scale = float(scale)
        self.epoch_wall_us = to_us(epoch_wall)
        self.epoch_event_us = to_us(epoch_event)
        self._wall = wall if wall is not None else WallClock()

    def now_us(self) -> int:
        elapsed = self._wall.now_us() - self.epoch_wall_us
        return self.epoch_event_us + round(elapsed * self.scale)

    def now(self) -> datetime:
        return from_us(self.now_us())

    def wall_seconds(self, event_seconds: float) -> float:
        return max(0.0, event_seconds) / self.scale

    async def sleep(self, seconds: float) -> None:
        await self._wall.sleep(self.wall_seconds(seconds))

    def sleep_sync(self, seconds: float) -> None:
        self._wall.sleep_sync(self.wall_seconds(seconds))

    def __repr__(self) -> str:
        return (
            f"ScaledClock(scale={self.scale}, epoch_wall={from_us(self.epoch_wall_us).isoformat()}, "
            f"epoch_event={from_us(self.epoch_event_us).isoformat()})"
        )


class ManualClock:
    """A clock that moves only when told (tests).

    :meth:`advance` / :meth:`set` move time forward and wake async sleepers
    whose deadline has passed; :meth:`sleep_sync` advances time itself
    (a single-threaded test has nobody else to do it).

    Args:
        start: initial event time (aware); default 2025-01-01T00:00:00Z.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._us = to_us(start or datetime(2025, 1, 1, tzinfo=UTC))
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def now_us(self) -> int:
        return self._us

    def now(self) -> datetime:
        return from_us(self._us)

    def wall_seconds(self, event_seconds: float) -> float:
        return max(0.0, event_seconds)

    def advance(self, seconds: float) -> datetime:
        """Move time forward by ``seconds`` (>= 0); returns the new time.

        Raises:
            ValueError: ``seconds < 0`` (time never runs backwards).
        """
        if seconds < 0:
            raise ValueError("a clock never runs backwards")
        return self.set_us(self._us + s_to_us(seconds))

    def set(self, t: datetime) -> datetime:
        """Move time forward to ``t``. Raises ValueError when ``t`` is in the past."""
        return self.set_us(to_us(t))

    def set_us(self, us: int) -> datetime:
        """Move time forward to ``us`` microseconds. Raises ValueError when in the past."""
        if us < self._us:
            raise ValueError("a clock never runs backwards")
        self._us = us
        still = []
        for deadline, fut in self._waiters:
            if deadline <= us:
                if not fut.done():
                    fut.get_loop().call_soon_threadsafe(_resolve, fut)
            else:
                still.append((deadline, fut))
        self._waiters = still
        return self.now()

    @property
    def sleepers(self) -> int:
        """Number of async sleepers still waiting (tests use it to sync up)."""
        return sum(1 for _, f in self._waiters if not f.done())

    async def sleep(self, seconds: float) -> None:
        deadline = self._us + s_to_us(max(0.0, seconds))
        if deadline <= self._us:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((deadline, fut))
        await fut

    def sleep_sync(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def __repr__(self) -> str:
        return f"ManualClock({self.now().isoformat()})"


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def make_clock(
    time_scale: float = 1.0, epoch_wall: datetime | None = None, epoch_event: datetime | None = None
) -> WallClock | ScaledClock:
    """Build the clock a service configuration asks for.

    Args:
        time_scale: 1.0 (with no epochs) gives a :class:`WallClock`; any other
            value, or any epoch, gives a :class:`ScaledClock`.
        epoch_wall: wall instant the timelines are pinned at; default now.
            Services that must agree on event time need the same value.
        epoch_event: event time at ``epoch_wall``; default ``epoch_wall``.

    Raises:
        ValueError: ``time_scale <= 0``.
    """
    if time_scale == 1.0 and epoch_wall is None and epoch_event is None:
        return WallClock()
    ew = epoch_wall or WallClock().now()
    return ScaledClock(time_scale, ew, epoch_event or ew)
