"""Leadership for the dispatcher: a Redis lease with a durable, monotonic fencing token.

One dispatcher is active; standbys wait. The lease is a Redis key holding
``<owner>:<token>`` with a time-to-live. Acquiring a free (or expired) lease
hands out a strictly larger **fencing token**; every decision and command the
leader writes carries it. Readers (node agents, the dispatcher's own fold)
ignore writes with a token lower than the highest they have seen, so a paused
ex-leader that wakes up after its lease expired cannot place a job twice
(Kleppmann's fencing, "How to do distributed locking", 2016). The rules are
in ``docs/leadership.md``.

Durability. The token counter lives in Redis, which may run without
persistence: after a restart (or a ``FLUSHDB``) the counter is gone, and a
new leader drawing token 1 would be refused by every agent that saw 4. So
acquisition takes a **floor**, the highest token the caller knows was used
(the largest ``fencing_token`` in the log's tail, :func:`highest_token_in_log`,
or read during its rebuild; in both, only of records the dispatcher's
registered key signed), and the new token is
:func:`next_token` ``(counter, floor)`` = ``max(counter, floor) + 1``. The log
is kept for ever, so the floor survives anything Redis loses. A :class:`Lease`
also remembers the highest token it held or was told of (:meth:`Lease.observe`):
the same process never goes backwards.

Range. Tokens are integers in ``[1, 2**53]`` (:data:`TOKEN_MIN`,
:data:`TOKEN_MAX`; 2**53 is the largest integer JSON readers, Lua and
JavaScript hold exactly). A token outside it is refused, whoever offers it:
:func:`next_token` raises, the Lua script returns no lease, agents refuse the
command. A corrupt counter (``2**62`` written by hand) therefore cannot lock
every later leader out silently: acquisition fails with a logged reason.

Outages. Redis unreachable, timing out, loading, or answering an error:
:meth:`Lease.try_acquire` returns 0 ("not leader") and logs the reason once
per change; nothing escapes to kill the dispatcher.

Both scripts are single Lua calls, so they are atomic in Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from apportion.settings import topic_name

log = logging.getLogger("apportion.dispatcher.lease")

#: Smallest valid fencing token.
TOKEN_MIN = 1
#: Largest valid fencing token (2**53: exact in JSON readers, Lua and JavaScript numbers).
TOKEN_MAX = 2**53


class LeadershipLost(RuntimeError):
    """The lease was lost; this instance must stop deciding."""


class TokenRangeError(ValueError):
    """A token, counter or floor outside the valid range; ``str(exc)`` says which."""


def valid_token(token: object) -> TypeGuard[int]:
    """True for an ``int`` (not ``bool``) in ``[TOKEN_MIN, TOKEN_MAX]``."""
    return isinstance(token, int) and not isinstance(token, bool) and TOKEN_MIN <= token <= TOKEN_MAX


def next_token(counter: int, floor: int = 0) -> int:
    """The token a new leader gets: one more than both the counter and the floor.

    Args:
        counter: the last token Redis handed out (0 when the counter is
            missing, e.g. after a restart without persistence).
        floor: the highest token the caller knows was used (0: none known).

    Returns:
        ``max(counter, floor) + 1``.

    Raises:
        TokenRangeError: ``counter`` or ``floor`` is negative or above
            :data:`TOKEN_MAX`, or the result would exceed :data:`TOKEN_MAX`.

    Examples (named edge cases, tested in ``tests/unit/test_lease.py``):
        fresh Redis, no floor: ``next_token(0, 0) == 1``; Redis flushed after
        token 4: ``next_token(0, 4) == 5``; floor behind the counter:
        ``next_token(7, 4) == 8``; at the top: ``next_token(2**53, 0)`` raises.
    """
    for name, v in (("counter", counter), ("floor", floor)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= TOKEN_MAX:
            raise TokenRangeError(f"{name} {v!r} outside [0, 2**53]")
    token = max(counter, floor) + 1
    if token > TOKEN_MAX:
        raise TokenRangeError(f"next token {token} above 2**53: the counter or floor is exhausted")
    return token


def lease_key() -> str:
    """Redis key of the lease (namespaced by ``APPORTION_TOPIC_PREFIX``)."""
    from apportion.settings import topic_prefix

    return f"{topic_prefix()}apportion:dispatcher:lease"


def token_key() -> str:
    """Redis key of the fencing-token counter (tokens only grow; a floor covers its loss)."""
    from apportion.settings import topic_prefix

    return f"{topic_prefix()}apportion:dispatcher:token"


# KEYS[1] lease, KEYS[2] token counter; ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] floor, ARGV[4] max token.
# Returns the token when this owner holds the lease after the call; 0 when another owner holds it;
# -1 when the counter is not a number in range; -2 when the next token would exceed the maximum.
# Same rule as next_token(): a new token is max(counter, floor) + 1. Our own lease is renewed only
# while its token is at least the floor (else a larger token is drawn).
_ACQUIRE = """
local floor = tonumber(ARGV[3])
local top = tonumber(ARGV[4])
local cur = redis.call('GET', KEYS[1])
if cur then
  local owner, token = string.match(cur, '^(.*):(%d+)$')
  if owner ~= ARGV[1] then
    return 0
  end
  token = tonumber(token)
  if token and token >= floor and token <= top then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return token
  end
