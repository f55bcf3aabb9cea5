"""``audit verify``: rebuild from the log and compare with what the services recorded.

Three checks, each a pure function of a log in
:func:`apportion.logrecord.log_order` (plus, for the first, the rows read
from Redis):

(a) :func:`check_read_models` - the accounting read model (``usage`` meta and
    ``budgets`` rows) against the windows rebuilt at the meta's ``at``, and
    the dispatcher's ``jobs``/``nodes`` rows against the dispatcher state
    folded from the whole log (compare on a quiescent cluster: the
    dispatcher rewrites its rows at most every 0.5 s).
(b) :func:`check_snapshots` - every ``OccupancySnapshot`` against
    :func:`apportion.domain.usage.usage_snapshot` recomputed at its ``at``
    from the events with ``ts <= at`` (and the tree folded up to ``at``).
    GPU-second values must agree within 1e-6 relative *and* 1 GPU-second
    absolute; ratios within 1e-6 relative.
(c) :func:`rerun_decisions` - every recorded scheduling decision
    (``JobPlaced``/``JobPreempted``) re-run with
    :func:`apportion.domain.dispatch.step` on ``Tick(decision.ts)``.
(d) :func:`apportion.audit.signatures.check_requests` - every submission and cancel
    request the dispatcher accepted carries a valid signature (re-checked on
    its stored bytes) by a key registered for its user at its event time,
    and an accepted cancel of another user's job was signed by ops (rule D10.proven-user). A log without any
    ``UserKeyRegistered`` (a stack without
    identity, a simulator log) is not checked; ``signed_requests`` says how
    many were. A key revoked earlier in the log (by record timestamp) proves
    nothing, whatever the signed event's ``ts``.
(e) :func:`apportion.audit.signatures.check_reports` - every decision and command
    is signed by the dispatcher's key (``service:dispatcher``) and every node
    report by a key registered for its node (``node:<node_id>``), of a run
    placed on that node; one that is not must have been dead-lettered
    (``unauthenticated``, ``unauthenticated_node``) by the services, and the
    rebuilds of (a)-(c) leave it out as they did. ``signed_reports`` says how
    many were checked.
(f) :func:`refused_records` - the records the services refused, from the
    dead letters (``apportion.deadletter``, matched to the refused record by
    its topic, partition and offset) and the dispatcher's verdicts on
    requests it refused for who sent them (``JobRejected``
    ``unauthenticated``/``not_owner``, ``NodeRequestRefused``), reported by
    reason and by what the reason makes of the record (:func:`refusal_kind`:
    a forgery, a refused request, invalid input), never a mismatch (rule
    D10.node-boundary). A
    dead letter whose bytes are not those of the record at its position is
    a mismatch (``deadletter``). The dead letters themselves are no input
    of the rebuilds.

What the re-run folds (the reconstruction rule). The dispatcher decides
with the state after folding everything *it* had processed, which is not a
prefix of the log order: it folds its own decisions the moment it emits
them, and other producers' records only when it polls them. So for the
decisions of one tick at event time T (they share ``ts``):

* records of other producers on the dispatcher's input topics
  (submissions, jobs, nodes, budgets) are folded when their offset is below
  ``Decision.inputs`` (the dispatcher's input position, stamped on every
  ``JobPlaced``); decisions written before that field existed, and ticks
  that only preempted, fall back to event time (below; ``basis`` says which);
* the dispatcher's own events (``producer``) are folded when their event
  time is < T, those of the previous decision tick before any record polled
  after it whatever that record's event time (:func:`fold_order`: a report
  stamped before a decision but read after it comes after it, as the
  dispatcher folded it; a completion stamped before its run's preemption but
  read after the dispatcher requeued that run comes after the requeue; one
  stamped before its run's loss, after the requeue or the next attempt's
  placement, rule D3.completed-before-loss), and
  same-time events in the order ``step`` emits
  them (maintenance, preemptions, then placements and starts); its own
  non-decision events *at* T that are outputs of steps on events at the
  same instant (admissions; the simulator ticks at the instant of the event
  that woke it) are folded before the re-run, but not those of this tick's
  own maintenance (a node lost, its runs lost and requeued): the tick's
  cycle decided on a fork of the state before them, whose occupancy ledger
  does not see them, and the re-run's tick derives them again.
* without ``inputs``, other producers' records with event time <= T.
* an own event stamped at the event time of the record it answers rather than when it was made (the
  ``JobFailed`` of a start refused ``no_account``, at the refusal's event time, rule D3.refused-starts) is
  folded right after that record, whenever the dispatcher read it (:func:`answered_inputs`): a refusal
  stamped before a tick but read after it is answered after that tick, not before it as its event time
  would have it.

Records are folded incrementally in one pass (each decision re-runs on a
fork), so verifying a whole log costs one fold plus one cycle per decision
tick. Known limits: decisions made after a dispatcher fail-over were made
on a state rebuilt in log order (the occupancy ledger does not depend on
the order; the job and run state machines mostly do not), and own events
of decision-less ticks between two decision ticks are merged by event time
with the records polled around them; both can only cause a reported
mismatch, never hide one. A term's last tick may be in the log only in
part (its leader killed while publishing it): decisions its re-run makes
that were never recorded are listed as ``cut_short``, not as mismatches,
when every recorded one re-runs the same (:func:`term_cut_short`).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from apportion import events, topics
from apportion.audit.signatures import ReportCheck, check_reports, check_requests
from apportion.bus.intake import APPLY_FAILED, EVENT_ID_REUSED, UNDECODABLE
from apportion.domain.admission import JOB_REQUESTS, NODE_REQUEST_TYPES, UNAUTHENTICATED, UNAUTHENTICATED_NODE
from apportion.domain.budgets import BUDGET_CHANGES, fold_budget_log
from apportion.domain.dispatch import (
    DispatchConfig,
    DispatchState,
    Tick,
    emit_rank,
    evolve,
    maintenance,
    refused_failure_id,
    step,
)
from apportion.domain.fairshare import budget_order
from apportion.domain.occupancy import OccupancyLedger
from apportion.domain.usage import usage_snapshot
from apportion.logrecord import LogRecord, log_order
from apportion.settings import topic_name, topic_prefix
from apportion.timeutil import WEEK_S, Micros, from_us, to_us

__all__ = [
    "Mismatch",
    "DecisionCheck",
    "VerifyReport",
    "rerun_decisions",
    "services_input",
    "check_snapshots",
    "check_read_models",
    "verify",
    "position",
    "emitted_order",
    "fold_order",
    "answered_inputs",
    "last_fenced_us",
    "term_cut_short",
    "DECISION_TYPES",
    "dispatcher_input_topics",
    "Refusal",
    "refused_records",
    "refusal_reason",
]

#: Recorded events that are scheduling decisions (re-run by :func:`rerun_decisions`).
DECISION_TYPES = (events.JobPlaced, events.JobPreempted)

#: Tolerances of the snapshot check (rule D2.occupancy: exact to 1 GPU-second).
REL_TOL = 1e-6
ABS_GPU_S = 1.0


def emitted_order(rec: LogRecord) -> tuple:
    """Sort key of the dispatcher's own records in the order it folded them: event time, then
    :func:`apportion.domain.dispatch.emit_rank` (same-time events as ``step`` makes them: maintenance,
    preemptions, placements, starts), then the log position. Records without a decoded event: not accepted.
    """
    ev = _ev(rec)
    return (to_us(ev.ts), emit_rank(ev.type), rec.topic, rec.partition, rec.offset)


def position(rec: LogRecord) -> str:
    """``topic:partition@offset`` of a record (how mismatches name where they are)."""
    return f"{rec.topic}:{rec.partition}@{rec.offset}"


def dispatcher_input_topics() -> tuple[str, ...]:
    """Physical names of the topics the dispatcher consumes (namespace included)."""
    return (
        topic_name(topics.SUBMISSIONS),
        topic_name(topics.JOBS),
        topic_name(topics.NODES),
        topic_name(topics.BUDGETS),
    )


@dataclass
class Mismatch:
    """One divergence between the log's rebuild and what was recorded.

    Attributes:
        check: ``read_model``, ``snapshot``, ``decision``, ``signature`` or
            ``deadletter`` (a dead letter that does not hold the bytes of the record it names).
        offset: ``topic:partition@offset`` of the first record where it
            appears (``None`` when no record can be named, e.g. a Redis row
            for an entity the log never mentions).
        at: event time (ISO) of that record or decision.
        subject: what differs (a budget path, job id, node id, Redis key).
        detail: human description of the difference(s).
    """

    check: str
    offset: str | None
    at: str | None
    subject: str
    detail: str
    order: tuple = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "check": self.check,
            "offset": self.offset,
            "at": self.at,
            "subject": self.subject,
            "detail": self.detail,
        }


@dataclass
class DecisionCheck:
    """One decision tick re-run.

    Attributes:
        at_us: event time of the tick (µs).
        basis: ``inputs`` (folded up to ``Decision.inputs``) or ``log-order``
            (no input position recorded: folded by event time).
        recorded: the recorded decision records of the tick, in log order.
        expected: the decisions the re-run produced.
        diffs: human descriptions of the differences (empty: match).
        cut_short: decisions the re-run makes that the log does not have, not counted as
            differences because the tick is the last its term published (no later fenced record
            carries its fencing token) and every decision it did record re-ran the same: a leader
            killed while publishing the tick's batch (:func:`term_cut_short`).
    """

    at_us: Micros
    basis: str
    recorded: list[LogRecord]
    expected: Sequence[events.Event]
    diffs: list[str]
    cut_short: list[str] = field(default_factory=list)

    @property
    def match(self) -> bool:
        """True when the re-run gave the same decisions (ids and content)."""
        return not self.diffs

    @property
    def offset(self) -> str | None:
        """Position of the first recorded decision of the tick."""
        return position(self.recorded[0]) if self.recorded else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "at": from_us(self.at_us).isoformat(),
            "basis": self.basis,
            "match": self.match,
            "offset": self.offset,
            "recorded": [
                f"{r.event.type} {getattr(r.event, 'job_id', '')} {r.event.event_id}"
                for r in self.recorded
                if r.event is not None
            ],
            "expected": [f"{e.type} {getattr(e, 'job_id', '')} {e.event_id}" for e in self.expected],
            "diffs": self.diffs,
            "cut_short": self.cut_short,
        }


# --------------------------------------------------------------------------- comparisons


def _ev(rec: LogRecord) -> events.Event:
    """The decoded event of ``rec``; the re-run is only given records that decode."""
    assert rec.event is not None, f"undecodable record at {position(rec)}"
    return rec.event


def _close(a: float, b: float, rel: float = REL_TOL, abs_tol: float | None = None) -> bool:
    if math.isinf(a) or math.isinf(b) or math.isnan(a) or math.isnan(b):
        return a == b or (math.isnan(a) and math.isnan(b))
    if abs_tol is not None and abs(a - b) > abs_tol:
        return False
    return abs(a - b) <= rel * max(abs(a), abs(b)) or a == b


def _diff(a: Any, b: Any, path: str, out: list[str], rel: float = 1e-9) -> None:
    """Differences between two JSON-like values; floats within ``rel``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            _diff(a.get(k), b.get(k), f"{path}.{k}" if path else k, out, rel)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items recorded, {len(b)} re-run")
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out, rel)
    elif isinstance(a, float) or isinstance(b, float):
        fa = float("inf") if a == "Infinity" else a
        fb = float("inf") if b == "Infinity" else b
        if not (isinstance(fa, (int, float)) and isinstance(fb, (int, float)) and _close(fa, fb, rel)):
            out.append(f"{path}: recorded {a!r}, re-run {b!r}")
    elif a != b:
        out.append(f"{path}: recorded {a!r}, re-run {b!r}")


