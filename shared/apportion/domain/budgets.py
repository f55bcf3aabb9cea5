"""The budget tree: org units addressed by slash paths (rule D1.budget-tree).

A budget node ``lab/prior/robotics`` has a ``share`` in (0, 1] of its
parent's capacity; siblings' shares sum to at most 1 (the remainder is
unbudgeted). The absolute share is the product of shares on the path::

    (root "")                     abs
    └── lab          share 1.0    1.0
        ├── prior    share 0.6    0.6
        │   └── robotics 0.5      0.3
        └── vision   share 0.4    0.4

The tree is immutable: :meth:`BudgetTree.apply` folds a ``BudgetSet``,
``BudgetRemoved`` or ``BudgetBatch`` (changes applied together, validated as
a whole: :meth:`BudgetTree.with_batch`) into a new tree, raising
:class:`BudgetError` with a machine-readable reason when the change is
invalid. ``members``,
``max_min_runtime_s``, ``default_time_limit_s``, ``max_time_limit_s`` and ``preempt_idle_after_s`` are inherited
down the tree: a node that does not set them takes its nearest ancestor's (at the root: anyone, no limit, idle
runs not preempted).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from apportion.durations import format_duration
from apportion.events import MAX_SECONDS, BudgetBatch, BudgetFailure, BudgetRemoved, BudgetSet, Event

#: The events that change the tree (every fold of the budgets log folds exactly these).
BUDGET_CHANGES = (BudgetSet, BudgetRemoved, BudgetBatch)

ROOT = ""
"""The virtual root; its children are the top-level budgets. Absolute share 1."""

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

#: Slack for float sums of sibling shares (0.3 + 0.6 + 0.1 must be <= 1).
SHARE_EPSILON = 1e-9


class BudgetError(ValueError):
    """An invalid budget change.

    Attributes:
        reason: machine-readable code: ``bad_path``, ``bad_share``,
            ``no_parent``, ``over_allocated``, ``unknown_budget``,
            ``has_children``, ``in_use``, ``bad_batch`` (a batch naming a
            path twice, or nothing), ``bad_time_limit`` (a time limit that is not
            a positive duration, :func:`validate_time_limits`, or a default time limit
            in force above the max time limit in force: :func:`time_limit_conflicts`).
        message: explanation for humans.
    """

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


class BudgetBatchError(BudgetError):
    """A refused :class:`~apportion.events.BudgetBatch`: every failing path with its reason.

    ``reason`` is the first failure's; ``message`` names every failure
    (``"lab/a: over_allocated: ...; lab/b: no_parent: ..."``).

    Attributes:
        failures: one :class:`~apportion.events.BudgetFailure` per failing path (and check).
    """

    def __init__(self, failures: Iterable[BudgetFailure]) -> None:
        self.failures = tuple(failures)
        super().__init__(
            self.failures[0].reason, "; ".join(f"{f.path or '(batch)'}: {f.reason}: {f.message}" for f in self.failures)
        )


@dataclass(frozen=True, slots=True)
class Budget:
    """One budget node as set (not inherited).

    Attributes:
        path: slash path, no leading or trailing slash.
        share: fraction of the parent, in (0, 1].
        members: users allowed to charge it, or ``None`` to inherit.
        max_min_runtime_s: largest allowed minimum runtime in seconds, or ``None`` to inherit.
        default_time_limit_s: time limit of jobs that set none, seconds, or ``None`` to inherit.
        max_time_limit_s: largest time limit in force allowed, seconds, or ``None`` to inherit.
        preempt_idle_after_s: idle time after which an allocated run past its protection may be preempted
            (D3.idle-runs), seconds, or ``None`` to inherit.
    """

    path: str
    share: float
    members: frozenset[str] | None = None
    max_min_runtime_s: float | None = None
    default_time_limit_s: float | None = None
    max_time_limit_s: float | None = None
    preempt_idle_after_s: float | None = None


def validate_path(path: str) -> None:
    """Check a budget path is well formed.

    Raises:
        BudgetError: ``bad_path`` when empty, with empty segments, leading or
            trailing slashes, or characters outside ``[A-Za-z0-9_.-]``.
    """
    if not path:
        raise BudgetError("bad_path", "budget path is empty")
    for seg in path.split("/"):
        if not _SEGMENT.match(seg):
            raise BudgetError(
                "bad_path", f"bad segment {seg!r} in {path!r}: use 1-64 of [A-Za-z0-9_.-], not starting with . - or _"
            )


def validate_share(path: str, share: float) -> None:
    """Check a budget's share (a fraction of its parent) is in (0, 1]; NaN is not.

    Raises:
        BudgetError: ``bad_share``, naming ``path`` and the share.
    """
    if share != share:  # NaN compares false with everything: say what it is rather than which bound it misses
        raise BudgetError("bad_share", f"share of {path!r} is not a number (nan): give a fraction in (0, 1]")
    if not (0.0 < share <= 1.0):
        raise BudgetError("bad_share", f"share of {path!r} must be in (0, 1], got {share}")


#: A budget's own time limits, each with how a message names it.
TIME_LIMIT_FIELDS = (("default_time_limit_s", "default time limit"), ("max_time_limit_s", "max time limit"))


def validate_time_limits(b: Budget) -> None:
    """Check the time limits ``b`` sets itself: each a duration above 0 and at most ``MAX_SECONDS`` (what a
    ``BudgetSet`` carries); whether the default in force exceeds the maximum in force is a question of the tree
    (:func:`time_limit_conflicts`).

    Raises:
        BudgetError: ``bad_time_limit``, naming ``b``'s path, the limit and its value.
    """
    for field, label in TIME_LIMIT_FIELDS:
        seconds = getattr(b, field)
        if seconds is not None and not (0.0 < seconds <= MAX_SECONDS):  # NaN fails both bounds
            raise BudgetError(
                "bad_time_limit",
                f"{label} of {b.path!r} must be above 0 and at most {format_duration(MAX_SECONDS)}, got {seconds:g} s",
            )


@lru_cache(maxsize=1 << 16)
def parent_of(path: str) -> str:
    """Parent path of ``path`` (``""`` for a top-level budget); memoised (pure string work)."""
    cut = path.rfind("/")
    return path[:cut] if cut >= 0 else ROOT


@lru_cache(maxsize=1 << 16)
def ancestors_of(path: str) -> tuple[str, ...]:
    """Paths from the top-level budget down to ``path`` inclusive.

    ``ancestors_of("a/b/c") == ("a", "a/b", "a/b/c")``; pure string work, so
    it serves callers that have no tree at hand (occupancy aggregation), and
    memoised (the result is an immutable tuple).
    """
    if not path:
        return ()
    parts = path.split("/")
    return tuple("/".join(parts[: i + 1]) for i in range(len(parts)))


class BudgetTree:
    """Immutable budget tree with derived absolute shares and inheritance.

    Build with :meth:`empty`, :meth:`from_events` or :meth:`from_mapping`;
    change with :meth:`apply` (returns a new tree). Lookups are O(1) dict
    reads; derived values are precomputed at construction.
    """

    __slots__ = ("_nodes", "_children", "_abs", "_members", "_max_rt", "_limits", "_idle", "_leaves", "version")

    def __init__(self, nodes: Mapping[str, Budget] | None = None, version: int = 0) -> None:
        self._nodes: dict[str, Budget] = dict(sorted((nodes or {}).items()))
        self.version = version
        children: dict[str, list[str]] = {ROOT: []}
        for p in self._nodes:
            children.setdefault(p, [])
        for p in self._nodes:
            children[parent_of(p)].append(p)
        self._children = {k: tuple(sorted(v)) for k, v in children.items()}
        abs_share: dict[str, float] = {ROOT: 1.0}
        members: dict[str, frozenset[str] | None] = {ROOT: None}
        max_rt: dict[str, float | None] = {ROOT: None}
        limits: dict[str, tuple[float | None, float | None]] = {ROOT: (None, None)}
        idle: dict[str, float | None] = {ROOT: None}
        for p in self._nodes:  # sorted: parents come before children
            b = self._nodes[p]
            par = parent_of(p)
            abs_share[p] = abs_share[par] * b.share
            members[p] = b.members if b.members is not None else members[par]
            max_rt[p] = b.max_min_runtime_s if b.max_min_runtime_s is not None else max_rt[par]
            d, m = limits[par]
            limits[p] = (
                b.default_time_limit_s if b.default_time_limit_s is not None else d,
                b.max_time_limit_s if b.max_time_limit_s is not None else m,
            )
            idle[p] = b.preempt_idle_after_s if b.preempt_idle_after_s is not None else idle[par]
        self._abs = abs_share
        self._members = members
        self._max_rt = max_rt
        self._limits = limits
        self._idle = idle
        self._leaves = tuple(p for p in self._nodes if not self._children[p])

    # ------------------------------------------------------------------ construction

    @classmethod
    def empty(cls) -> BudgetTree:
        """A tree with no budgets."""
        return cls()

    @classmethod
    def from_events(cls, events: Iterable[Event]) -> BudgetTree:
        """Fold ``BudgetSet``/``BudgetRemoved`` events; other events are ignored.

        Raises:
            BudgetError: the first invalid change (use :meth:`apply` per event
                to skip invalid ones instead).
        """
        tree = cls.empty()
        for ev in events:
            if isinstance(ev, BUDGET_CHANGES):
                tree = tree.apply(ev)
        return tree

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any]) -> BudgetTree:
        """Build from ``{path: share}`` or ``{path: {share, members, max_min_runtime_s, default_time_limit_s,
        max_time_limit_s, preempt_idle_after_s}}``.

        Paths may come in any order; parents must be present.

        Raises:
            BudgetError: an invalid path, share or sibling sum.
        """
        tree = cls.empty()
        for path in sorted(spec, key=lambda p: (p.count("/"), p)):
            v = spec[path]
            if isinstance(v, Mapping):
                b = Budget(
                    path,
                    float(v["share"]),
                    frozenset(v["members"]) if v.get("members") is not None else None,
                    v.get("max_min_runtime_s"),
                    v.get("default_time_limit_s"),
                    v.get("max_time_limit_s"),
                    v.get("preempt_idle_after_s"),
                )
            else:
                b = Budget(path, float(v))
            tree = tree.with_budget(b)
        return tree

    # ------------------------------------------------------------------ evolve

    def apply(self, event: BudgetSet | BudgetRemoved | BudgetBatch, in_use: frozenset[str] = frozenset()) -> BudgetTree:
        """Fold one budget event into a new tree.

        Args:
            event: ``BudgetSet`` (create or update), ``BudgetRemoved`` or
                ``BudgetBatch`` (all of its changes, or none).
            in_use: budget paths that have queued or running jobs; removing
                one of them is refused.

        Raises:
            BudgetError: see :meth:`with_budget` and :meth:`without`;
                :class:`BudgetBatchError` for a batch (:meth:`with_batch`).
        """
        if isinstance(event, BudgetSet):
            return self.with_budget(budget_of(event))
        if isinstance(event, BudgetBatch):
            return self.with_batch([budget_of(s) for s in event.sets], event.removes, in_use)
        return self.without(event.path, in_use)

    def with_batch(
        self, sets: Iterable[Budget], removes: Iterable[str] = (), in_use: frozenset[str] = frozenset()
    ) -> BudgetTree:
        """New tree with every budget of ``sets`` created or replaced and every path of ``removes`` removed, or
        nothing: the checks are made on the tree *after* the whole batch, so moving share from one sibling to
        another in one batch is valid in any order of its changes.

        Checks (each failing path is named, all of them at once): a path given twice (``bad_batch``), an empty
        batch (``bad_batch``); per set: ``bad_path``, ``bad_share``, ``no_parent`` (the parent is neither in
        force nor set by the batch, or the batch removes it); per removal: ``unknown_budget``, ``in_use``,
        ``has_children`` (children left after the batch); per parent whose children the batch sets: the sum of
        its children's shares after the batch at most 1 (``over_allocated``, named on each budget of the batch
        under that parent); last, on the tree after the batch, no budget set by it or below one has a default
        time limit in force above its max time limit in force (``bad_time_limit``, :func:`time_limit_conflicts`).

        Raises:
            BudgetBatchError: the failures, in the order above; the tree is unchanged.
        """
        sets = list(sets)
        removes = list(removes)
        fails: list[BudgetFailure] = []

        def fail(path: str, reason: str, message: str) -> None:
            fails.append(BudgetFailure(path=path, reason=reason, message=message))

        if not sets and not removes:
            fail("", "bad_batch", "the batch changes nothing")
        counts = Counter([b.path for b in sets] + removes)
        for p, n in sorted(counts.items()):
            if n > 1:
                fail(p, "bad_batch", f"{p!r} is named {n} times in the batch")
        nodes = dict(self._nodes)
        for p in removes:
            if p not in nodes:
                fail(p, "unknown_budget", f"no budget {p!r}")
            elif p in in_use:
                fail(p, "in_use", f"{p!r} has queued or running jobs")
            else:
                del nodes[p]
        ok_sets: list[Budget] = []
        for b in sets:
            try:
                validate_path(b.path)
            except BudgetError as exc:
                fail(b.path, exc.reason, exc.message)
                continue
            try:
                validate_share(b.path, b.share)
                validate_time_limits(b)
            except BudgetError as exc:
                fail(b.path, exc.reason, exc.message)
                continue
            nodes[b.path] = b
            ok_sets.append(b)
        children: dict[str, list[str]] = {}
        for p in nodes:
            children.setdefault(parent_of(p), []).append(p)
        for b in ok_sets:
            par = parent_of(b.path)
            if par != ROOT and par not in nodes:
                fail(b.path, "no_parent", f"parent budget {par!r} of {b.path!r} does not exist")
        for p in removes:
            if p in self._nodes and p not in nodes and children.get(p):
                fail(p, "has_children", f"{p!r} has children {sorted(children[p])}")
        for par in sorted({parent_of(b.path) for b in ok_sets}):
            total = sum(nodes[s].share for s in children.get(par, ()))
            if total > 1.0 + SHARE_EPSILON:
                for b in ok_sets:
                    if parent_of(b.path) == par:
                        fail(b.path, "over_allocated", f"shares under {par or '(root)'!r} would sum to {total:.6g} > 1")
        if fails:
            raise BudgetBatchError(fails)
        after = BudgetTree(nodes, self.version + 1)
        for p, message in time_limit_conflicts(after, [b.path for b in ok_sets]):
            fail(p, "bad_time_limit", message)
        if fails:
            raise BudgetBatchError(fails)
        return after

    def with_budget(self, b: Budget) -> BudgetTree:
        """New tree with ``b`` created or replaced.

        Raises:
            BudgetError: ``bad_path``; ``bad_share`` (not in (0, 1]);
                ``no_parent`` (parent budget missing); ``over_allocated``
                (siblings would sum above 1); ``bad_time_limit`` (a limit of ``b``
                that is not a positive duration, or ``b`` or a budget below it would have a default time limit in force above
                its max time limit in force: :func:`time_limit_conflicts`).
        """
        validate_path(b.path)
        validate_share(b.path, b.share)
        validate_time_limits(b)
        par = parent_of(b.path)
        if par != ROOT and par not in self._nodes:
            raise BudgetError("no_parent", f"parent budget {par!r} of {b.path!r} does not exist")
        siblings = sum(self._nodes[s].share for s in self._children.get(par, ()) if s != b.path)
        if siblings + b.share > 1.0 + SHARE_EPSILON:
            raise BudgetError(
                "over_allocated", f"shares under {par or '(root)'!r} would sum to {siblings + b.share:.6g} > 1"
            )
        nodes = dict(self._nodes)
        nodes[b.path] = b
        after = BudgetTree(nodes, self.version + 1)
        for _, message in time_limit_conflicts(after, [b.path]):
            raise BudgetError("bad_time_limit", message)
        return after

    def without(self, path: str, in_use: frozenset[str] = frozenset()) -> BudgetTree:
        """New tree without ``path``.

        Raises:
            BudgetError: ``unknown_budget``; ``has_children`` (remove them
                first); ``in_use`` (queued or running jobs charge it).
        """
        if path not in self._nodes:
            raise BudgetError("unknown_budget", f"no budget {path!r}")
        if self._children[path]:
            raise BudgetError("has_children", f"{path!r} has children {list(self._children[path])}")
        if path in in_use:
            raise BudgetError("in_use", f"{path!r} has queued or running jobs")
        nodes = dict(self._nodes)
        del nodes[path]
        return BudgetTree(nodes, self.version + 1)

    # ------------------------------------------------------------------ queries

    def __contains__(self, path: object) -> bool:
        return path in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BudgetTree) and self._nodes == other._nodes

    def __hash__(self) -> int:
        return hash(tuple(self._nodes.items()))

    def __repr__(self) -> str:
        return f"BudgetTree({len(self._nodes)} budgets, {len(self._leaves)} leaves)"

    def get(self, path: str) -> Budget | None:
        """The budget as set at ``path``, or ``None``."""
        return self._nodes.get(path)

    def paths(self) -> tuple[str, ...]:
        """Every budget path, sorted (parents before children)."""
        return tuple(self._nodes)

    def leaves(self) -> tuple[str, ...]:
        """Budgets without children, sorted by path."""
        return self._leaves

    def is_leaf(self, path: str) -> bool:
        """True when ``path`` exists and has no children."""
        return path in self._nodes and not self._children[path]

    def children(self, path: str = ROOT) -> tuple[str, ...]:
        """Children of ``path`` sorted by path (``""`` gives the top level).

        Raises:
            KeyError: unknown path.
        """
        return self._children[path]

    def parent(self, path: str) -> str:
        """Parent of ``path`` (``""`` for top level)."""
        return parent_of(path)

    def ancestors(self, path: str) -> tuple[str, ...]:
        """Top-level budget down to ``path`` inclusive (see :func:`ancestors_of`)."""
        return ancestors_of(path)

    def share(self, path: str) -> float:
        """Share of ``path`` relative to its parent (1.0 for the root)."""
        return 1.0 if path == ROOT else self._nodes[path].share

    def abs_share(self, path: str) -> float:
        """Absolute share: product of shares from the root to ``path``; 0.0 if unknown."""
        return self._abs.get(path, 0.0)

    def members(self, path: str) -> frozenset[str] | None:
        """Effective members of ``path`` (inherited); ``None`` means anyone."""
        return self._members.get(path)

    def max_min_runtime_s(self, path: str) -> float | None:
        """Effective minimum-runtime limit of ``path`` in seconds; ``None`` means no limit."""
        return self._max_rt.get(path)

    def time_limits_s(self, path: str) -> tuple[float | None, float | None]:
        """Effective ``(default_time_limit_s, max_time_limit_s)`` of ``path`` (inherited); ``None``: none."""
        return self._limits.get(path, (None, None))

    def preempt_idle_after_s(self, path: str) -> float | None:
        """Effective idle time after which ``path``'s allocated runs past their protection may be preempted
        (inherited; D3.idle-runs), seconds; ``None``: never for being idle."""
        return self._idle.get(path)

    def to_mapping(self) -> dict[str, dict[str, Any]]:
        """Plain dict form (inverse of :meth:`from_mapping`), for YAML/JSON output."""
        out: dict[str, dict[str, Any]] = {}
        for p, b in self._nodes.items():
            d: dict[str, Any] = {"share": b.share}
            if b.members is not None:
                d["members"] = sorted(b.members)
            if b.max_min_runtime_s is not None:
                d["max_min_runtime_s"] = b.max_min_runtime_s
            for name in ("default_time_limit_s", "max_time_limit_s", "preempt_idle_after_s"):
                if getattr(b, name) is not None:
                    d[name] = getattr(b, name)
            out[p] = d
        return out


def time_limit_conflicts(tree: BudgetTree, changed: Iterable[str]) -> list[tuple[str, str]]:
    """Budgets at or below ``changed`` whose default time limit in force is above their max time limit in force.

    Both limits inherit (a budget that sets neither takes its nearest ancestor's), so a default set on a parent
    can exceed a maximum set on its child. Such a budget would refuse every job that gives no time limit of its
    own (admission's ``time_limit_above_max``), so the change that makes one is refused instead.

    Returns:
        ``(path, message)`` per such budget, sorted by path; the message names where each limit is set.
    """
    found: dict[str, str] = {}
    seen: set[str] = set()
    todo = [p for p in changed if p in tree]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo.extend(tree.children(p))
        default_s, max_s = tree.time_limits_s(p)
        if default_s is None or max_s is None or default_s <= max_s:
            continue

        def where(field: str, path: str = p) -> str:
            owner = next(a for a in reversed(ancestors_of(path)) if getattr(tree.get(a), field) is not None)
            return "" if owner == path else f" (inherited from {owner!r})"

        found[p] = (
            f"default time limit {format_duration(default_s)}{where('default_time_limit_s')} of {p!r} is above "
            f"its max time limit {format_duration(max_s)}{where('max_time_limit_s')}: every job that gives no time "
            "limit would be refused; lower the default or raise the maximum"
        )
    return sorted(found.items())


def budget_of(change: Any) -> Budget:
    """The :class:`Budget` a ``BudgetSet`` (or a batch's ``BudgetSpec``) sets."""
    members = frozenset(change.members) if change.members is not None else None
    return Budget(
        change.path,
        change.share,
        members,
        change.max_min_runtime_s,
        change.default_time_limit_s,
        change.max_time_limit_s,
        change.preempt_idle_after_s,
    )


def fold_budget_event(tree: BudgetTree, event: Event) -> BudgetTree:
    """One step of :func:`fold_budget_log`: ``tree`` with ``event`` applied, or ``tree`` itself when ``event``
    is not a change (:data:`BUDGET_CHANGES`) or is invalid against ``tree`` (a batch: as a whole).

    Readers that fold the budgets log one event at a time (the dispatcher, the audit's protection check) call
    this; skipping what the policy rejected changes nothing for them, because the policy rejects exactly the
    changes this step skips (``services.policy.logic``).
    """
    if not isinstance(event, BUDGET_CHANGES):
        return tree
    try:
        return tree.apply(event)
    except BudgetError:
        return tree


def fold_budget_log(evts: Iterable[Event], until_us: int | None = None) -> BudgetTree:
    """The authoritative tree of a budget log: the one rule every reader applies.

    Writers (ops CLI) and the policy service share ``apportion.budgets``. The
    tree in force is the fold, in log order, of ``BudgetSet``,
    ``BudgetRemoved`` and ``BudgetBatch`` events (:func:`fold_budget_event`;
    a batch applies whole or not at all), skipping (a) any change the policy rejected
    (a ``BudgetRejected`` names it by ``rejected_event_id``; the policy may
    reject for reasons only it sees, such as a budget in use) and (b) any
    change that is invalid against the tree folded so far. The accounting
    and dispatcher services, the CLI and the audit all call this, so they
    agree on the tree without asking the policy service.

    Args:
        evts: events in log order (other types are ignored).
        until_us: only changes with event time <= this (µs since epoch).
    """
    from apportion.events import BudgetRejected  # local: avoids widening the module's imports
    from apportion.timeutil import to_us

    evts = list(evts)
    rejected = {e.rejected_event_id for e in evts if isinstance(e, BudgetRejected)}
    tree = BudgetTree.empty()
    for ev in evts:
        if not isinstance(ev, BUDGET_CHANGES) or ev.event_id in rejected:
            continue
        if until_us is not None and to_us(ev.ts) > until_us:
            continue
        tree = fold_budget_event(tree, ev)
    return tree