end
local raw = redis.call('GET', KEYS[2])
local counter = 0
if raw then
  counter = tonumber(raw)
  if not counter or counter < 0 or counter > top or counter ~= math.floor(counter) then
    return -1
  end
end
local last = math.max(counter, floor)
if last >= top then  -- compared before adding: top + 1 is not exact in a Lua number
  return -2
end
local token = last + 1
redis.call('SET', KEYS[2], string.format('%d', token))
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. string.format('%d', token), 'PX', ARGV[2])
return token
"""

# KEYS[1] lease; ARGV[1] owner, ARGV[2] token, ARGV[3] ttl ms. Extends only our own lease with this token.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] .. ':' .. ARGV[2] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 0
"""

# KEYS[1] lease; ARGV[1] owner, ARGV[2] token. Deletes only our own lease.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] .. ':' .. ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_SCRIPT_ERRORS = {
    -1: "the token counter in Redis is not an integer in [0, 2**53]: fix or delete it (a floor keeps tokens growing)",
    -2: "the next fencing token would exceed 2**53",
}


@dataclass
class Lease:
    """A dispatcher's claim on leadership.

    Args:
        redis: a ``redis.Redis`` client.
        owner: unique id of this dispatcher instance (the token is parsed from
            the end of the stored value, so ``:`` in it is harmless).
        ttl_s: lease time-to-live in wall seconds; renew well within it.
        floor: highest token known to have been used before this process
            started (raised by :meth:`observe` and by every token held).

    Attributes:
        token: the fencing token while leader, else 0.
        reason: why the last :meth:`try_acquire` did not lead (``""`` when it did).
    """

    redis: Any
    owner: str
    ttl_s: float = 5.0
    token: int = 0
    floor: int = 0
    reason: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= TOKEN_MAX:
            raise TokenRangeError(f"floor {self.floor!r} outside [0, 2**53]")
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._release = self.redis.register_script(_RELEASE)
        self._renew = self.redis.register_script(_RENEW)
        self._logged = ""
        self._held_since: float | None = None

    def expires_in(self) -> float:
        """Wall seconds the lease is still certainly ours (<= 0: it may have expired; not leader: 0).

        Local and cheap (no Redis round trip): counted from the moment the last
        successful acquisition or renewal was *sent*, on the monotonic clock,
        which keeps counting while the process is stopped (SIGSTOP). A leader
        checks it before it publishes each batch: a leader that was paused past
        its TTL sees <= 0 and must not publish (it steps down and re-acquires).
        """
        if not self.token or self._held_since is None:
            return 0.0
        return self.ttl_s - (time.monotonic() - self._held_since)

    def observe(self, token: int | None) -> None:
        """Raise the floor to ``token`` (one seen in the log); out-of-range values are ignored."""
        if valid_token(token) and token > self.floor:
            self.floor = token

    def try_acquire(self, floor: int | None = None) -> int:
        """Acquire or renew; the fencing token, or 0 when not leader (another leads, or Redis failed).

        Args:
            floor: highest token the caller knows was used (e.g. the largest
                ``fencing_token`` in the log); combined with :attr:`floor`.
                A new token is larger than both and than the Redis counter.

        Never raises for Redis trouble or a bad counter: the token is 0 and
        :attr:`reason` (logged once per change) says why.
        """
        self.observe(floor)
        asked = time.monotonic()  # before the request: the lease runs from no later than this
        try:
            got = int(
                self._acquire(
                    keys=[lease_key(), token_key()],
                    args=[self.owner, max(1, int(self.ttl_s * 1000)), self.floor, TOKEN_MAX],
                )
            )
        except Exception as exc:  # noqa: BLE001 - redis.RedisError, OSError: any failure means we cannot know we lead
            return self._not_leader(f"Redis unavailable: {type(exc).__name__}: {exc}")
        if got == 0:
            return self._not_leader("another instance holds the lease")
        if got < 0 or not valid_token(got):
            return self._not_leader(_SCRIPT_ERRORS.get(got, f"token {got} outside [1, 2**53]"))
        self.token = got
        self.floor = max(self.floor, got)
        self.reason = ""
        self._held_since = asked
        if self._logged:
            log.info("lease acquired again (token %d) after: %s", got, self._logged)
            self._logged = ""
        return got

    def renew(self) -> bool:
        """Extend the lease we hold, never drawing a new token; False ("not leader") when it is gone or Redis failed.

        Unlike :meth:`try_acquire`, a lease that expired is not taken again
        here: the caller must stop deciding, then acquire (and rebuild) anew.
        """
        if not self.token:
            return False
        asked = time.monotonic()
        try:
            ok = int(self._renew(keys=[lease_key()], args=[self.owner, self.token, max(1, int(self.ttl_s * 1000))]))
        except Exception as exc:  # noqa: BLE001 - redis.RedisError, OSError: we cannot know we still lead
            self._not_leader(f"Redis unavailable: {type(exc).__name__}: {exc}")
            return False
        if not ok:
            self._not_leader(f"lease with token {self.token} expired or taken over")
            return False
        self._held_since = asked
        return True

    def _not_leader(self, reason: str) -> int:
        self.token = 0
        self._held_since = None
        self.reason = reason
        if reason != self._logged:
            level = logging.INFO if reason == "another instance holds the lease" else logging.WARNING
            log.log(level, "not leader: %s", reason)
            self._logged = reason
        return 0

    def release(self) -> None:
        """Give the lease up (on clean shutdown) so a standby takes over at once; Redis errors are logged."""
        if self.token:
            try:
                self._release(keys=[lease_key()], args=[self.owner, self.token])
            except Exception as exc:  # noqa: BLE001 - the lease then simply runs out
                log.warning("could not release the lease (it expires in %.1fs): %s", self.ttl_s, exc)
            self.token = 0

    def held_by_another(self) -> bool:
        """True when another owner's lease is in force now (one Redis GET; False when Redis fails, so the
        caller goes on to :meth:`try_acquire`, which reports the failure). A standby asks this before it pays
        for the floor of a take-over (reading the log's newest token)."""
        try:
            cur = self.redis.get(lease_key())
        except Exception:  # noqa: BLE001 - redis.RedisError, OSError: try_acquire says why
            return False
        if cur is None:
            return False
        owner = (cur.decode() if isinstance(cur, bytes) else str(cur)).rsplit(":", 1)[0]
        return owner != self.owner

    @property
    def is_leader(self) -> bool:
        """True after a successful :meth:`try_acquire` (until it fails or is released)."""
        return self.token > 0