def _norm(ev: events.Event) -> dict[str, Any]:
    """A decision's content without what the service adds after deciding."""
    d = ev.model_dump(mode="json")
    for k in ("fencing_token", "producer", "schema_version"):
        d.pop(k, None)
    if isinstance(d.get("decision"), dict):
        d["decision"].pop("inputs", None)
    return d


# --------------------------------------------------------------------------- (c) decisions


def rerun_decisions(
    records: Sequence[LogRecord],
    config: DispatchConfig | None = None,
    *,
    producer: str = "dispatcher",
    only_at: Iterable[Micros] | None = None,
    until_us: Micros | None = None,
) -> list[DecisionCheck]:
    """Re-run every recorded decision tick (see the module docstring for what is folded).

    Args:
        records: the log in log order (all topics; only the dispatcher's
            input topics and its own events are folded).
        config: the dispatcher's knobs (delta, grace, reservation,
            heartbeat timeout, window) - they must match the service's.
        producer: the dispatcher's ``producer`` name (its own events).
        only_at: re-run only the ticks at these event times (µs), e.g. for
            ``explain``; the fold still covers everything before them.
        until_us: stop after the last tick at or before this event time.

    Returns:
        One :class:`DecisionCheck` per re-run tick, in time order.
    """
    cfg = config or DispatchConfig()
    wanted = set(only_at) if only_at is not None else None
    own, polled = dispatcher_records(records, producer)
    own, answers, polled_key = answered_inputs(own, polled)
    ext_by_tp: dict[str, list[LogRecord]] = defaultdict(list)
    groups: dict[Micros, list[LogRecord]] = defaultdict(list)
    for r in own:
        if isinstance(r.event, DECISION_TYPES):
            groups[to_us(r.event.ts)].append(r)
    for r in polled:
        ext_by_tp[f"{r.topic}:{r.partition}"].append(r)
    for lst in ext_by_tp.values():
        lst.sort(key=lambda r: r.offset)
    last_of_term = last_fenced_us(r.event for r in own if r.event is not None)
    preempted_at, lost_at = preemption_times(own), loss_times(own)
    state = DispatchState(window_s=cfg.engine.window_s)
    ext_ptr: dict[str, int] = {tp: 0 for tp in ext_by_tp}
    oi = 0
    prev: Micros | None = None  # the previous decision tick, when it recorded its input position
    out: list[DecisionCheck] = []
    for t in sorted(groups):
        if until_us is not None and t > until_us:
            break
        recorded = sorted(groups[t], key=log_order)
        placed = [r.event for r in recorded if isinstance(r.event, events.JobPlaced)]
        watermark = next((e.decision.inputs for e in placed if e.decision.inputs is not None), None)
        # 1. own events of earlier ticks come first (already emitted when later records were polled)
        # 2. then newly polled records merged with own events up to (not at) t by event time
        fresh: list[LogRecord] = []
        for tp, lst in ext_by_tp.items():
            i = ext_ptr[tp]
            if watermark is not None:
                limit = watermark.get(tp, 0)
                while i < len(lst) and lst[i].offset < limit:
                    fresh += [lst[i], *answers.get(position(lst[i]), ())]
                    i += 1
            else:  # a JobStarted at t answers a decision of t: it is folded after this tick
                while i < len(lst) and (
                    to_us(_ev(lst[i]).ts) < t
                    or (to_us(_ev(lst[i]).ts) == t and type(lst[i].event) is not events.JobStarted)
                ):
                    fresh += [lst[i], *answers.get(position(lst[i]), ())]
                    i += 1
            ext_ptr[tp] = i
        fresh.sort(key=log_order)
        mine: list[LogRecord] = []
        while oi < len(own) and to_us(_ev(own[oi]).ts) < t:
            mine.append(own[oi])
            oi += 1
        for r in fold_order(
            mine,
            fresh,
            emitted_order,
            polled_key,
            polled_after_us=prev if watermark is not None else None,
            preempted_at=preempted_at,
            lost_at=lost_at,
        ):
            evolve(state, _ev(r))
        prev = t if watermark is not None else None
        # 3. own non-decision events at exactly t: outputs of steps on events at the same instant
        #    (the simulator ticks at the time of the event), but not this tick's own maintenance
        #    (a node lost, its runs lost and requeued): the tick decided on a fork of the state
        #    before them, whose occupancy ledger does not see them (DispatchState.fork), and the
        #    re-run's tick derives them again, under the same ids
        j = oi
        maint: set[Any] | None = None
        while j < len(own) and to_us(_ev(own[j]).ts) == t:
            ev = _ev(own[j])
            if not isinstance(ev, DECISION_TYPES + (events.StartWorkload, events.StopWorkload)):
                if maint is None:
                    maint = {e.event_id for e in maintenance(state, t, cfg)}
                if ev.event_id not in maint:
                    evolve(state, ev)
            j += 1
        if wanted is not None and t not in wanted:
            continue
        scratch = state.fork()
        got = [e for e in step(scratch, Tick(t), t, cfg) if isinstance(e, DECISION_TYPES)]
        diffs: list[str] = []
        rec_by_id = {_ev(r).event_id: _ev(r) for r in recorded}
        got_by_id = {e.event_id: e for e in got}
        for eid, ev in rec_by_id.items():
            mine_ev = got_by_id.get(eid)
            who = f"{ev.type} {getattr(ev, 'job_id', '')}#{getattr(ev, 'attempt', '')}"
            if mine_ev is None:
                diffs.append(f"{who}: recorded, but the re-run does not decide it")
                continue
            sub: list[str] = []
            _diff(_norm(ev), _norm(mine_ev), "", sub)
            diffs.extend(f"{who}: {d}" for d in sub)
        unrecorded = [
            f"{ev.type} {getattr(ev, 'job_id', '')}#{getattr(ev, 'attempt', '')}: "
            f"the re-run decides it, but it was not recorded"
            for eid, ev in got_by_id.items()
            if eid not in rec_by_id
        ]
        cut: list[str] = []
        if unrecorded and not diffs and term_cut_short(placed, t, last_of_term):
            cut, unrecorded = unrecorded, []
        basis = "inputs" if watermark is not None else "log-order"
        out.append(DecisionCheck(t, basis, recorded, got, diffs + unrecorded, cut))
    return out


