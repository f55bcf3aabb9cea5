"""Human durations for the CLI and config files: ``90``, ``90s``, ``30m``, ``2h``, ``1d12h``."""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str | float | int) -> float:
    """Parse a duration to seconds.

    ``parse_duration("1h30m") == 5400.0``; a bare number is seconds.

    Raises:
        ValueError: empty, negative or unparseable text (the message shows the accepted forms).
    """
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"duration must be >= 0, got {text}")
        return float(text)
    s = text.strip().lower().replace(" ", "")
    pos, total = 0, 0.0
    while pos < len(s):
        m = _PART.match(s, pos)
        if not m:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not s or pos != len(s):
        raise ValueError(f"bad duration {text!r}: use seconds or forms like 90s, 30m, 2h, 1d12h")
    return total


def format_duration(seconds: float) -> str:
    """Seconds -> compact human form (``5400 -> '1h30m'``, ``0 -> '0s'``)."""
    s = int(round(seconds))
    if s == 0:
        return "0s"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        q, s = divmod(s, size)
        if q:
            out.append(f"{q}{unit}")
    return "".join(out)
