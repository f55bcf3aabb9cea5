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


class LeaseKeeper:
    """Renews a held lease from its own thread, as long as the event loop shows signs of life.

    Why a thread: the leader loop runs the fold and the scheduling cycle
    synchronously on the event loop. On a busy 2-core machine one such step
    (a rebuild from the log, a read-model write of thousands of jobs) can take
    longer than the lease TTL; renewed only between steps, the lease then
    expired under a leader that was working, the next renewal drew a new
    token, and the leader dropped everything and rebuilt from offset 0
    (seen in bench_live runs: one or two lease losses in the middle of the
    sustained phase).

    Liveness is kept: the thread renews only while :meth:`beat` was called
    within ``stall_s`` (the dispatcher beats from an asyncio task, so a hung
    event loop stops the beats and the lease runs out). Safety does not
    change: every decision still carries the token, and agents refuse older
    ones.

    Args:
        lease: a lease this process holds (``lease.token`` > 0).
        every_s: renewal period, wall seconds (a third of the TTL).
        stall_s: no beat for this long -> stop renewing.

    Attributes:
        lost: set once a renewal returned another token (or failed): stop deciding.
    """

    def __init__(self, lease: Lease, every_s: float, stall_s: float) -> None:
        import threading
        import time

        self.lease = lease
        self.token = lease.token
        self.every_s = every_s
        self.stall_s = stall_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._monotonic = time.monotonic
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def beat(self) -> None:
        """The event loop is alive (called from it every ``every_s`` or so)."""
        self._beat = self._monotonic()

    def start(self) -> LeaseKeeper:
        """Start renewing; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing (the lease itself is released by its owner)."""
        self._stop.set()
        self._thread.join(timeout=10)

    def renew_once(self) -> bool:
        """One renewal round (the thread calls it every ``every_s``); False once the lease is lost.

        No beat within ``stall_s``: skip the renewal (the lease runs out, a
        standby takes over). Renewal answered with another token, or failed
        (Redis unreachable: we cannot know we still lead): set :attr:`lost`.
        """
        import logging

        if self._monotonic() - self._beat > self.stall_s:
            return True
        try:
            token = self.lease.try_acquire()
        except Exception as exc:
            logging.getLogger("apportion.dispatcher").error("lease renewal failed: %s", exc)
            token = 0
        if token != self.token:
            self.lost.set()
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every_s) and self.renew_once():
            pass