def ext_key(r: LogRecord) -> tuple:
    """Merge key of another producer's record among the dispatcher's own events (:func:`fold_order`).

    Event time, then before own events of the same instant (they follow from it), except a ``JobStarted``:
    it answers this dispatcher's ``StartWorkload``, so it can only follow the ``JobPlaced`` of its run.
    """
    ev = _ev(r)
    rank = 9 if type(ev) is events.JobStarted else -1
    return (to_us(ev.ts), rank, r.topic, r.partition, r.offset)


def answered_inputs(
    own: Sequence[LogRecord], polled: Sequence[LogRecord]
) -> tuple[list[LogRecord], dict[str, list[LogRecord]], Callable[[LogRecord], tuple]]:
    """The dispatcher's own events that are folded with the input they answer, not by their event time.

    The ``JobFailed`` of a start refused ``no_account`` (:func:`apportion.domain.dispatch.refused_failure_id`)
    is stamped at the refusal's event time, so that the run's charge ends there (rule D3.refused-starts), but
    the dispatcher makes it when it reads the refusal, which may be after ticks stamped later than the
    refusal. Folded by event time, it fails the job before those ticks (seen on a fresh stack: an array
    ``%8`` whose every start was refused, the re-run of a tick started elements the dispatcher could not
    yet start, at other ratios, on other GPUs).

    Returns:
        ``(rest, answers, key)``: ``own`` without those events; the :func:`position` of each answered input
        record (of ``polled``, the first with that event id) -> the own records answering it, to be folded
        right after it; and the merge key of :func:`fold_order` for ``polled`` with the answers among them:
        :func:`ext_key`, for an answer that of its input followed by 1 (right after it).
    """
    by_id: dict[UUID, LogRecord] = {}
    for r in polled:
        if isinstance(r.event, events.WorkloadRefused):
            by_id.setdefault(refused_failure_id(r.event), r)
    answers: dict[str, list[LogRecord]] = defaultdict(list)
    input_of: dict[str, LogRecord] = {}
    rest: list[LogRecord] = []
    for r in own:
        answered = by_id.get(_ev(r).event_id) if isinstance(r.event, events.JobFailed) else None
        if answered is None:
            rest.append(r)
        else:
            answers[position(answered)].append(r)
            input_of[position(r)] = answered

    def key(r: LogRecord) -> tuple:
        answered = input_of.get(position(r))
        return ext_key(r) if answered is None else (*ext_key(answered), 1)

    return rest, dict(answers), key


def preemption_times(own: Iterable[LogRecord]) -> dict[tuple[str, int], Micros]:
    """``(job_id, attempt) ->`` event time (µs) of the dispatcher's first ``JobPreempted`` of that run
    (``fold_order``'s ``preempted_at``), from its own records ``own``."""
    return _first_times(own, events.JobPreempted)


def loss_times(own: Iterable[LogRecord]) -> dict[tuple[str, int], Micros]:
    """``(job_id, attempt) ->`` event time (µs) of the dispatcher's first ``JobLost`` of that run
    (``fold_order``'s ``lost_at``), from its own records ``own``."""
    return _first_times(own, events.JobLost)


def _first_times(
    own: Iterable[LogRecord], kind: type[events.JobPreempted] | type[events.JobLost]
) -> dict[tuple[str, int], Micros]:
    out: dict[tuple[str, int], Micros] = {}
    for r in own:
        ev = r.event
        if isinstance(ev, kind):
            out.setdefault((ev.job_id, ev.attempt), to_us(ev.ts))
    return out


def dispatcher_fold(
    records: Sequence[LogRecord], config: DispatchConfig | None = None, *, producer: str = "dispatcher"
) -> DispatchState:
    """The dispatcher's state after the whole log, folded in the order it folded it (the read-model check).

    Its own events and the records of its input topics, merged by :func:`fold_order` without input
    positions (one merge by event time, other producers' records before own events of the same instant) but
    with its preemption times, so a completion stamped before a preemption whose requeue the dispatcher
    made first is folded after that requeue, where it changes nothing, as the dispatcher folded it. (A plain
    fold of the log by event time finished such a job, and the check reported the dispatcher's row of its
    next attempt as "a job the log says is not active".)

    Args:
        records: the log in log order.
        config: the dispatcher's knobs (its window).
        producer: the dispatcher's ``producer`` name.
    """
    cfg = config or DispatchConfig()
    own, polled = dispatcher_records(records, producer)
    preempted_at, lost_at = preemption_times(own), loss_times(own)
    own, answers, polled_key = answered_inputs(own, polled)
    polled = [a for r in polled for a in (r, *answers.get(position(r), ()))]
    state = DispatchState(window_s=cfg.engine.window_s)
    order = fold_order(own, polled, emitted_order, polled_key, preempted_at=preempted_at, lost_at=lost_at)
    for r in order:
        evolve(state, _ev(r))
    return state


def dispatcher_records(records: Sequence[LogRecord], producer: str) -> tuple[list[LogRecord], list[LogRecord]]:
    """``(own, polled)``: the dispatcher's own records, in the order it emitted them (:func:`emitted_order`),
    and the other producers' records of its input topics, in log order (what it read)."""
    inputs = set(dispatcher_input_topics())
    own: list[LogRecord] = []
    polled: list[LogRecord] = []
    for r in records:
        if r.event is None:
            continue
        if r.event.producer == producer:
            own.append(r)
        elif r.topic in inputs:
            polled.append(r)
    own.sort(key=emitted_order)
    return own, polled