def highest_token(events: Iterable[Any]) -> int:
    """The largest valid ``fencing_token`` among ``events`` (0 when none carries one)."""
    best = 0
    for e in events:
        t = getattr(e, "fencing_token", None)
        if valid_token(t) and t > best:
            best = t
    return best


def highest_token_in_log(
    bootstrap: str,
    topics: Iterable[str],
    per_partition: int = 256,
    timeout_s: float = 10.0,
    keys_topic: str | None = None,
) -> int:
    """The largest valid fencing token in the last ``per_partition`` records of each partition of ``topics``.

    The floor for :meth:`Lease.try_acquire` when the dispatcher has not read
    the log yet (a standby about to take over): every leader's first writes
    (its ``DispatcherConfigured``, commands, placements) carry its token, so
    the tail of ``apportion.commands`` and ``apportion.jobs`` holds the newest
    one. Only a record the dispatcher's key signed counts (rule D10.authentication,
    :func:`apportion.domain.admission.authorize_report`): a forged decision
    carrying a huge token must not raise the floor (it would depose every
    later leader). The keys are those registered in ``keys_topic`` (default
    ``apportion.budgets``), read whole, each record judged at its place in the
    log (:func:`apportion.logrecord.log_position`): after a rotation of the
    dispatcher's key, the tokens its old key signed before the revocation
    still count. Records that do not decode are
    skipped. Reads with manual assignment (no consumer group, nothing
    committed).

    Raises:
        TimeoutError: ``keys_topic`` could not be read to its end within ``timeout_s`` (without the keys,
            no token is proven; the caller retries).
        whatever the Kafka client raises when the broker is unreachable (the
        caller retries; leading without a floor would risk a stale token).
    """
    from kafka import TopicPartition

    from apportion.bus.clients import kafka_consumer
    from apportion.bus.security import kafka_auth
    from apportion.events import decode
    from apportion.identity.gates import ReportGate
    from apportion.logrecord import log_position
    from apportion.topics import BUDGETS

    keys_at = keys_topic or topic_name(BUDGETS)
    c = kafka_consumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=500, **kafka_auth())
    try:
        parts = [TopicPartition(t, p) for t in topics for p in sorted(c.partitions_for_topic(t) or ())]
        if not parts:
            return 0
        key_parts = [TopicPartition(keys_at, p) for p in sorted(c.partitions_for_topic(keys_at) or ())]
        every = parts + key_parts
        c.assign(every)
        ends = c.end_offsets(every)
        begins = c.beginning_offsets(every)
        todo = {}
        for tp in every:
            start = begins[tp] if tp in key_parts else max(begins[tp], ends[tp] - per_partition)
            if start < ends[tp]:
                c.seek(tp, start)
                todo[tp] = ends[tp]
            else:
                c.pause(tp)
        gate, tail = ReportGate(), []
        deadline = time.monotonic() + timeout_s
        while todo and time.monotonic() < deadline:
            for tp, recs in c.poll(timeout_ms=200).items():
                for rec in recs:
                    try:
                        ev = decode(rec.value)
                    except Exception:  # noqa: BLE001 - a poison record holds no token
                        continue
                    if tp in key_parts:
                        gate.observe(ev, log_position(rec, ev))
                    if tp in parts:
                        tail.append((rec.value, ev, log_position(rec, ev)))
                if tp in todo and c.position(tp) >= todo[tp]:
                    del todo[tp]
                    c.pause(tp)
        if any(tp in todo for tp in key_parts):
            raise TimeoutError(f"{keys_at} not read to its end in {timeout_s:g} s: no fencing token is proven")
        best = 0
        for raw, ev, place in tail:  # a signature is checked only for a token above the best so far
            t = getattr(ev, "fencing_token", None)
            if valid_token(t) and t > best and gate.report_refusal(raw, ev, place) is None:
                best = t
        return best
    finally:
        c.close()


