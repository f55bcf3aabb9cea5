"""The dispatcher lease against a real Redis: durable, monotonic fencing tokens.

``FLUSHDB`` stands in for a Redis restart without persistence: the counter
and the lease are gone, and only the floor (the highest token in the log)
keeps the next token above every token seen. Each test uses its own Redis
database and key prefix, so a flush touches nothing else.
"""

from __future__ import annotations

import uuid

import pytest

from apportion.bus.security import redis_auth
from services.dispatcher.lease import TOKEN_MAX, Lease, next_token, token_key

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_url: str, monkeypatch):
    import redis

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"lease-{uuid.uuid4().hex[:8]}.")
    base = redis_url.rstrip("/").rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url.rstrip("/")
    r = redis.Redis.from_url(f"{base}/9", **redis_auth())
    r.flushdb()
    yield r
    r.flushdb()
    r.close()


def test_tokens_grow_renewal_keeps_them_and_a_standby_waits(client):
    a, b = Lease(client, "dispatcher-a", ttl_s=60), Lease(client, "dispatcher-b", ttl_s=60)
    assert a.try_acquire() == 1
    assert b.try_acquire() == 0 and b.reason == "another instance holds the lease"
    assert a.try_acquire() == 1  # renewal keeps the token
    a.release()
    assert b.try_acquire() == 2  # b fences a out
    assert a.try_acquire() == 0


def test_redis_flush_then_floor_gives_a_token_above_every_token_seen(client):
    seen = []
    for owner in ("a", "b", "c", "d"):  # four leaders in turn: tokens 1..4
        lease = Lease(client, owner, ttl_s=60)
        seen.append(lease.try_acquire())
        lease.release()
    assert seen == [1, 2, 3, 4]
    client.flushdb()  # Redis restarted without persistence: counter and lease gone
    assert Lease(client, "naive", ttl_s=60).try_acquire() == 1  # what happened before floors: agents refuse 1
    client.flushdb()
    floor = max(seen)  # the highest token the new leader read from the log
    new = Lease(client, "e", ttl_s=60)
    token = new.try_acquire(floor=floor)
    assert token == 5 and token > max(seen)
    assert int(client.get(token_key())) == 5  # the counter is restored for the next leader
    new.release()
    assert Lease(client, "f", ttl_s=60).try_acquire() == 6  # no floor needed any more


def test_a_leader_whose_redis_was_flushed_never_goes_back(client):
    """The leader held 4; Redis loses everything; its renewal must not come back with 1."""
    lease = Lease(client, "a", ttl_s=60, floor=3)
    assert lease.try_acquire() == 4
    client.flushdb()
    renewed = lease.try_acquire()  # lease gone: a new token, above the one it held
    assert renewed == 5


def test_own_lease_with_a_token_below_the_floor_is_not_renewed(client):
    lease = Lease(client, "a", ttl_s=60)
    assert lease.try_acquire() == 1
    assert lease.try_acquire(floor=7) == 8  # the log shows 7 was used: 1 is stale even for us


def test_lua_matches_next_token(client):
    for counter, floor in [(0, 0), (7, 4), (0, 4), (2, 9), (TOKEN_MAX - 1, 0)]:
        client.flushdb()
        if counter:
            client.set(token_key(), counter)
        lease = Lease(client, "a", ttl_s=60)
        assert lease.try_acquire(floor=floor) == next_token(counter, floor)


@pytest.mark.parametrize(
    "counter,floor,reason",
    [
        (str(2**62), 0, "the token counter in Redis is not an integer in [0, 2**53]"),
        ("not-a-number", 0, "the token counter in Redis is not an integer in [0, 2**53]"),
        (str(TOKEN_MAX), 0, "the next fencing token would exceed 2**53"),
        (None, TOKEN_MAX, "the next fencing token would exceed 2**53"),
    ],
    ids=["counter 2**62", "counter not a number", "counter at the top", "floor at the top"],
)
def test_out_of_range_tokens_are_refused(client, counter, floor, reason):
    if counter is not None:
        client.set(token_key(), counter)
    lease = Lease(client, "a", ttl_s=60)
    assert lease.try_acquire(floor=floor) == 0
    assert lease.reason.startswith(reason) and not lease.is_leader
    assert client.get(token_key()) == (counter.encode() if counter is not None else None)  # nothing changed


def test_unreachable_redis_is_not_leader():
    import socket

    import redis

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    lease = Lease(r, "a", ttl_s=3)
    assert lease.try_acquire(floor=4) == 0
    assert lease.reason.startswith("Redis unavailable: ConnectionError")


def test_renew_extends_only_our_own_lease_and_never_draws_a_token(client):
    from services.dispatcher.lease import lease_key

    lease = Lease(client, "a", ttl_s=60)
    assert lease.renew() is False  # not leading
    assert lease.try_acquire() == 1
    client.pexpire(lease_key(), 500)
    assert lease.renew() is True and client.pttl(lease_key()) > 50_000
    client.flushdb()  # Redis restarted: the lease is gone
    assert lease.renew() is False
    assert lease.token == 0 and lease.reason == "lease with token 1 expired or taken over"
    assert client.get(token_key()) is None  # renew drew nothing


def test_held_by_another_tells_a_standby_whether_a_take_over_is_possible(client):
    a, b = Lease(client, "dispatcher-a", ttl_s=60), Lease(client, "dispatcher:b", ttl_s=60)
    assert not b.held_by_another()  # nobody leads
    assert a.try_acquire() == 1
    assert b.held_by_another() and not a.held_by_another()  # ours is not another's
    a.release()
    assert not b.held_by_another()
    assert b.try_acquire() == 2 and not b.held_by_another()  # an owner id with ':' in it is parsed whole