def last_fenced_us(own: Iterable[events.Event]) -> dict[int, Micros]:
    """Fencing token -> event time (µs) of the latest of the dispatcher's fenced events that carry it
    (``JobPlaced``, ``StartWorkload``, ``StopWorkload``, ``NodeLost``): where each term's output ends."""
    out: dict[int, Micros] = {}
    for e in own:
        tok = getattr(e, "fencing_token", None)
        if tok is not None:
            t = to_us(e.ts)
            if t > out.get(tok, t - 1):
                out[tok] = t
    return out


def term_cut_short(placed: Sequence[events.JobPlaced], t: Micros, last_of_term: Mapping[int, Micros]) -> bool:
    """True when the tick at ``t`` (its recorded placements ``placed``) is the last its term published.

    A leader killed -9 while its producer sent a tick's batch leaves only part of it in the log (the
    records of some partitions; seen in the full chaos campaign: one ``JobPlaced`` of a tick whose
    re-run places 12 jobs and preempts 13 runs, no ``StartWorkload``), and the next leader decides again
    on what the log holds. The missing decisions never happened, so the audit does not count them;
    it still counts any recorded decision that re-runs otherwise, and a missing one in any tick its
    term published after. ``False`` without a fencing token (no lease: nothing tells the term's end).
    """
    tokens = {p.fencing_token for p in placed}
    if len(tokens) != 1 or None in tokens:
        return False
    (tok,) = tokens
    return tok is not None and last_of_term.get(tok) == t


def fold_order(
    own: Sequence[LogRecord],
    polled: Sequence[LogRecord],
    own_key: Any,
    polled_key: Any,
    *,
    polled_after_us: Micros | None = None,
    preempted_at: Mapping[tuple[str, int], Micros] | None = None,
    lost_at: Mapping[tuple[str, int], Micros] | None = None,
) -> list[LogRecord]:
    """The order the dispatcher folded ``own`` (its events) and ``polled`` (other producers' records) in.

    ``polled_after_us``: the time of the previous decision tick when ``polled`` are exactly the records
    read after it (its ``Decision.inputs`` and this tick's): the dispatcher folded its own events up to
    that tick (``ts <= polled_after_us``: they were folded when emitted) before any of them, whatever
    their event time. A report stamped before a decision but read after it (an agent cut off from the
    broker, a restarted one reporting from its journal) comes after that decision, as the dispatcher
    folded it, not before it as event time would have it. The rest merge by the keys: event time,
    polled records before own events of the same instant (``own_key``/``polled_key``). ``None``
    (decisions without input positions: old logs): one merge by the keys, as before.

    ``preempted_at``: ``(job_id, attempt) -> `` event time (µs) of the dispatcher's ``JobPreempted`` of
    that run. A ``JobCompleted`` of a run stamped at or before its preemption finishes the job when the
    dispatcher folds it while the run is stopping (``dispatch.evolve``, ``_Stopping.completed_by``), so
    if the dispatcher's own ``JobRequeued`` of that run (attempt + 1) is among ``own``, it had not folded
    the completion yet: the completion comes right after the requeue (where it is a report of an old
    attempt and changes nothing), whatever its event time. (Seen on the main job: the grace ended before
    the report arrived, the run was requeued in a tick that decided nothing, and an audit that merged by
    event time finished the job, so the re-run did not place its next attempt.) Every replica's
    completion of a gang goes after it too: before the requeue they only shorten the stop's wait, which
    the requeue ends anyway.

    ``lost_at``: ``(job_id, attempt) ->`` event time (µs) of the dispatcher's own ``JobLost`` of that run. A
    ``JobCompleted`` of such a run stamped at or before the loss was not folded when the dispatcher lost
    the run (folded, it would have ended the run, and there would be nothing to lose), so it comes after
    the loss; after the dispatcher's requeue of that run when the log holds one; after its placement of
    the next attempt when the log holds one (rule D3.completed-before-loss: read while a gang's survivors
    stopped or the next attempt waited, the last of them would have finished the job, and the dispatcher
    would not have placed it; read after, it stopped that attempt): where the dispatcher folded it,
    whatever its event time. Before the requeue, while the survivors stop, such reports only count the
    replicas that had finished, as they do after it.
    """
    first: list[LogRecord] = []
    rest = list(own)
    if polled_after_us is not None:
        first = [r for r in own if to_us(_ev(r).ts) <= polled_after_us]
        rest = [r for r in own if to_us(_ev(r).ts) > polled_after_us]
    first.sort(key=own_key)
    keyed = [(own_key(r), r) for r in rest]
    requeued: dict[tuple[str, int], tuple] = {}
    replaced: dict[tuple[str, int], tuple] = {}  # a lost run -> its loss, its requeue, or the next placement
    if preempted_at or lost_at:
        for k, r in keyed:
            ev = _ev(r)
            if isinstance(ev, events.JobRequeued):
                requeued[(ev.job_id, ev.attempt - 1)] = k
                if replaced.get((ev.job_id, ev.attempt - 1), (None, "lost"))[-1] == "lost":
                    replaced[(ev.job_id, ev.attempt - 1)] = (*k, "requeued")
            elif isinstance(ev, events.JobPlaced) and ev.attempt > 1:
                replaced[(ev.job_id, ev.attempt - 1)] = (*k, "placed")
            elif isinstance(ev, events.JobLost):
                replaced.setdefault((ev.job_id, ev.attempt), (*k, "lost"))

    def key_of(r: LogRecord) -> tuple:
        k = polled_key(r)
        ev = _ev(r)
        if replaced and isinstance(ev, events.JobCompleted):
            run = (ev.job_id, ev.attempt)
            after = requeued.get(run)
            stopped_at = preempted_at.get(run) if preempted_at is not None else None
            if after is not None and stopped_at is not None and to_us(ev.ts) <= stopped_at:
                return (*after, k)  # right after the requeue it cannot have preceded
            last = replaced.get(run)
            lost = lost_at.get(run) if lost_at is not None else None
            if last is not None and lost is not None and to_us(ev.ts) <= lost:
                return (*last[:-1], k)  # after the loss, its requeue or a placement it cannot have preceded
        return k

    merged = sorted(keyed + [(key_of(r), r) for r in polled], key=lambda kr: kr[0])
    return first + [r for _, r in merged]


# --------------------------------------------------------------------------- (b) snapshots


def _compare_snapshot(rec: events.OccupancySnapshot, exp: events.OccupancySnapshot) -> list[str]:
    diffs: list[str] = []
    if rec.capacity_gpus != exp.capacity_gpus:
        diffs.append(f"capacity_gpus: recorded {rec.capacity_gpus}, rebuilt {exp.capacity_gpus}")
    if not _close(rec.capacity_gpu_s, exp.capacity_gpu_s, abs_tol=ABS_GPU_S):
        diffs.append(f"capacity_gpu_s: recorded {rec.capacity_gpu_s!r}, rebuilt {exp.capacity_gpu_s!r}")
    a = {u.path: u for u in rec.budgets}
    b = {u.path: u for u in exp.budgets}
    for p in sorted(set(a) | set(b)):
        if p not in a or p not in b:
            diffs.append(f"{p}: {'missing from the snapshot' if p not in a else 'not in the rebuilt tree'}")
            continue
        for f in ("occupancy_gpu_s", "unallocated_gpu_s", "entitlement_gpu_s"):
            x, y = getattr(a[p], f), getattr(b[p], f)
            if not _close(x, y, abs_tol=ABS_GPU_S):
                diffs.append(f"{p}.{f}: recorded {x!r}, rebuilt {y!r}")
        for f in ("ratio", "abs_share"):
            x, y = getattr(a[p], f), getattr(b[p], f)
            if not _close(x, y):
                diffs.append(f"{p}.{f}: recorded {x!r}, rebuilt {y!r}")
    return diffs


