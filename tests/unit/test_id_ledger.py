"""The reader edge's id ledger is bounded by the window W and by a count (issue 18, bounded memory).

:class:`apportion.bus.intake.IdLedger` keeps ids in two generations by event time: an id is known for at
least W and at most 2 W of event time, heartbeats are never remembered, a count cap turns the generations
early, and a pickled ledger (the dispatcher's snapshot) keeps ids with their digests, the same in every process.
"""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import uuid
from datetime import timedelta

import pytest

from apportion import events
from apportion.bus.intake import _NO_DIGEST, IdLedger
from apportion.timeutil import from_us
from tests.kit.builders import s, submitted


def sub(i: int, t_s: float) -> events.JobSubmitted:
    """Submission ``i`` at ``T0 + t_s`` under an id of its own."""
    return submitted(f"j{i}", at=s(t_s), event_id=uuid.UUID(int=i + 1))


def test_an_id_is_known_for_at_least_the_window_and_forgotten_before_two_windows() -> None:
    # one event a second, W = 100 s: the generations turn at t = 100, 200, ... (the first event opens one at 0)
    ledger = IdLedger(window_s=100)
    evs = [sub(i, i) for i in range(501)]
    for t, ev in enumerate(evs):
        assert ledger.check(ev) is False
        start = 100 * (t // 100)  # the current generation's first second
        # known: the old generation (from start - 100) and the current one, exactly
        assert len(ledger) == t - max(start - 100, 0) + 1
    # at t = 500: seconds 400..500 are known (the old generation 400..499 and 500), 399 is not
    assert ledger.check(evs[400]) is True
    assert ledger.check(evs[500]) is True
    assert ledger.check(evs[399]) is False  # forgotten: new again (and remembered now)


def test_every_id_of_the_last_window_is_known_at_every_moment() -> None:
    w = 100
    ledger = IdLedger(window_s=w)
    evs = [sub(i, i) for i in range(450)]
    for t, ev in enumerate(evs):
        ledger.check(ev)
        # remember=False reads without changing the ledger
        for back in range(min(w, t) + 1):
            assert ledger.check(evs[t - back], remember=False) is True, (t, back)
        for back in range(2 * w, t + 1):
            assert ledger.check(evs[t - back], remember=False) is False, (t, back)


def test_heartbeats_are_checked_but_never_remembered() -> None:
    ledger = IdLedger(window_s=3600)
    for i in range(10_000):
        hb = events.NodeHeartbeat(node_id="n1", ts=from_us(s(i)), producer="agent")
        assert ledger.check(hb) is False
    ledger.remember(events.NodeHeartbeat(node_id="n1", ts=from_us(s(0)), producer="agent"))
    assert len(ledger) == 0
    # a heartbeat under an id read before, on another payload, is still a reused id
    ev = sub(1, 0)
    ledger.check(ev)
    forged = events.NodeHeartbeat(event_id=ev.event_id, node_id="n1", ts=from_us(s(0)), producer="agent")
    with pytest.raises(events.DecodeError, match="event_id reused"):
        ledger.check(forged)


def test_the_count_cap_turns_the_generations_early() -> None:
    ledger = IdLedger(capacity=10, window_s=10**6)  # all in one window: only the cap bounds it
    evs = [sub(i, i) for i in range(23)]
    for ev in evs:
        ledger.check(ev)
        assert len(ledger) <= 10
    # generations of 5: 0-4, 5-9, 10-14, 15-19, 20-22; the last two are kept
    assert len(ledger) == 8
    assert ledger.check(evs[15]) is True
    assert ledger.check(evs[14]) is False


def test_a_gap_longer_than_the_window_forgets_both_generations() -> None:
    ledger = IdLedger(window_s=100)
    for i in range(150):
        ledger.check(sub(i, i))  # generations: 0-99 (old), 100-149 (current, turns at 200)
    assert ledger.check(sub(999, 300)) is False  # 300 >= 200 + 100: everything before is more than W old
    assert len(ledger) == 1
    assert ledger.check(sub(149, 149)) is False


def test_a_ledger_pickled_in_another_process_still_tells_a_reused_id_from_a_duplicate() -> None:
    # the digests are the same in every process (events.payload_digest): a ledger pickled by a process with
    # another hash seed (the dispatcher before its restart) is restored with them, so a reuse is still caught
    code = (
        "import base64, pickle, sys, uuid; sys.path[:0] = ['shared', '.']; "
        "from apportion.bus.intake import IdLedger; from tests.kit.builders import s, submitted; "
        "led = IdLedger(window_s=100); led.check(submitted('j1', at=s(0), event_id=uuid.UUID(int=2))); "
        "print(base64.b64encode(pickle.dumps(led)).decode())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    back = pickle.loads(base64.b64decode(out.stdout))
    ev = sub(1, 0)
    assert len(back) == 1 and back.window == timedelta(seconds=100)
    assert back.check(ev) is True  # the same payload: a duplicate
    with pytest.raises(events.DecodeError, match="event_id reused"):
        back.check(ev.model_copy(update={"job_id": "other"}))  # another payload under the id: a reuse


def test_a_ledger_pickled_without_digests_reads_any_payload_under_its_ids_as_a_duplicate() -> None:
    # a snapshot written before the digests were the same in every process kept the ids only (_NO_DIGEST)
    ledger = IdLedger(window_s=100)
    ev = sub(1, 0)
    ledger.check(ev)
    old = pickle.loads(pickle.dumps(ledger))
    old._cur = dict.fromkeys(old._cur, _NO_DIGEST)
    assert old.check(ev.model_copy(update={"job_id": "other"})) is True
    new = sub(2, 1)
    assert old.check(new) is False
    with pytest.raises(events.DecodeError):
        old.check(new.model_copy(update={"job_id": "other"}))  # ids read after the restore have digests


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        IdLedger(capacity=1)
    with pytest.raises(ValueError):
        IdLedger(window_s=0)
