"""The campaign's hostile records (``bench/chaos.py``): each class is what the last line counts it as.

A record naming unknown entities must be a valid event under an id of its own: two of them under one id with
different payloads are an ``event_id reused`` poison the services dead-letter (and the campaign did not count),
which is how seed 7 failed ``audit verify`` on an accounting snapshot (docs/reliability.md).
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from types import ModuleType

import pytest

from apportion import events as ev
from apportion.bus.intake import screen


@pytest.mark.parametrize("seed", [1, 7])
def test_unknown_entity_records_are_valid_events_under_ids_of_their_own(chaos: ModuleType, seed: int) -> None:
    now = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
    ids: Counter[str] = Counter()
    unknown = 0
    for batch in range(10):  # the ten batches of `--quick` (30 records each)
        for h in chaos.hostile_records(30, seed * 1000 + batch, [], now):
            if h.cls != "unknown_entity":
                with pytest.raises(ev.DecodeError):
                    screen(h.value, h.key, h.topic)
                continue
            unknown += 1
            assert not h.poison
            e = screen(h.value, h.key, h.topic)
            assert e.ts == now and json.loads(h.value)["event_id"] == str(e.event_id)
            ids[str(e.event_id)] += 1
    assert unknown == 10 * 3  # 30 // 10 classes without reused ids = 3 per batch
    assert max(ids.values()) == 1, ids.most_common(3)