async def stand_by(lease: Lease, bootstrap: str, readiness: Any, stop: Any, wait_s: float) -> int | None:
    """Wait until this instance holds the lease: its fencing token, or ``None`` once ``stop`` is set.

    Each try: unless another owner holds an unexpired lease, read the floor (:func:`highest_token_in_log`
    of ``apportion.commands``, ``apportion.jobs`` and ``apportion.nodes``, the dispatcher's signed records
    only: a Redis that lost its counter cannot go back, a forged token cannot push it up) and :meth:`Lease.try_acquire` with it. Kafka unreachable: never lead without a floor
    (logged, the try counts as lost). A lost try marks ``readiness`` ready when the floor was read (standing
    by, both dependencies answered) and waits ``wait_s`` wall seconds (a third of the TTL).

    Args:
        lease: this instance's lease.
        bootstrap: Kafka ``host:port``.
        readiness: :class:`apportion.bus.resilience.Readiness` of the instance.
        stop: ``asyncio.Event``; set to give up.
        wait_s: wall seconds between tries.
    """
    import asyncio

    from apportion.bus.resilience import pause
    from apportion.topics import COMMANDS, JOBS, NODES

    while not stop.is_set():
        floor: int | None = None
        if not await asyncio.to_thread(lease.held_by_another):  # a take-over is possible: pay for the floor
            try:
                logs = list(map(topic_name, (COMMANDS, JOBS, NODES)))
                floor = await asyncio.to_thread(highest_token_in_log, bootstrap, logs)
            except Exception as exc:  # noqa: BLE001 - Kafka unreachable: never lead without a floor
                log.warning("cannot read the newest fencing token from the log (%s): standing by", exc)
        token = await asyncio.to_thread(lease.try_acquire, floor) if floor is not None else 0
        if token:
            return token
        if floor is not None:
            readiness.set(True)
        if await pause(stop, wait_s):
            return None
    return None


