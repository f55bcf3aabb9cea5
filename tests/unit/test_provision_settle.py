"""``provision(fix=True)`` reads the drift again once the broker shows the fixed settings: a KRaft broker applies
a config change when the controller's metadata reaches it, and a describe right after the change can read the
old value (the fault: a stale first answer)."""

from __future__ import annotations

import pytest

from apportion.bus import provision as prov
from apportion.bus.provision import Drift, settled_drift
from apportion.topics import Topic

T = Topic("drift.t", "key", 1, -1, compact=False)
STALE = Drift("drift.t", "retention.ms", "-1", "60000")
OTHER = Drift("drift.u", "cleanup.policy", "compact", "delete")


def answers(monkeypatch: pytest.MonkeyPatch, *reads: list[Drift]) -> list[int]:
    calls = [0]

    def find_drift(admin: object, topics: object, replication: object = None) -> list[Drift]:  # the describe
        calls[0] += 1
        return reads[min(calls[0], len(reads)) - 1]

    monkeypatch.setattr(prov, "find_drift", find_drift)
    monkeypatch.setattr("time.sleep", lambda _s: None)
    return calls


def test_a_stale_describe_is_asked_again_until_the_fix_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = answers(monkeypatch, [STALE], [STALE], [])
    assert settled_drift(None, [T], (1, 1), [STALE]) == []
    assert calls[0] == 3


def test_drift_the_fix_did_not_touch_does_not_hold_it_up(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = answers(monkeypatch, [OTHER])
    assert settled_drift(None, [T], (1, 1), [STALE]) == [OTHER]
    assert calls[0] == 1


def test_a_fix_that_never_shows_is_reported_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = answers(monkeypatch, [STALE])
    assert settled_drift(None, [T], (1, 1), [STALE], timeout_s=0.0) == [STALE]
    assert calls[0] == 1
