"""Leadership for the dispatcher: a Redis lease with a fencing token.

One dispatcher is active; standbys wait. The lease is a Redis key holding
``<owner>:<token>`` with a time-to-live. Acquiring a free (or expired) lease
increments a counter and so hands out a strictly larger **fencing token**;
every decision and command the leader writes carries it. Readers (node
agents, the dispatcher's own fold) ignore writes with a token lower than
the highest they have seen, so a paused ex-leader that wakes up after its
lease expired cannot place a job twice (Kleppmann's fencing, "How to do
distributed locking", 2016).

Both operations are single Lua scripts, so they are atomic in Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

def lease_key() -> str:
    """Redis key of the lease (namespaced by ``APPORTION_TOPIC_PREFIX``)."""
    from apportion.topics import prefix

    return f"{prefix()}apportion:dispatcher:lease"


def token_key() -> str:
    """Redis key of the fencing-token counter (never reset: tokens only grow)."""
    from apportion.topics import prefix

    return f"{prefix()}apportion:dispatcher:token"

# KEYS[1] lease, KEYS[2] token counter; ARGV[1] owner, ARGV[2] ttl ms.
# Returns the token when this owner holds the lease after the call, else 0.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local owner, token = string.match(cur, '^(.*):(%d+)$')
  if owner == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(token)
  end
  return 0
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'PX', ARGV[2])
return token
"""

# KEYS[1] lease; ARGV[1] owner, ARGV[2] token. Deletes only our own lease.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] .. ':' .. ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass
class Lease:
    """A dispatcher's claim on leadership.

    Args:
        redis: a ``redis.Redis`` client.
        owner: unique id of this dispatcher instance (no ``:`` needed to be absent;
            the token is parsed from the end).
        ttl_s: lease time-to-live in wall seconds; renew well within it.

    Attributes:
        token: the fencing token while leader, else 0.
    """

    redis: Any
    owner: str
    ttl_s: float = 5.0
    token: int = 0

    def __post_init__(self) -> None:
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._release = self.redis.register_script(_RELEASE)

    def try_acquire(self) -> int:
        """Acquire or renew; returns the fencing token, or 0 when another instance leads."""
        self.token = int(self._acquire(keys=[lease_key(), token_key()], args=[self.owner, int(self.ttl_s * 1000)]))
        return self.token

    def release(self) -> None:
        """Give the lease up (on clean shutdown) so a standby takes over at once."""
        if self.token:
            self._release(keys=[lease_key()], args=[self.owner, self.token])
            self.token = 0

    @property
    def is_leader(self) -> bool:
        """True after a successful :meth:`try_acquire` (until it fails or is released)."""
        return self.token > 0
