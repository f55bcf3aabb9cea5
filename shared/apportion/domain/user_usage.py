"""Per-user occupancy: the GPU-time each user's runs held under each leaf budget over the trailing window.

One fold, :class:`UserUsageFold`, serves every reader of per-user usage:
``apportion usage --by-user`` and ``share --users`` (:func:`usage_by_user` of the
log) and the accounting service, which folds it as it folds the log and exports
it as ``apportion_user_occupancy_gpu_seconds`` (:func:`apportion.metrics.user_samples`).

It is the occupancy fold of the budgets (:class:`~apportion.domain.occupancy.OccupancyLedger`,
so every run ends where every reader ends it: completions, preemptions, losses
charged to the last heartbeat, refused starts) with each run's series keyed by
its budget and its user (``JobPlaced.user``, else the job's ``JobSubmitted`` or
``JobQueued``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from apportion.domain.occupancy import OccupancyLedger
from apportion.domain.occupancy import rebuild as rebuild_ledger
from apportion.events import Event, JobCancelled, JobPlaced, JobQueued, JobRejected, JobSubmitted
from apportion.timeutil import Micros

__all__ = ["UserUsage", "UserUsageFold", "usage_by_user"]

#: Marks a user's part of a budget in the fold's ledger; budget segments never hold it
#: (``domain.budgets.validate_path``).
_USER_MARK = "/@"


@dataclass(frozen=True)
class UserUsage:
    """GPU-hours a user's runs held under one leaf budget over a window (``apportion usage --by-user``).

    Attributes:
        budget: the leaf; ``user``: the submitting user (``""``: the budget's total row).
        allocated_gpu_h: held by allocated runs (charged: the user's part of the budget's O_b).
        unallocated_gpu_h: held by unallocated runs (the user's part of U_b; never charged).
        share_of_budget: ``allocated_gpu_h`` over the budget's allocated GPU-hours (0 when it has none).
    """

    budget: str
    user: str
    allocated_gpu_h: float
    unallocated_gpu_h: float
    share_of_budget: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "user": self.user,
            "allocated_gpu_h": self.allocated_gpu_h,
            "unallocated_gpu_h": self.unallocated_gpu_h,
            "share_of_budget": self.share_of_budget,
        }


class UserUsageFold:
    """Per leaf budget and user, allocated and unallocated occupancy over the trailing window W.

    Fold events with :meth:`apply` (or build from a log with :meth:`rebuild`); read with :meth:`parts`
    (exact GPU-µs) or :meth:`rows` (GPU-hours, as ``usage --by-user`` shows them). Memory: one ledger
    series per (budget, user) pair ever charged, bounded by the window like the budgets' (rule D2.occupancy),
    and the user of each job queued but not yet placed with its user named (``JobPlaced.user``).

    Args:
        window_s: window length W in seconds, > 0.
    """

    __slots__ = ("ledger", "_user_of")

    def __init__(self, window_s: float) -> None:
        self.ledger = OccupancyLedger(window_s)
        self._user_of: dict[str, str] = {}

    def _keyed(self, ev: Event) -> Event:
        """``ev`` as the ledger folds it: a placement charged to ``<budget>/@<user>``; notes the job's user."""
        if isinstance(ev, (JobSubmitted, JobQueued)):
            self._user_of.setdefault(ev.job_id, ev.user)
        elif isinstance(ev, JobPlaced):
            # a placement naming its user makes the queued one useless (the dispatcher names it on every one)
            queued = self._user_of.pop(ev.job_id, "") if ev.user else self._user_of.get(ev.job_id, "")
            return ev.model_copy(update={"budget": f"{ev.budget}{_USER_MARK}{ev.user or queued}"})
        elif (isinstance(ev, JobRejected) and ev.request == "JobSubmitted") or (
            isinstance(ev, JobCancelled) and ev.attempt is None
        ):
            self._user_of.pop(ev.job_id, None)  # refused, or cancelled while pending: no placement to come
        return ev

    def apply(self, ev: Event) -> None:
        """Fold one event (types the ledger and the user map do not read are ignored)."""
        self.ledger.apply(self._keyed(ev))

    @classmethod
    def rebuild(cls, evts: Iterable[Event], window_s: float) -> UserUsageFold:
        """Bulk-build from events in log order (the ledger's :func:`~apportion.domain.occupancy.rebuild`); the
        result equals folding them one by one and accepts further :meth:`apply`."""
        fold = cls(window_s)
        fold.ledger = rebuild_ledger((fold._keyed(ev) for ev in evts), window_s)
        return fold

    def parts(self, at_us: Micros | None = None) -> dict[str, dict[str, tuple[int, int]]]:
        """Leaf budget -> user -> (allocated, unallocated) GPU-µs over the window at ``at_us`` (default: the
        clock; a time before the clock is answered as of the clock), sorted by budget and user. Every pair ever
        charged is listed, with 0 once its runs left the window."""
        clock = self.ledger.clock
        if clock is None:
            return {}
        at = max(at_us if at_us is not None else clock, clock)
        occ, una = self.ledger.occupancy_us(at), self.ledger.unallocated_us(at)
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for key in sorted(set(occ) | set(una)):
            budget, mark, who = key.partition(_USER_MARK)
            if mark and _USER_MARK not in budget:
                out.setdefault(budget, {})[who] = (occ.get(key, 0), una.get(key, 0))
        return out

    def rows(self, at_us: Micros | None = None) -> list[UserUsage]:
        """Rows of ``usage --by-user``: per budget, first its total (``user=""``), then its users by allocated
        GPU-hours, most first (then unallocated, then name)."""
        rows: list[UserUsage] = []
        parts = self.parts(at_us)
        for budget in parts:
            users = parts[budget]
            alloc = sum(a for a, _ in users.values())
            unalloc = sum(u for _, u in users.values())
            rows.append(UserUsage(budget, "", alloc / 3.6e9, unalloc / 3.6e9, 1.0 if alloc else 0.0))
            for who, (a, u) in sorted(users.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0])):
                rows.append(UserUsage(budget, who, a / 3.6e9, u / 3.6e9, a / alloc if alloc else 0.0))
        return rows


def usage_by_user(evts: Iterable[Event], window_s: float, at_us: int | None = None) -> list[UserUsage]:
    """Per leaf budget and user, the GPU-hours their runs held over the trailing window at ``at_us`` (default:
    the log's last event), like Slurm's ``sshare -a``: :meth:`UserUsageFold.rows` of the log folded event by
    event. An ``at_us`` before the log's last event is answered as of that event."""
    fold = UserUsageFold(window_s)
    for ev in evts:
        fold.apply(ev)
    return fold.rows(at_us)