def check_snapshots(records: Sequence[LogRecord], *, producer: str | None = None) -> list[Mismatch]:
    """Compare every ``OccupancySnapshot`` with the windows rebuilt at its ``at``.

    A snapshot that records its input position (``inputs``: accounting's next
    offset per ``"topic:partition"``) is rebuilt from exactly the records it had
    folded: snapshots are taken in the order accounting published them, and the
    ledger folds each newly covered stretch of every partition in event-time
    order (the ledger's answer does not depend on how partitions interleave,
    so this equals accounting's fold batch by batch); the tree is :func:`fold_budget_log`
    of the budget records covered. Without ``inputs`` (older logs), the ledger
    folds the log by event time ``<= at`` and the tree is the fold up to ``at``.
    Tolerances: :data:`REL_TOL` and :data:`ABS_GPU_S`.

    Args:
        records: the log in log order.
        producer: only check snapshots of this producer (default: all).

    Returns:
        Mismatches, one per divergent snapshot, in log order.
    """
    snaps = [
        r
        for r in records
        if isinstance(r.event, events.OccupancySnapshot) and (producer is None or r.event.producer == producer)
    ]
    if not snaps:
        return []
    out: list[Mismatch] = []
    positioned = [r for r in snaps if _snap(r).inputs is not None]
    if positioned:
        out.extend(_check_positioned(records, positioned))
    rest = [r for r in snaps if _snap(r).inputs is None]
    if rest:
        out.extend(_check_by_time(records, rest))
    out.sort(key=lambda m: m.order)
    return out


def _snap(rec: LogRecord) -> events.OccupancySnapshot:
    ev = rec.event
    assert isinstance(ev, events.OccupancySnapshot)
    return ev


def _snapshot_mismatch(r: LogRecord, snap: events.OccupancySnapshot, exp: events.OccupancySnapshot) -> Mismatch | None:
    diffs = _compare_snapshot(snap, exp)
    if not diffs:
        return None
    return Mismatch(
        "snapshot",
        position(r),
        snap.at.isoformat(),
        f"OccupancySnapshot {snap.event_id}",
        "; ".join(diffs[:8]) + (f"; ... {len(diffs) - 8} more" if len(diffs) > 8 else ""),
        log_order(r),
    )


_BUDGET_TYPES = (*BUDGET_CHANGES, events.BudgetRejected)


def _covered(records: Sequence[LogRecord], inputs: Mapping[str, int], kinds: tuple[type, ...]) -> list[events.Event]:
    """The events of types ``kinds`` among the records below ``inputs`` (``"topic:partition"`` -> next offset),
    in log order: what a reader at that position had read."""
    got = [r for r in records if isinstance(r.event, kinds) and r.offset < inputs.get(f"{r.topic}:{r.partition}", 0)]
    got.sort(key=log_order)
    return [r.event for r in got if r.event is not None]


def _check_positioned(records: Sequence[LogRecord], snaps: list[LogRecord]) -> list[Mismatch]:
    """Snapshots with ``inputs``: each rebuilt from the records its accounting had read (see check_snapshots)."""
    by_tp: dict[str, list[LogRecord]] = defaultdict(list)
    for r in records:
        if r.event is not None and not isinstance(r.event, events.OccupancySnapshot):
            by_tp[f"{r.topic}:{r.partition}"].append(r)
    for lst in by_tp.values():
        lst.sort(key=lambda r: r.offset)
    out: list[Mismatch] = []
    # one replay per window length and accounting instance (a restart from 0 shows as a position that goes back)
    state: dict[float, tuple[OccupancyLedger, dict[str, int], list[events.Event]]] = {}
    for r in sorted(snaps, key=lambda r: (r.topic, r.partition, r.offset)):
        snap = _snap(r)
        inputs = snap.inputs or {}
        held = state.get(snap.window_s)
        if held is None or any(inputs.get(tp, 0) < n for tp, n in held[1].items()):
            held = (OccupancyLedger(snap.window_s), {}, [])
        ledger, done, budget_log = held
        fresh: list[LogRecord] = []
        for tp, upto in inputs.items():
            lst = by_tp.get(tp, [])
            start = done.get(tp, 0)
            # offsets sorted: the newly covered stretch is a slice (a scan of the partition per snapshot
            # would make the check quadratic in the log)
            fresh.extend(lst[bisect_left(lst, start, key=_offset) : bisect_left(lst, upto, key=_offset)])
            done[tp] = upto
        fresh.sort(key=log_order)
        for x in fresh:
            ev = x.event
            assert ev is not None
            if isinstance(ev, _BUDGET_TYPES):
                budget_log.append(ev)
            else:
                ledger.apply(ev)
        state[snap.window_s] = (ledger, done, budget_log)
        at = to_us(snap.at)
        if ledger.clock is not None and at < ledger.clock:
            out.append(
                Mismatch(
                    "snapshot",
                    position(r),
                    snap.at.isoformat(),
                    "at",
                    "snapshot time precedes an event it had folded",
                    log_order(r),
                )
            )
            continue
        exp = usage_snapshot(fold_budget_log(budget_log), ledger, at, producer="audit")
        m = _snapshot_mismatch(r, snap, exp)
        if m is not None:
            out.append(m)
    return out


def _offset(rec: LogRecord) -> int:
    return rec.offset


def _check_by_time(records: Sequence[LogRecord], snaps: list[LogRecord]) -> list[Mismatch]:
    """Snapshots without ``inputs``: the log folded by event time up to each snapshot's ``at``."""
    evs = [r.event for r in records if r.event is not None]
    budget_evs = [e for e in evs if isinstance(e, _BUDGET_TYPES)]
    out: list[Mismatch] = []
    ledgers: dict[float, tuple[OccupancyLedger, list[int]]] = {}
    for r in sorted(snaps, key=lambda r: (to_us(_snap(r).at), log_order(r))):
        snap = _snap(r)
        at = to_us(snap.at)
        ledger, pos = ledgers.setdefault(snap.window_s, (OccupancyLedger(snap.window_s), [0]))
        i = pos[0]
        while i < len(evs) and to_us(evs[i].ts) <= at:
            ledger.apply(evs[i])
            i += 1
        pos[0] = i
        if ledger.clock is not None and at < ledger.clock:
            out.append(
                Mismatch(
                    "snapshot",
                    position(r),
                    snap.at.isoformat(),
                    "at",
                    "snapshot time precedes an event already folded",
                    log_order(r),
                )
            )
            continue
        exp = usage_snapshot(fold_budget_log(budget_evs, until_us=at), ledger, at, producer="audit")
        m = _snapshot_mismatch(r, snap, exp)
        if m is not None:
            out.append(m)
    return out


# --------------------------------------------------------------------------- (a) read models


def _last_record_of(records: Sequence[LogRecord], attr: str) -> dict[str, LogRecord]:
    last: dict[str, LogRecord] = {}
    for r in records:
        v = getattr(r.event, attr, None) if r.event is not None else None
        if isinstance(v, str):
            last[v] = r
    return last


def _located(rec: LogRecord | None) -> tuple[str | None, str | None, tuple]:
    """``(position, event time ISO 8601, log order)`` of a decoded record, ``(None, None, ())`` without one."""
    if rec is None or rec.event is None:
        return None, None, ()
    return position(rec), rec.event.ts.isoformat(), log_order(rec)


