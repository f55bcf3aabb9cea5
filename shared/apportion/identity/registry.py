"""The key registry (D10.proven-user): which key proves which principal when, a fold of the key events (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from apportion import events
from apportion.domain.admission import RUN_REPORT_TYPES, Principal
from apportion.timeutil import Micros, to_us

__all__ = ["PLACEMENTS_KEPT", "KeyRegistry"]


#: Runs whose placement a :class:`KeyRegistry` remembers (about 150 bytes each).
PLACEMENTS_KEPT = 1_000_000


@dataclass(slots=True)
class _Grant:
    user: str
    role: str
    from_us: Micros


@dataclass(frozen=True, slots=True)
class _Revocation:
    ts_us: Micros
    position: int | None  # where it is in the log (its record's broker timestamp, ms: log_position); None: unknown


class KeyRegistry:
    """Which key proves which principal when: a fold of ``UserKeyRegistered``/``UserKeyRevoked`` (pure).

    A key proves ``user`` for a signed event of event time t when a
    registration of (user, key) with ``ts <= t`` has been folded (wherever it
    is in the log: registrations precede use, and only ops write them) and no
    revocation of (user, key) made at or after that registration is *earlier
    in the log* than the signed record, whatever the event's ``ts`` says (a
    signer chooses its ``ts``: a stolen key must not sign a backdated event).
    "Earlier in the log" (:meth:`principal`, the one rule of the reader edge
    and the audit) is:

    * both places known (:func:`log_position`: the broker's append time, ms):
      the revocation's is strictly before the signed record's. A record of the
      same millisecond as the revocation stands: the broker's clock does not
      order them, a live reader that read the record first took it, and so
      must a rebuild that reads both in one batch (the cost: a stolen key
      signs for at most one millisecond after its revocation is appended);
    * the signed record's place unknown (``position=None``: a producer's
      ``CreateTime``, or a caller without a record): every revocation folded
      so far counts (it was read before the record is checked);
    * the revocation's place unknown (folded without a record, or restored from
      a snapshot of a reader older than the places): it counts for every record
      checked after it was folded, as in the second case.

    A revocation with ``ts <= t`` revokes too (the signer claims a time after
    it). So a rebuild that reads revocations later in the log than a record
    in the same batch judges the record as the live reader did, and a key's
    rotation voids nothing it signed before.
    Folding an event twice changes nothing (a revocation folded again keeps
    the earliest place it was folded with).

    It also remembers which nodes hold which run (:meth:`place`, fed by the
    reader edge with every ``JobPlaced`` it authenticated), so that a node's
    key proves reports of its own runs only (:meth:`placement`). The oldest
    of more than :data:`PLACEMENTS_KEPT` runs are forgotten (a report of a
    forgotten run is then checked against its node's key only).
    """

    def __init__(self) -> None:
        self._grants: dict[str, list[_Grant]] = {}
        self._revoked: dict[tuple[str, str], list[_Revocation]] = {}
        self._placed: dict[tuple[str, int], tuple[str, ...]] = {}
        self._users: set[str] = set()

    def knows(self, user: str) -> bool:
        """Has a key ever been registered for ``user`` (e.g. ``service:dispatcher``)?"""
        return user in self._users

    def place(self, ev: events.JobPlaced) -> None:
        """Remember the nodes of run (``job_id``, ``attempt``), in replica order (first placement wins)."""
        placed = self._placed
        key = (ev.job_id, ev.attempt)
        if key not in placed:
            placed[key] = tuple(p.node_id for p in ev.placements)
            if len(placed) > PLACEMENTS_KEPT:
                del placed[next(iter(placed))]

    def placement(self, ev: events.Event) -> tuple[str, ...] | None:
        """The nodes of the run a report names (replica order), or ``None`` (not a run report, or no placement known)."""
        if not isinstance(ev, RUN_REPORT_TYPES):
            return None
        return self._placed.get((ev.job_id, ev.attempt))

    def apply(self, ev: events.Event, position: int | None = None) -> bool:
        """Fold one event; True when it is an identity event.

        Args:
            ev: any event (others are ignored).
            position: the record's place in the log (:func:`log_position`); ``None``: unknown.
        """
        if not isinstance(ev, (events.UserKeyRegistered, events.UserKeyRevoked)):
            return False
        if isinstance(ev, events.UserKeyRegistered):
            self._grants.setdefault(ev.public_key, []).append(_Grant(ev.user, ev.role, to_us(ev.ts)))
            self._users.add(ev.user)
        else:
            revs = self._revoked.setdefault((ev.public_key, ev.user), [])
            new = _Revocation(to_us(ev.ts), position)
            for i, r in enumerate(revs):
                if r.ts_us == new.ts_us:  # the same revocation folded again: keep the earliest known place
                    if r.position is None or (position is not None and position < r.position):
                        revs[i] = new
                    break
            else:
                revs.append(new)
        return True

    def __len__(self) -> int:
        return sum(len(g) for g in self._grants.values())

    def principal(self, public_key: str | None, at_us: Micros, position: int | None = None) -> Principal | None:
        """The principal ``public_key`` proves for a signed event, or ``None`` (unknown, not yet, revoked).

        Args:
            public_key: the base64 key that signed (:func:`signer_of`), or ``None``.
            at_us: the signed event's event time (µs).
            position: the signed record's place in the log (:func:`log_position`);
                ``None``: unknown, every revocation folded so far is earlier.

        When one key was registered for several principals, the latest
        registration in force wins.
        """
        if public_key is None:
            return None
        best: _Grant | None = None
        for g in self._grants.get(public_key, ()):
            if g.from_us > at_us:
                continue
            if self._revoked_for(public_key, g, at_us, position):
                continue
            if best is None or g.from_us >= best.from_us:
                best = g
        return Principal(best.user, best.role) if best is not None else None

    def _revoked_for(self, key: str, g: _Grant, at_us: Micros, position: int | None) -> bool:
        for r in self._revoked.get((key, g.user), ()):
            if r.ts_us < g.from_us:
                continue  # revoked before this registration (the key was registered again)
            if r.ts_us <= at_us or position is None or r.position is None or r.position < position:
                return True
        return False
