"""Fencing tokens: the pure rule (``next_token``, range) and a lease whose Redis fails (no server needed).

The same rule against a real Redis (flush, floor, corrupt counter) is in
``tests/integration/test_lease.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from services.dispatcher.lease import (
    TOKEN_MAX,
    Lease,
    TokenRangeError,
    highest_token,
    next_token,
    valid_token,
)

NEXT_CASES = [
    # id, counter, floor, expected
    ("fresh Redis, no floor: token 1", 0, 0, 1),
    ("counter ahead of the floor: counter + 1", 7, 4, 8),
    ("Redis flushed after token 4 (counter lost): floor + 1", 0, 4, 5),
    ("floor ahead of a counter left behind", 2, 9, 10),
    ("counter and floor equal", 5, 5, 6),
    ("one below the top: the top itself", TOKEN_MAX - 1, 0, TOKEN_MAX),
]


@pytest.mark.parametrize("case_id,counter,floor,expected", NEXT_CASES, ids=[c[0] for c in NEXT_CASES])
def test_next_token(case_id, counter, floor, expected):
    token = next_token(counter, floor)
    assert token == expected
    assert token > counter and token > floor and valid_token(token)


REFUSED_CASES = [
    ("counter at the top: nothing left", TOKEN_MAX, 0),
    ("floor at the top", 0, TOKEN_MAX),
    ("counter 2**62 (written by hand)", 2**62, 0),
    ("floor 2**62 (a forged command in the log)", 0, 2**62),
    ("negative counter", -1, 0),
    ("negative floor", 0, -3),
    ("boolean is not a token", True, 0),
]


@pytest.mark.parametrize("case_id,counter,floor", REFUSED_CASES, ids=[c[0] for c in REFUSED_CASES])
def test_next_token_refuses_out_of_range(case_id, counter, floor):
    with pytest.raises(TokenRangeError):
        next_token(counter, floor)


@pytest.mark.parametrize(
    "value,ok",
    [(1, True), (TOKEN_MAX, True), (0, False), (-1, False), (TOKEN_MAX + 1, False), (2**62, False), (None, False)]
    + [(True, False), (3.0, False)],
)
def test_valid_token_range(value, ok):
    assert valid_token(value) is ok


def test_highest_token_ignores_missing_and_out_of_range():
    evs = [SimpleNamespace(fencing_token=t) for t in (3, None, 2**62, 0, 9, -5)] + [SimpleNamespace()]
    assert highest_token(evs) == 9
    assert highest_token([]) == 0


class DownRedis:
    """A ``redis.Redis`` stand-in whose every script call fails as an unreachable server does."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.calls = 0

    def register_script(self, _src: str):
        def call(**_kw):
            self.calls += 1
            raise self.exc

        return call


def test_unreachable_redis_is_not_leader_with_a_logged_reason(caplog):
    import redis

    r = DownRedis(redis.exceptions.ConnectionError("Error 111 connecting to localhost:1. Connection refused."))
    lease = Lease(r, "dispatcher-a", ttl_s=3.0, floor=4)
    lease.token = 4  # it was leading
    with caplog.at_level(logging.WARNING, logger="apportion.dispatcher.lease"):
        assert lease.try_acquire() == 0
        assert lease.try_acquire() == 0  # same reason: logged once
    assert not lease.is_leader and lease.reason.startswith("Redis unavailable: ConnectionError")
    assert [rec.getMessage() for rec in caplog.records] == [f"not leader: {lease.reason}"]
    assert r.calls == 2
    lease.token = 4
    lease.release()  # does not raise either
    assert lease.token == 0


def test_any_redis_error_is_not_leader():
    for exc in (TimeoutError("timed out"), OSError("network unreachable"), RuntimeError("LOADING")):
        assert Lease(DownRedis(exc), "d").try_acquire() == 0


def test_lease_floor_only_grows_and_ignores_invalid_values():
    lease = Lease(DownRedis(OSError()), "d", floor=3)
    for t in (2, None, 2**62, 0, 7, 5):
        lease.observe(t)
    assert lease.floor == 7
    with pytest.raises(TokenRangeError):
        Lease(DownRedis(OSError()), "d", floor=2**62)


class ScriptedRedis:
    """A ``redis.Redis`` stand-in whose acquire script answers from a list."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = answers

    def register_script(self, _src: str):
        return lambda **_kw: self.answers.pop(0)


def test_expires_in_counts_from_the_request_and_is_zero_when_not_leader(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("services.dispatcher.lease.time.monotonic", lambda: clock[0])
    lease = Lease(ScriptedRedis([3, 3, 0]), "a", ttl_s=3.0)
    assert lease.expires_in() == 0.0
    assert lease.try_acquire() == 3
    clock[0] = 102.0
    assert lease.expires_in() == pytest.approx(1.0)
    clock[0] = 104.0  # paused past the TTL (SIGSTOP): must not publish
    assert lease.expires_in() < 0
    assert lease.try_acquire() == 3  # renewed
    assert lease.expires_in() == pytest.approx(3.0)
    assert lease.try_acquire() == 0  # another holds it
    assert lease.expires_in() == 0.0 and lease.reason == "another instance holds the lease"


def test_script_errors_are_not_leader_with_their_reason():
    lease = Lease(ScriptedRedis([-1, -2]), "a")
    assert lease.try_acquire() == 0 and lease.reason.startswith("the token counter in Redis is not an integer")
    assert lease.try_acquire() == 0 and lease.reason == "the next fencing token would exceed 2**53"


def test_renew_with_redis_down_is_not_leader():
    lease = Lease(ScriptedRedis([4]), "a", ttl_s=3.0)
    assert lease.try_acquire() == 4
    lease._renew = DownRedis(OSError("unreachable")).register_script("")
    assert lease.renew() is False and lease.reason.startswith("Redis unavailable: OSError")