def check_read_models(
    records: Sequence[LogRecord],
    rows: Mapping[str, Mapping[str, Mapping[str, Any]]],
    config: DispatchConfig | None = None,
) -> list[Mismatch]:
    """Compare the Redis read models with the rebuild.

    Args:
        records: the log in log order.
        rows: ``{"usage": ..., "budgets": ..., "jobs": ..., "nodes": ...}``
            as :func:`apportion.readmodel.read_hash` returns them (a missing
            entry skips that read model).
        config: dispatcher knobs (window).

    Checks: the usage meta names a snapshot present in the log and its
    ``at``; every budget row (O, U, E, r, abs share, rank) equals the
    windows rebuilt at that ``at`` (:func:`_usage_mismatches`). Every job row (state, attempt, budget,
    nodes) and node row (state, GPUs, free GPUs, running) equals the
    dispatcher state folded from the whole log in its order (:func:`dispatcher_fold`; :func:`_job_mismatches`,
    :func:`_node_mismatches`). The offset named is the
    snapshot the usage rows claim to show, or the latest record of the job
    or node.
    """
    cfg = config or DispatchConfig()
    out: list[Mismatch] = []
    usage = rows.get("usage") or {}
    budgets = rows.get("budgets")
    meta = usage.get("meta")
    if meta is not None and budgets is not None:
        out += _usage_mismatches(records, meta, budgets)
    jobs, nodes = rows.get("jobs"), rows.get("nodes")
    if jobs is not None or nodes is not None:
        state = dispatcher_fold(records, cfg)
        if jobs is not None:
            out += _job_mismatches(records, jobs, state)
        if nodes is not None:
            out += _node_mismatches(records, nodes, state)
    return out


def _usage_mismatches(
    records: Sequence[LogRecord], meta: Mapping[str, Any], budgets: Mapping[str, Mapping[str, Any]]
) -> list[Mismatch]:
    """The usage meta and budget rows against the snapshot they name (:func:`check_read_models`)."""
    from apportion.audit.replay import occupancy_at

    out: list[Mismatch] = []
    snap_rec = next(
        (
            r
            for r in records
            if isinstance(r.event, events.OccupancySnapshot) and str(r.event.event_id) == meta.get("snapshot_id")
        ),
        None,
    )
    where = position(snap_rec) if snap_rec else None
    order = log_order(snap_rec) if snap_rec else ()
    at = to_us(events.utc(_parse(meta["at"])))
    if snap_rec is None:
        out.append(
            Mismatch(
                "read_model",
                None,
                meta["at"],
                "usage.meta",
                f"snapshot {meta.get('snapshot_id')} is not in the log",
            )
        )
    if snap_rec is not None and _snap(snap_rec).inputs is not None:
        # the rows are the snapshot they name, which check_snapshots rebuilds from exactly the records its
        # accounting had read (its inputs); the ranks are of the budget tree those records give. Rebuilding
        # by event time instead took a budget set after the snapshot's `at` (accounting's ledger clock, which
        # only job and node events move) but folded before it for absent (seen on `budget set` right after
        # an accounting restart: "row not in the rebuilt tree").
        snap = _snap(snap_rec)
        tree = fold_budget_log(_covered(records, snap.inputs or {}, _BUDGET_TYPES))
        occ = {u.path: u.occupancy_gpu_s for u in snap.budgets}
        ranks = {p: i for i, p in enumerate(budget_order(tree, occ, snap.capacity_gpu_s))}
    else:
        snap, ranks = occupancy_at(records, at, window_s=float(meta.get("window_s", WEEK_S)))
    exp = {u.path: u.model_dump(mode="json") | {"rank": ranks.get(u.path)} for u in snap.budgets}
    for path in sorted(set(exp) | set(budgets)):
        got, want = budgets.get(path), exp.get(path)
        if got is None or want is None:
            out.append(
                Mismatch(
                    "read_model",
                    where,
                    meta["at"],
                    f"budgets[{path}]",
                    "row missing in Redis" if got is None else "row not in the rebuilt tree",
                    order,
                )
            )
            continue
        diffs = _budget_row_diffs(got, want)
        if diffs:
            out.append(Mismatch("read_model", where, meta["at"], f"budgets[{path}]", "; ".join(diffs), order))
    if not _close(float(meta.get("capacity_gpu_s", math.nan)), snap.capacity_gpu_s, abs_tol=ABS_GPU_S):
        out.append(
            Mismatch(
                "read_model",
                where,
                meta["at"],
                "usage.meta",
                f"capacity_gpu_s: Redis {meta.get('capacity_gpu_s')!r}, rebuilt {snap.capacity_gpu_s!r}",
                order,
            )
        )
    return out


