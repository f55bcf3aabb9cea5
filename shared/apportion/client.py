"""Python client for programs that submit work to apportion.

Example::

    from apportion import client
    job = client.submit(budget="lab/prior/robotics", user="alice", gpus=2,
                        min_runtime="2h", command=["python", "train.py"])
    print(job.job_id)

Submissions are ``JobSubmitted`` events on ``apportion.submissions``; any
Kafka producer in any language may publish the same JSON (schemas in
``schemas/JobSubmitted.json``). The client validates locally before it
publishes, so a bad submission fails here with a clear error instead of
landing in the dead-letter topic.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from apportion import events
from apportion.durations import parse_duration
from apportion.settings import Connection

#: Job ids the client accepts: they appear in shell commands, log lines, file names and metric labels.
#: (Any JobSubmitted from another producer is still accepted by the schema: 1-200 characters.)
JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,199}")


def check_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is a client-acceptable id (:data:`JOB_ID_RE`).

    Raises:
        ValueError: the id is empty, too long, or has a space, slash or other character outside
            letters, digits and ``. _ : @ + -`` (saying which).
    """
    if JOB_ID_RE.fullmatch(job_id):
        return job_id
    bad = sorted({c for c in job_id if not (c.isascii() and (c.isalnum() or c in "._:@+-"))})
    why = (
        f"characters {''.join(bad)!r} are not allowed"
        if bad
        else "it must start with a letter or digit"
        if job_id
        else "it is empty"
    )
    if len(job_id) > 200:
        why = "it is longer than 200 characters"
    raise ValueError(f"invalid job id {job_id!r}: {why} (use letters, digits and . _ : @ + -)")


def new_job_id(user: str) -> str:
    """A fresh job id, ``<user>-<12 hex>``."""
    return f"{user}-{uuid.uuid4().hex[:12]}"


def build_submission(
    *,
    budget: str,
    user: str,
    gpus: int,
    replicas: int = 1,
    min_runtime: str | float = 0,
    command: Sequence[str] | None = None,
    duration: str | float | None = None,
    gpu_model: str | None = None,
    job_id: str | None = None,
    now: datetime | None = None,
    producer: str | None = None,
) -> events.JobSubmitted:
    """Build and validate a ``JobSubmitted`` without publishing it.

    Args:
        budget: budget path to charge, e.g. ``"lab/prior/robotics"``.
        user: submitting user.
        gpus: GPUs per replica.
        replicas: gang size (replicas on distinct nodes).
        min_runtime: seconds or a duration string (``"2h"``); 0 = unallocated.
        command: argv of a real workload.
        duration: seconds or duration string of a simulated workload.
        gpu_model: required GPU model, or None.
        job_id: defaults to :func:`new_job_id`.
        now: submission time (UTC); defaults to the wall clock (this is an
            edge adapter, not domain code).

    Raises:
        pydantic.ValidationError: the submission breaks the schema.
        ValueError: a duration string cannot be parsed, or ``job_id`` fails :func:`check_job_id`.
    """
    ts = now or datetime.now(UTC)
    return events.JobSubmitted(
        job_id=check_job_id(job_id) if job_id is not None else new_job_id(user),
        budget=budget,
        user=user,
        gpus_per_replica=gpus,
        replicas=replicas,
        min_runtime_s=parse_duration(min_runtime),
        command=tuple(command) if command else None,
        duration_s=parse_duration(duration) if duration is not None else None,
        gpu_model=gpu_model,
        submitted_at=ts,
        ts=ts,
        producer=producer or f"client/{user}",
    )


def publish(*evts: events.Event, bootstrap: str | None = None) -> list[int]:
    """Publish events in order and wait for the broker's acknowledgement; returns each record's offset."""
    from apportion.bus.producer import EventProducer

    conn = Connection.resolve(bootstrap=bootstrap)
    producer = EventProducer(
        conn.bootstrap, client_id="apportion-client", max_block_ms=8000, bootstrap_timeout_ms=5_000
    )
    try:
        futures = [producer.send(ev) for ev in evts]
        producer.flush()
        return [int(f.get(timeout=10).offset) for f in futures]
    finally:
        producer.close()


def submit(*, bootstrap: str | None = None, **kwargs: object) -> events.JobSubmitted:
    """Validate and publish a submission; returns the event (``.job_id``).

    Keyword arguments are those of :func:`build_submission`.
    """
    ev = build_submission(**kwargs)  # type: ignore[arg-type]
    publish(ev, bootstrap=bootstrap)
    return ev


def cancel(job_id: str, *, user: str, reason: str = "", bootstrap: str | None = None) -> events.JobCancelRequested:
    """Ask to cancel ``job_id``; returns the published request."""
    now = datetime.now(UTC)
    ev = events.JobCancelRequested(job_id=job_id, user=user, reason=reason, ts=now, producer=f"client/{user}")
    publish(ev, bootstrap=bootstrap)
    return ev


class VerdictWatcher:
    """Waits for the dispatcher's answer to a submission: ``JobQueued`` or ``JobRejected``.

    Open it *before* publishing (it starts at the current end of
    ``apportion.jobs``), then call :meth:`wait`. Reads only, joins no
    consumer group, commits nothing.

    Args:
        job_id: the submission's job id (the record key on ``apportion.jobs``).
        bootstrap: Kafka bootstrap (resolved as :mod:`apportion.settings`).

    Raises:
        LookupError: ``apportion.jobs`` does not exist (the namespace was never provisioned).
    """

    def __init__(self, job_id: str, *, bootstrap: str | None = None) -> None:
        from kafka import KafkaConsumer, TopicPartition

        from apportion.topics import JOBS

        self.job_id = job_id
        self._key = job_id.encode("utf-8")
        conn = Connection.resolve(bootstrap=bootstrap)
        self._kc = KafkaConsumer(
            bootstrap_servers=conn.bootstrap,
            group_id=None,
            enable_auto_commit=False,
            request_timeout_ms=10_000,
            bootstrap_timeout_ms=5_000,
        )
        self._kc.topics()  # loads the cluster metadata, so the partitions below are known
        parts = [TopicPartition(JOBS.name, p) for p in sorted(self._kc.partitions_for_topic(JOBS.name) or ())]
        if not parts:
            self._kc.close()
            raise LookupError(
                f"topic {JOBS.name} does not exist at {conn.bootstrap}: the namespace is not provisioned "
                "(python -m apportion.bus.provision, or apportion stack up)"
            )
        self._kc.assign(parts)
        self._kc.seek_to_end()
        for tp in parts:
            self._kc.position(tp)  # pin the end now, before the submission is published

    def wait(self, timeout_s: float) -> events.Event | None:
        """The verdict, or ``None`` when none arrived within ``timeout_s`` wall seconds."""
        import time

        end = time.monotonic() + timeout_s
        try:
            while (left := end - time.monotonic()) > 0:
                batch = self._kc.poll(timeout_ms=int(min(left, 0.5) * 1000))
                for recs in batch.values():
                    for rec in recs:
                        if rec.key != self._key:
                            continue
                        try:
                            ev = events.decode(rec.value)
                        except events.DecodeError:
                            continue
                        if isinstance(ev, (events.JobQueued, events.JobRejected)) and ev.job_id == self.job_id:
                            return ev
            return None
        finally:
            self._kc.close()
