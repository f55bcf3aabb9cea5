"""Event time in the domain: integer microseconds since the Unix epoch, UTC.

Domain code (occupancy, fair share, placement) works on ``int`` microseconds
so that sums are exact and the same log always gives bit-identical answers;
``datetime`` is for the edges (events, CLI). The conversion is lossless
because ``datetime`` itself has microsecond resolution.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

Micros = int
"""Event time or duration in integer microseconds (UTC epoch for instants)."""

US_PER_S: int = 1_000_000
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
WEEK_S: int = 7 * 24 * 3600


def to_us(dt: datetime) -> Micros:
    """Aware datetime -> microseconds since the epoch (exact).

    Raises:
        ValueError: ``dt`` is naive.
    """
    if dt.tzinfo is None:
        raise ValueError("naive datetime: event time must be timezone-aware UTC")
    delta = dt - EPOCH
    return (delta.days * 86_400 + delta.seconds) * US_PER_S + delta.microseconds


def from_us(us: Micros) -> datetime:
    """Microseconds since the epoch -> aware UTC datetime (exact)."""
    return EPOCH + timedelta(0, 0, us)  # (days, seconds, microseconds: positional is cheaper than by name)


def utc_text(us: Micros) -> str:
    """An instant for people, to the second: ``2026-12-07 06:49:19 UTC`` (pending reasons, protection notices)."""
    return from_us(us).strftime("%Y-%m-%d %H:%M:%S UTC")


def s_to_us(seconds: float) -> Micros:
    """Seconds (float) -> microseconds, rounded to the nearest microsecond."""
    return round(seconds * US_PER_S)


def us_to_s(us: Micros) -> float:
    """Microseconds -> seconds (float)."""
    return us / US_PER_S
