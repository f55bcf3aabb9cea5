"""The Redis fixture against a real redis-server: plain commands and Lua."""

from __future__ import annotations

import uuid

import pytest

from apportion.bus.security import redis_auth

pytestmark = pytest.mark.integration

# The shape the dispatcher lease needs: take or renew a lease atomically and
# hand out a fencing token that only ever grows.
ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    if holder == false then
        return redis.call('INCR', KEYS[2])
    end
    return tonumber(redis.call('GET', KEYS[2]))
end
return -1
"""


@pytest.fixture
def client(redis_url: str):
    import redis

    r = redis.Redis.from_url(redis_url, decode_responses=True, **redis_auth())
    yield r
    r.close()


def test_set_and_get(client) -> None:
    key = f"test:{uuid.uuid4().hex}"
    assert client.set(key, "value", px=60_000)
    assert client.get(key) == "value"
    assert 0 < client.pttl(key) <= 60_000


def test_lua_lease_gives_growing_fencing_tokens(client) -> None:
    lease, token = f"test:lease:{uuid.uuid4().hex}", f"test:token:{uuid.uuid4().hex}"
    acquire = client.register_script(ACQUIRE)
    first = acquire(keys=[lease, token], args=["dispatcher-a", 60_000])
    assert first == 1
    assert acquire(keys=[lease, token], args=["dispatcher-b", 60_000]) == -1  # held by a
    assert acquire(keys=[lease, token], args=["dispatcher-a", 60_000]) == 1  # renewal keeps token
    client.delete(lease)  # a's lease lapses
    assert acquire(keys=[lease, token], args=["dispatcher-b", 60_000]) == 2  # b fences a out
    assert client.eval("return redis.call('GET', KEYS[1])", 1, lease) == "dispatcher-b"