async def lead_when_elected(
    lease: Lease,
    bootstrap: str,
    readiness: Any,
    stop: Any,
    leader_gauge: Any,
    term: Callable[[], Awaitable[None]],
) -> None:
    """Until ``stop``: :func:`stand_by` (a try every third of the TTL), then lead one ``term()``; a term
    ended by :class:`LeadershipLost` goes back to standby.

    While a term runs, ``leader_gauge`` is 1 (else 0) and ``readiness`` says "rebuilding as the leader"
    until the term marks itself ready. What the term raises otherwise propagates (the caller's supervisor
    starts the standby loop again after a backoff).
    """
    while token := await stand_by(lease, bootstrap, readiness, stop, lease.ttl_s / 3):
        log.info("leading with fencing token %d", token)
        leader_gauge.set(1)
        readiness.set(False, "rebuilding as the leader")
        try:
            await term()
        except LeadershipLost:
            log.error("lease lost: stopping decisions, back to standby")
        finally:
            leader_gauge.set(0)


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

    @classmethod
    def for_ttl(cls, lease: Lease, ttl_s: float) -> LeaseKeeper:
        """The dispatcher's keeper: renew every third of the TTL, stop renewing after ``max(30 s, 10 TTL)``
        without a beat (a hung event loop)."""
        return cls(lease, ttl_s / 3, stall_s=max(30.0, 10 * ttl_s))

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

    def holds(self) -> bool:
        """Still leading: no renewal lost, and the local lease clock (it counts through a SIGSTOP) has more
        than a renewal period (``every_s``) left."""
        return not self.lost.is_set() and self.lease.expires_in() > self.every_s

    async def beats(self) -> None:
        """The event loop's sign of life: :meth:`beat` every ``every_s`` until cancelled (run it as a task)."""
        import asyncio

        while True:
            self.beat()
            await asyncio.sleep(self.every_s)

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
        except Exception as exc:  # noqa: BLE001 - a renewal that fails is a lost lease, never a dead keeper
            logging.getLogger("apportion.dispatcher").error("lease renewal failed: %s", exc)
            token = 0
        if token != self.token:
            self.lost.set()
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every_s) and self.renew_once():
            pass
