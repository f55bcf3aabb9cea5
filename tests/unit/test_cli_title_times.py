"""`share` and `top` print the read model's time in their titles at whole seconds, as the forecasts do."""

from __future__ import annotations

import pytest

from apportion.cli.common import at_seconds


@pytest.mark.parametrize(
    ("at", "shown"),
    [
        ("2026-12-07T08:41:05.595613+00:00", "2026-12-07T08:41:05+00:00"),
        ("2026-12-07T08:41:05+00:00", "2026-12-07T08:41:05+00:00"),
        (None, "?"),
        ("not a time", "not a time"),
    ],
)
def test_a_title_time_is_iso_at_whole_seconds(at: str | None, shown: str) -> None:
    assert at_seconds(at) == shown
