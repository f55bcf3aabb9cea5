"""What the CLI's change commands check before publishing, and how they learn the owning service's verdict.

Rule D11.verdicts: a change command exits 0 only when the change happened.
This module is the CLI side of that rule; the commands in
:mod:`apportion.cli.main` call it. Everything reads the log or a read model
and never joins a consumer group, so checking disturbs no service.

Verdicts, per owner:

* **budgets** (policy): a ``BudgetRejected`` whose ``rejected_event_id`` is the
  change's id means refused. Accepted is the policy having consumed past the
  change's record without rejecting it: the policy's consumer group has a
  committed offset beyond the record on ``apportion.budgets`` (the policy
  publishes, and waits for the ack of, its rejection before the record is
  acked, so a committed offset past the record with no rejection in the log
  means there is none). :func:`budget_verdicts`.
* **cancel** (dispatcher): ``JobCancelled`` of the job on ``apportion.jobs``
  (:func:`wait_job_event`).
* **nodes** (dispatcher): the dispatcher's node read model shows the state the
  request asks for (:func:`wait_node_state`).

Exit codes used by the callers: 0 done, 1 refused or names nothing that
exists, 2 bad input, 3 stack unreachable or the owner gave no verdict in time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from apportion import events
from apportion.arrays import split_element_id
from apportion.cli.common import Unreachable, _admin, _consumer, is_kafka_error, partitions_of
from apportion.cli.history import FINISHED, fold_jobs
from apportion.settings import topic_name

#: Wall seconds a change command waits for its verdict by default.
DEFAULT_WAIT_S = 15.0


def partition_of(key: str, partitions: int) -> int:
    """The partition the Kafka default partitioner (murmur2, as our producers use) gives ``key``."""
    from kafka.partitioner.default import murmur2

    return (murmur2(key.encode("utf-8")) & 0x7FFFFFFF) % partitions


def read_partition(
    bootstrap: str, topic: str, partition: int, start: int = 0, key: str | None = None
) -> list[tuple[int, events.Event]]:
    """``(offset, event)`` of one partition from ``start`` to its end offset now (only ``key``'s when given).

    Raises:
        Unreachable: Kafka did not answer.
    """
    from kafka import TopicPartition

    want = key.encode("utf-8") if key is not None else None
    try:
        kc = _consumer(bootstrap)
    except Exception as exc:
        if is_kafka_error(exc):
            raise Unreachable(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
        raise
    out: list[tuple[int, events.Event]] = []
    try:
        tp = TopicPartition(topic, partition)
        kc.assign([tp])
        end = kc.end_offsets([tp])[tp]
        if start >= end:
            return out
        kc.seek(tp, start)
        deadline = time.monotonic() + 30
        while kc.position(tp) < end and time.monotonic() < deadline:
            for recs in kc.poll(timeout_ms=500, max_records=5000).values():
                for rec in recs:
                    if rec.offset >= end or (want is not None and rec.key != want):
                        continue
                    try:
                        out.append((rec.offset, events.decode(rec.value)))
                    except events.DecodeError:
                        continue
    finally:
        kc.close()
    return out


def key_events(bootstrap: str, topic: str, key: str) -> list[events.Event]:
    """Every event with record key ``key`` on ``topic`` (only its partition is read), in offset order."""
    n = partitions_of(bootstrap, topic)
    if n == 0:
        return []
    return [ev for _, ev in read_partition(bootstrap, topic, partition_of(key, n), key=key)]


# --------------------------------------------------------------------------- jobs


@dataclass(frozen=True, slots=True)
class JobStatus:
    """What the log says about one job: ``unknown``, ``live`` or how it finished (``completed``, ``failed``,
    ``cancelled``, ``rejected``: :data:`apportion.cli.history.FINISHED`), with ``detail`` its reason."""

    job_id: str
    state: str
    user: str | None = None
    detail: str = ""


def job_status(bootstrap: str, job_id: str) -> JobStatus:
    """The job's status from its records on ``apportion.submissions`` and ``apportion.jobs``, folded as
    ``apportion history`` folds them (:func:`apportion.cli.history.fold_jobs`: a run ends with its last
    replica's report, which the node agents publish per replica). An element of a job array
    (``<array id>_<index>``) is found by its array's submission; an array's own id is live until its
    cancel or rejection (the dispatcher refuses a request on an array whose elements all ended)."""
    from apportion.topics import JOBS, SUBMISSIONS

    subs = key_events(bootstrap, topic_name(SUBMISSIONS), job_id)
    submitted = [e for e in subs if isinstance(e, events.JobSubmitted) and e.job_id == job_id]
    parts = split_element_id(job_id)
    if not submitted and parts is not None:  # an element of a job array: its submission is the array's
        arr = key_events(bootstrap, topic_name(SUBMISSIONS), parts[0])
        submitted = [e for e in arr if isinstance(e, events.JobSubmitted) and job_id in e.job_ids]
    if not submitted:
        return JobStatus(job_id, "unknown")
    job = fold_jobs([submitted[0], *key_events(bootstrap, topic_name(JOBS), job_id)]).get(job_id)
    if job is None:
        return JobStatus(job_id, "live", submitted[0].user)  # an element whose JobQueued is not in yet
    if job.state not in FINISHED:
        return JobStatus(job_id, "live", job.user)
    return JobStatus(job_id, job.state, job.user, job.reason)


class JobWatcher:
    """Waits for an event of one job on ``apportion.jobs``; open it before publishing the request.

    Args:
        bootstrap: Kafka bootstrap.
        job_id: the job (the record key).
        types: event type names that answer.
    """

    def __init__(self, bootstrap: str, job_id: str, types: Sequence[str]) -> None:
        from kafka import TopicPartition

        from apportion.topics import JOBS

        self.job_id = job_id
        self.types = tuple(types)
        self._key = job_id.encode("utf-8")
        n = partitions_of(bootstrap, topic_name(JOBS))
        kc = None
        try:
            self._kc = kc = _consumer(bootstrap)
            self._tp = TopicPartition(topic_name(JOBS), partition_of(job_id, max(n, 1)))
            self._kc.assign([self._tp])
            self._kc.seek_to_end(self._tp)
            self._kc.position(self._tp)  # pin the end now, before the request is published
        except Exception as exc:
            if kc is not None:  # made, then the broker failed it: its network thread is stopped
                kc.close()
            if is_kafka_error(exc):
                raise Unreachable(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
            raise

    def wait(self, timeout_s: float, request_id: object = None) -> events.Event | None:
        """The first answering event, or ``None`` after ``timeout_s`` wall seconds.

        With ``request_id``, a ``JobRejected`` refusing that request (``refused_event_id``) answers too.
        """
        end = time.monotonic() + timeout_s
        try:
            while (left := end - time.monotonic()) > 0:
                for recs in self._kc.poll(timeout_ms=int(min(left, 0.5) * 1000)).values():
                    for rec in recs:
                        if rec.key != self._key:
                            continue
                        try:
                            ev = events.decode(rec.value)
                        except events.DecodeError:
                            continue
                        if getattr(ev, "job_id", None) != self.job_id:
                            continue
                        if ev.type in self.types:
                            return ev
                        if request_id is not None and getattr(ev, "refused_event_id", None) == request_id:
                            return ev
            return None
        finally:
            self._kc.close()


# --------------------------------------------------------------------------- budgets


def policy_group() -> str:
    """The policy's consumer group: ``APPORTION_TOPIC_PREFIX`` + ``APPORTION_POLICY_GROUP_ID`` (default ``policy``)."""
    import os

    from apportion.settings import topic_prefix

    return topic_prefix() + os.environ.get("APPORTION_POLICY_GROUP_ID", "policy")


def committed_offset(bootstrap: str, group: str, topic: str, partition: int) -> int | None:
    """The offset ``group`` has committed on ``topic[partition]`` (``None`` when it has none)."""
    from kafka import TopicPartition

    admin = _admin(bootstrap)
    try:
        tp = TopicPartition(topic, partition)
        got = admin.list_group_offsets({group: [tp]}).get(group, {})
        meta = got.get(tp)
        return None if meta is None or meta.offset is None or meta.offset < 0 else int(meta.offset)
    finally:
        admin.close()


@dataclass(frozen=True, slots=True)
class BudgetVerdict:
    """The policy's answer to one published budget change.

    Attributes:
        event: the change.
        offset: its record's offset on ``apportion.budgets`` partition 0.
        state: ``accepted``, ``rejected`` or ``no_verdict``.
        reason, message: from the ``BudgetRejected`` when rejected.
        failures: a rejected batch's failing paths.
    """

    event: events.BudgetSet | events.BudgetRemoved | events.BudgetBatch
    offset: int
    state: str
    reason: str = ""
    message: str = ""
    failures: tuple[events.BudgetFailure, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        ev = self.event
        return {
            "path": getattr(ev, "path", None),
            "paths": list(ev.paths) if isinstance(ev, events.BudgetBatch) else [ev.path],
            "type": ev.type,
            "event_id": str(ev.event_id),
            "offset": self.offset,
            "verdict": self.state,
            "reason": self.reason,
            "message": self.message,
            "failures": [f.model_dump() for f in self.failures],
        }


def budget_verdicts(
    bootstrap: str,
    sent: Sequence[tuple[events.BudgetSet | events.BudgetRemoved | events.BudgetBatch, int]],
    timeout_s: float,
    *,
    group: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> list[BudgetVerdict]:
    """Wait (at most ``timeout_s`` wall seconds) for the policy's verdict on each ``(change, offset)``.

    Polls with a bounded deadline: the committed offset of the policy's group
    first, then the budgets log from the first change to its end, so a
    rejection acked before that commit is always seen.
    """
    from apportion.topics import BUDGETS

    if not sent:
        return []
    group = group or policy_group()
    first = min(off for _, off in sent)
    last = max(off for _, off in sent)
    ids = {ev.event_id: (ev, off) for ev, off in sent}
    rejected: dict[uuid.UUID, events.BudgetRejected] = {}
    end = time.monotonic() + timeout_s
    committed: int | None = None
    while True:
        try:
            committed = committed_offset(bootstrap, group, topic_name(BUDGETS), 0)
            for _, ev in read_partition(bootstrap, topic_name(BUDGETS), 0, start=first):
                if isinstance(ev, events.BudgetRejected) and ev.rejected_event_id in ids:
                    rejected[ev.rejected_event_id] = ev
        except Exception as exc:
            if is_kafka_error(exc):
                raise Unreachable(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
            raise
        if (committed is not None and committed > last) or time.monotonic() >= end:
            break
        sleep(0.2)
    out = []
    for ev, off in sent:
        rej = rejected.get(ev.event_id)
        if rej is not None:
            out.append(BudgetVerdict(ev, off, "rejected", rej.reason, rej.message, rej.failures))
        elif committed is not None and committed > off:
            out.append(BudgetVerdict(ev, off, "accepted"))
        else:
            out.append(BudgetVerdict(ev, off, "no_verdict"))
    return out


def read_model_folded(redis: Any, offset: int) -> bool:
    """True when the accounting read model (what ``share`` shows) has folded ``apportion.budgets`` partition 0
    past ``offset``: the ``offsets`` of its ``meta`` (written with the rows, in one transaction) say so."""
    from apportion import readmodel
    from apportion.topics import BUDGETS

    meta = readmodel.read_hash(redis, readmodel.usage_key()).get("meta") or {}
    return int((meta.get("offsets") or {}).get(f"{topic_name(BUDGETS)}:0", 0)) > offset


# --------------------------------------------------------------------------- budget files as one batch


@dataclass(frozen=True, slots=True)
class FieldChange:
    """One field of one budget that a file changes: ``old`` is ``None`` for a new budget.

    ``kind``: ``added``, ``changed``, ``removed`` (a field the file drops); for a whole budget in force but not
    in the file, field ``budget``: ``kept`` (the default) or ``pruned`` (``--prune``: the batch removes it).
    """

    path: str
    kind: str
    field: str
    old: Any
    new: Any

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "field": self.field, "old": self.old, "new": self.new}


def _fields(b: Any) -> dict[str, Any]:
    return {
        "share": b.share,
        "members": sorted(b.members) if b.members is not None else None,
        "max_min_runtime_s": b.max_min_runtime_s,
        "default_time_limit_s": b.default_time_limit_s,
        "max_time_limit_s": b.max_time_limit_s,
        "preempt_idle_after_s": b.preempt_idle_after_s,
    }


def budget_diff(current: Any, wanted: Mapping[str, Any], prune: bool = False) -> list[FieldChange]:
    """Field changes taking the tree in force ``current`` to the file's budgets ``wanted`` (path -> Budget).

    Budgets of ``current`` not in ``wanted`` are listed once each, as ``kept``, or ``pruned`` with ``prune``.
    """
    out: list[FieldChange] = []
    for p in sorted(wanted):
        new = _fields(wanted[p])
        old_b = current.get(p)
        if old_b is None:
            out += [FieldChange(p, "added", f, None, v) for f, v in new.items() if v is not None or f == "share"]
            continue
        old = _fields(old_b)
        for f in new:
            if old[f] != new[f]:
                kind = "removed" if new[f] is None else "added" if old[f] is None else "changed"
                out.append(FieldChange(p, kind, f, old[f], new[f]))
    for p in current.paths():
        if p not in wanted:
            out.append(FieldChange(p, "pruned" if prune else "kept", "budget", _fields(current.get(p)), None))
    return out


def batch_of(current: Any, wanted: Mapping[str, Any], prune: bool, now: Any) -> events.BudgetBatch | None:
    """The one ``BudgetBatch`` that takes ``current`` to the file's budgets ``wanted`` (path -> Budget).

    It sets the budgets that are new or differ (an unchanged one is left out) and, with ``prune``, removes
    those in force that the file does not name. Without ``prune`` the file may be partial: budgets in force
    that it does not name are kept (and count in their siblings' sums), and a budget's parent may come from
    the tree in force. ``None`` when there is nothing to change.

    Raises:
        apportion.domain.budgets.BudgetBatchError: the tree after the batch would be invalid (every failing
            path); nothing is published.
    """
    sets = [
        events.BudgetSpec(
            path=p,
            share=b.share,
            members=tuple(sorted(b.members)) if b.members is not None else None,
            max_min_runtime_s=b.max_min_runtime_s,
            default_time_limit_s=b.default_time_limit_s,
            max_time_limit_s=b.max_time_limit_s,
            preempt_idle_after_s=b.preempt_idle_after_s,
        )
        for p, b in sorted(wanted.items())
        if current.get(p) is None or _fields(current.get(p)) != _fields(b)
    ]
    removes = tuple(p for p in current.paths() if p not in wanted) if prune else ()
    if not sets and not removes:
        return None
    ev = events.BudgetBatch(sets=tuple(sets), removes=removes, by="cli", ts=now, producer="cli")
    current.apply(ev)
    return ev


# --------------------------------------------------------------------------- nodes


def wait_for(pred: Callable[[], Any], timeout_s: float, every_s: float = 0.2) -> Any:
    """Poll ``pred`` until it returns something truthy (returned) or ``timeout_s`` passes (``None``)."""
    end = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= end:
            return None
        time.sleep(every_s)