def _budget_row_diffs(got: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
    """What differs between a budget row in Redis and the rebuilt one (GPU-seconds within :data:`ABS_GPU_S`)."""
    diffs = []
    for f in ("occupancy_gpu_s", "unallocated_gpu_s", "entitlement_gpu_s"):
        if not _close(float(got.get(f, math.nan)), float(want[f]), abs_tol=ABS_GPU_S):
            diffs.append(f"{f}: Redis {got.get(f)!r}, rebuilt {want[f]!r}")
    for f in ("ratio", "abs_share"):
        g = got.get(f)
        g = math.inf if g == "Infinity" else g
        w = math.inf if want[f] == "Infinity" else want[f]
        if not isinstance(g, (int, float)) or not _close(float(g), float(w)):
            diffs.append(f"{f}: Redis {got.get(f)!r}, rebuilt {want[f]!r}")
    if got.get("rank") != want["rank"]:
        diffs.append(f"rank: Redis {got.get('rank')!r}, rebuilt {want['rank']!r}")
    return diffs


def _job_mismatches(
    records: Sequence[LogRecord], jobs: Mapping[str, Mapping[str, Any]], state: DispatchState
) -> list[Mismatch]:
    """The job rows against the dispatcher state folded from the log (:func:`check_read_models`)."""
    out: list[Mismatch] = []
    last = _last_record_of(records, "job_id")
    for jid in sorted(set(jobs) | set(state.jobs)):
        got = jobs.get(jid)
        rec = state.jobs.get(jid)
        lr = last.get(jid)
        where, at_s, order = _located(lr)
        if got is None or rec is None:
            out.append(
                Mismatch(
                    "read_model",
                    where,
                    at_s,
                    f"jobs[{jid}]",
                    "row missing in Redis" if got is None else "Redis lists a job the log says is not active",
                    order,
                )
            )
            continue
        run = state.cluster.runs.get((jid, rec.attempt))
        want = {
            "state": rec.status,
            "attempt": rec.attempt,
            "budget": rec.spec.budget,
            "nodes": [p.node_id for p in run.placements] if run is not None else [],
        }
        diffs = [f"{k}: Redis {got.get(k)!r}, rebuilt {v!r}" for k, v in want.items() if got.get(k) != v]
        if diffs:
            out.append(Mismatch("read_model", where, at_s, f"jobs[{jid}]", "; ".join(diffs), order))
    return out


def _node_mismatches(
    records: Sequence[LogRecord], nodes: Mapping[str, Mapping[str, Any]], state: DispatchState
) -> list[Mismatch]:
    """The node rows against the dispatcher state folded from the log (:func:`check_read_models`)."""
    out: list[Mismatch] = []
    last = _last_record_of([r for r in records if not isinstance(r.event, events.NodeHeartbeat)], "node_id")
    for nid in sorted(set(nodes) | set(state.cluster.nodes)):
        got = nodes.get(nid)
        n = state.cluster.nodes.get(nid)
        lr = last.get(nid)
        where, at_s, order = _located(lr)
        if got is None or n is None:
            out.append(
                Mismatch(
                    "read_model",
                    where,
                    at_s,
                    f"nodes[{nid}]",
                    "row missing in Redis" if got is None else "Redis lists an unknown node",
                    order,
                )
            )
            continue
        running = sorted(f"{k[0]}#{k[1]}" for k in state.cluster.node_runs.get(nid, ()))
        want = {
            "state": n.state,
            "gpu_count": n.gpu_count,
            "gpu_model": n.gpu_model,
            "free_gpus": len(n.free),
            "running": running,
        }
        diffs = [f"{k}: Redis {got.get(k)!r}, rebuilt {v!r}" for k, v in want.items() if got.get(k) != v]
        if diffs:
            out.append(Mismatch("read_model", where, at_s, f"nodes[{nid}]", "; ".join(diffs), order))
    return out


def _parse(text: str) -> Any:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def read_models_from_redis(r: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """The four read-model hashes from a ``redis.Redis`` client (namespace from the environment)."""
    from apportion import readmodel

    return {
        "usage": readmodel.read_hash(r, readmodel.usage_key()),
        "budgets": readmodel.read_hash(r, readmodel.budgets_key()),
        "jobs": readmodel.read_hash(r, readmodel.jobs_key()),
        "nodes": readmodel.read_hash(r, readmodel.nodes_key()),
    }


# --------------------------------------------------------------------------- (f) refused records

#: Kinds of refusal (:func:`refusal_reason`), most specific first: the reason prefixes the services write.
REFUSAL_KINDS = (UNAUTHENTICATED_NODE, UNAUTHENTICATED, EVENT_ID_REUSED, APPLY_FAILED, UNDECODABLE)

#: The kind of a record the codec refused (not JSON of an event, a bad field, a wrong key or topic).
INVALID = "invalid"

#: How many refused records a report names one by one (all are counted by reason).
REFUSED_LISTED = 10

#: Verdicts of the dispatcher that refuse a request for who sent it (rule D10.proven-user).
_FORGERY_REASONS = (events.RejectReason.UNAUTHENTICATED, events.RejectReason.NOT_OWNER)


#: What a refusal makes of its record (:func:`refusal_kind`).
FORGERY, REFUSED_REQUEST, INVALID_INPUT = "forgery", "refused request", "invalid input"

#: Reasons that say the record is not what it claims (rule D10.proven-user): no key of the one it names signed
#: it, or its id was read before (a replay).
_FORGED = frozenset({UNAUTHENTICATED_NODE, UNAUTHENTICATED, EVENT_ID_REUSED})


def refusal_kind(reason: str) -> str:
    """What a refusal of ``reason`` (:func:`refusal_reason`, or a verdict's reason) makes of its record:
    :data:`FORGERY` (a forgery or a replay), :data:`REFUSED_REQUEST` (``not_owner``: signed by the user it names,
    who may not do it; an operator's mistake as likely as an attack) or :data:`INVALID_INPUT` (the rest)."""
    if reason in _FORGED:
        return FORGERY
    return REFUSED_REQUEST if reason == events.RejectReason.NOT_OWNER.value else INVALID_INPUT


def refusal_reason(error: str) -> str:
    """The kind of a refusal reason: one of :data:`REFUSAL_KINDS`, or :data:`INVALID` for the codec's.

    Example: ``"unauthenticated_node: JobCompleted of j1 signed by ..."`` -> ``"unauthenticated_node"``.
    """
    return next((k for k in REFUSAL_KINDS if error.startswith(k)), INVALID)


@dataclass
class Refusal:
    """A record the services refused (a forgery, a refused request or invalid input: :attr:`kind`), not a
    mismatch.

    Attributes:
        offset: ``topic:partition@offset`` of the refused record.
        at: its event time (ISO); ``None`` when it does not decode.
        reason: the kind of refusal (:func:`refusal_reason`; a verdict's reason).
        detail: the first refusal's reason in full.
        what: the event type and the job (``#attempt``) or node it names; ``undecodable`` when it does not decode.
        who: whom it claims to come from: a request's ``user``, else its ``producer`` (a claim: the reason says
            whose key signed it).
        by: the services that refused it (dead letters and verdicts of the same record are one refusal).
        how: ``dead-lettered``, ``rejected`` (a verdict), or both.
        in_log: False when the refused record is not among the records read (read ``--since`` a later time,
            say): ``at``, ``what`` and ``who`` then come from the dead letter's copy of its bytes or the verdict.
        source: ``(topic, partition, offset)`` of the refused record when it is in the log, else ``None``.
    """

    offset: str
    at: str | None
    reason: str
    detail: str
    what: str
    who: str
    by: list[str] = field(default_factory=list)
    how: list[str] = field(default_factory=list)
    in_log: bool = True
    order: tuple = field(default=(), repr=False, compare=False)
    source: tuple[str, int, int] | None = field(default=None, repr=False, compare=False)

    @property
    def kind(self) -> str:
        """What the refusal makes of the record (:func:`refusal_kind`)."""
        return refusal_kind(self.reason)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "offset": self.offset,
            "at": self.at,
            "reason": self.reason,
            "kind": self.kind,
            "detail": self.detail,
            "what": self.what,
            "who": self.who,
            "by": self.by,
            "how": self.how,
            "in_log": self.in_log,
        }


def _claims(ev: events.Event | None) -> tuple[str, str, str | None]:
    """``(what, who, event time)`` of a refused event (:class:`Refusal`); ``None``: it does not decode."""
    if ev is None:
        return "undecodable", "-", None
    subject = getattr(ev, "job_id", None)
    attempt = getattr(ev, "attempt", None)
    if subject is not None and attempt is not None:
        subject = f"{subject}#{attempt}"
    subject = subject or getattr(ev, "node_id", None)
    who = ev.user if isinstance(ev, JOB_REQUESTS) else ev.producer  # the user a request claims to be
    return f"{ev.type} {subject}" if subject else ev.type, who, ev.ts.isoformat()


def _copy_of(letter: events.DeadLetter) -> events.Event | None:
    """The event in a dead letter's copy of the refused bytes, when they decode."""
    try:
        return events.decode(letter.original_bytes())
    except (events.DecodeError, ValueError):
        return None


#: Requests a verdict of the dispatcher refuses: every signed request on a job, and the ops' node requests.
_REQUEST_TYPES = (*JOB_REQUESTS, *NODE_REQUEST_TYPES)


def _events_of(records: Iterable[LogRecord], kinds: Any) -> Iterator[Any]:
    """The events of ``records`` that are of ``kinds``."""
    return (r.event for r in records if isinstance(r.event, kinds))


def refused_records(records: Sequence[LogRecord]) -> tuple[list[Refusal], list[Mismatch]]:
    """The records the services refused (check (f) of the module docstring; ``D10.node-boundary``), one
    :class:`Refusal` each.

    A dead letter names its record by topic, partition and offset (:func:`apportion.bus.intake.dead_letter`);
    a verdict names the request by its ``event_id`` (``refused_event_id``). The same record refused by
    several services, or dead-lettered again after a restart, is one refusal naming each service once. A
    refused record that is not among ``records`` is still a refusal (``in_log`` False), told from the dead
    letter's copy of its bytes or from the verdict.

    Args:
        records: the log in log order, the dead-letter topic included.

    Returns:
        ``(refusals, mismatches)``: the refusals in log order of the refused record (of its first refusal
        when it is not in the log), and a ``deadletter`` mismatch for each dead letter whose bytes are not
        those of the record at its position.
    """
    letters_topic = topic_name(topics.DEADLETTER)
    refusals = [
        r
        for r in records
        if isinstance(r.event, (events.DeadLetter, events.NodeRequestRefused))
        or (isinstance(r.event, events.JobRejected) and r.event.reason in _FORGERY_REASONS)
    ]
    named = {(e.source_topic, e.source_partition, e.source_offset) for e in _events_of(refusals, events.DeadLetter)}
    asked = {e.refused_event_id for e in _events_of(refusals, (events.JobRejected, events.NodeRequestRefused))}
    at_pos: dict[tuple[str, int | None, int | None], LogRecord] = {}  # the records the dead letters name
    requests: dict[Any, LogRecord] = {}  # the requests the verdicts name, by id (the first record of each)
    for r in records:
        if r.topic == letters_topic:
            continue
        if (r.topic, r.partition, r.offset) in named:
            at_pos[(r.topic, r.partition, r.offset)] = r
        if r.event is not None and r.event.event_id in asked and isinstance(r.event, _REQUEST_TYPES):
            requests.setdefault(r.event.event_id, r)
    found: dict[tuple, Refusal] = {}
    mism: list[Mismatch] = []
    for r in refusals:
        ev = r.event
        if isinstance(ev, events.DeadLetter):
            where: tuple = (ev.source_topic, ev.source_partition, ev.source_offset)
            src = at_pos.get(where)
            if src is not None and (src.raw or b"") != ev.original_bytes():
                detail = f"the dead letter by {ev.producer} holds other bytes than the record it names"
                mism.append(Mismatch("deadletter", position(r), ev.ts.isoformat(), position(src), detail, log_order(r)))
                continue
            claims = _claims(src.event if src is not None else _copy_of(ev))
            offset = f"{ev.source_topic}:{ev.source_partition}@{ev.source_offset}"
            reason, detail, how = refusal_reason(ev.error), ev.error, "dead-lettered"
        else:
            assert isinstance(ev, (events.JobRejected, events.NodeRequestRefused))
            src = requests.get(ev.refused_event_id)
            if src is not None:
                where, offset, claims = (src.topic, src.partition, src.offset), position(src), _claims(src.event)
            else:  # the request was not read: the verdict says what it was
                subject = ev.job_id if isinstance(ev, events.JobRejected) else ev.node_id
                who = ev.user if isinstance(ev, events.JobRejected) else "-"
                where, offset, claims = (
                    ("?", ev.request, subject, ev.refused_event_id),
                    "-",
                    (f"{ev.request} {subject}", who, None),
                )
            reason, detail, how = ev.reason.value, ev.message, "rejected"
        got = found.get(where)
        if got is None:
            what, who, at = claims
            order = log_order(src) if src is not None else log_order(r)
            got = found[where] = Refusal(
                offset,
                at,
                reason,
                detail,
                what,
                who,
                in_log=src is not None,
                order=order,
                source=(src.topic, src.partition, src.offset) if src is not None else None,
            )
        if ev.producer not in got.by:
            got.by.append(ev.producer)
        if how not in got.how:
            got.how.append(how)
    for got in found.values():
        got.by.sort()
    return sorted(found.values(), key=lambda f: f.order), mism


# --------------------------------------------------------------------------- all


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`.

    Attributes:
        mismatches: every divergence, in log order of the first record
            where it appears (``first`` is the earliest).
        snapshots: number of snapshots checked.
        decisions: decision ticks re-run; ``decision_basis`` counts them by basis.
        read_models: whether Redis rows were compared.
        records: log records read.
        refused: the records the services refused (:func:`refused_records`): findings, not mismatches.
    """

    mismatches: list[Mismatch]
    snapshots: int
    decisions: int
    decision_basis: dict[str, int]
    read_models: bool
    records: int
    signed_requests: int = 0
    signed_reports: int = 0
    refused: list[Refusal] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing diverged."""
        return not self.mismatches

    @property
    def first(self) -> Mismatch | None:
        """The earliest mismatch in log order."""
        return self.mismatches[0] if self.mismatches else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "ok": self.ok,
            "records": self.records,
            "snapshots": self.snapshots,
            "decision_ticks": self.decisions,
            "decision_basis": self.decision_basis,
            "read_models": self.read_models,
            "signed_requests": self.signed_requests,
            "signed_reports": self.signed_reports,
            "first_offset": self.first.offset if self.first else None,
            "mismatches": [m.to_dict() for m in self.mismatches],
            "refused_attacks": self.refused_summary(),
        }

    def refused_summary(self, listed: int = REFUSED_LISTED) -> dict[str, Any]:
        """The refused records: ``count``, ``by_reason``, ``by_kind`` (:func:`refusal_kind`), ``not_in_log`` and
        the ``first`` ``listed`` of them."""
        by_reason: dict[str, int] = defaultdict(int)
        by_kind: dict[str, int] = defaultdict(int)
        for f in self.refused:
            by_reason[f.reason] += 1
            by_kind[f.kind] += 1
        return {
            "count": len(self.refused),
            "by_reason": dict(sorted(by_reason.items())),
            "by_kind": dict(sorted(by_kind.items())),
            "not_in_log": sum(1 for f in self.refused if not f.in_log),
            "first": [f.to_dict() for f in self.refused[:listed]],
        }


def services_input(records: Sequence[LogRecord], reports: ReportCheck | None = None) -> list[LogRecord]:
    """The records of ``records`` the services folded, in log order: without the decisions, commands and node
    reports their gate refuses (``unauthenticated``, ``unauthenticated_node``: :func:`check_reports`, the
    services' own check, rule D10.proven-user; ``reports`` when already made) and without the dead letters,
    which are no input of any service's fold. What every rebuild and re-run of the audit reads.
    """
    ignored = (reports or check_reports(records)).ignored
    letters_topic = topic_name(topics.DEADLETTER)
    return [r for i, r in enumerate(records) if i not in ignored and r.topic != letters_topic]


def verify(
    records: Sequence[LogRecord],
    *,
    read_models: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
    config: DispatchConfig | None = None,
    producer: str = "dispatcher",
) -> VerifyReport:
    """Run the checks (read models only when ``read_models`` is given).

    Args:
        records: the log in log order; with the dead-letter topic, so that what the services refused is
            reported as refused (and a forgery no service refused as a mismatch).
        read_models: rows from :func:`read_models_from_redis`, or ``None``.
        config: the dispatcher's knobs.
        producer: the dispatcher's ``producer`` name.
    """
    refused, mism = refused_records(records)
    n_records = len(records)
    reports = check_reports(records)
    for f in reports.findings:
        rec = records[f.index]
        at = rec.event.ts.isoformat() if rec.event is not None else None
        mism.append(Mismatch("signature", position(rec), at, f.job_id, f.detail, log_order(rec)))
    records = services_input(records, reports)
    if read_models is not None:
        mism += check_read_models(records, read_models, config)
    snaps = check_snapshots(records)
    mism += snaps
    checks = rerun_decisions(records, config, producer=producer)
    basis: dict[str, int] = defaultdict(int)
    for c in checks:
        basis[c.basis] += 1
        if c.cut_short:
            basis["cut short"] += 1  # a term's last tick, partly published (DecisionCheck.cut_short)
        if not c.match:
            first = c.recorded[0]
            mism.append(
                Mismatch(
                    "decision",
                    c.offset,
                    from_us(c.at_us).isoformat(),
                    ", ".join(sorted({getattr(r.event, "job_id", "?") for r in c.recorded})),
                    "; ".join(c.diffs[:6]),
                    log_order(first),
                )
            )
    # a request the dispatcher refused (a dead letter, a verdict) was never acted on (rule D4.dead-letters)
    findings, signed = check_requests(records, {f.source for f in refused if f.source and producer in f.by})
    for f in findings:
        rec = records[f.index]
        at = rec.event.ts.isoformat() if rec.event is not None else None
        mism.append(Mismatch("signature", position(rec), at, f.job_id, f.detail, log_order(rec)))
    mism.sort(key=lambda m: (m.order == (), m.order))
    n_snaps = sum(1 for r in records if isinstance(r.event, events.OccupancySnapshot))
    return VerifyReport(
        mism, n_snaps, len(checks), dict(basis), read_models is not None, n_records, signed, reports.checked, refused
    )


def records_from_events(evs: Iterable[events.Event]) -> list[LogRecord]:
    """Wrap events (e.g. a simulator log) as records in log order.

    Each event goes to its registry topic (:func:`apportion.events.topic_of`, in the namespace in force),
    partition 0, at the next offset of that topic in the given order; the
    Kafka timestamp is the event time. For tests and offline what-ifs.
    """
    nxt: dict[str, int] = defaultdict(int)
    out = []
    for e in evs:
        t = events.topic_of(e, topic_prefix())
        out.append(LogRecord(t, 0, nxt[t], events.key_of(e), to_us(e.ts) // 1000, events.encode(e), e))
        nxt[t] += 1
    out.sort(key=log_order)
    return out
