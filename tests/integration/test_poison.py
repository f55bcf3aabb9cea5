"""Poison records on the real broker: the services stay up and say why (issue 17).

One test per poison class (docs/reliability.md). Each writes the poison
record to ``apportion.submissions`` with a raw producer, waits until the
dispatcher's dead letter for it carries the exact reason, then submits a
normal job and waits until it is placed: the dispatcher is still deciding.
The poison job is never queued. A last test puts tombstones on the topics
accounting and policy read and checks that both dead-letter them and keep
publishing.

The services run in-process, started once for the module by
``running_cluster`` of the live cluster kit (a topic namespace and Redis database
of the module's own) on a module-scoped event loop: each test's records
have ids and keys of their own, so the classes stay separate tests without
starting the four services nine times. Every wait is bounded by a deadline
(``Cluster.until``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from apportion import events, topics
from apportion.client import identity_for
from apportion.settings import topic_name
from tests.kit.live_cluster import Cluster, of_job, running_cluster

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(kafka_bootstrap: str, redis_url: str) -> AsyncIterator[Cluster]:
    """One running cluster (2 nodes of 4 GPUs) for every test of the module."""
    with pytest.MonkeyPatch.context() as mp:
        async with running_cluster(kafka_bootstrap, redis_url, mp) as c:
            yield c


TIME = events.NOT_ISO_TIME


def submission(cluster: Cluster, job_id: str, **over: Any) -> dict[str, Any]:
    """The JSON of a valid submission of ``job_id`` (1 GPU, lab/a), with ``over`` applied."""
    now = cluster.clock.now()
    ev = events.JobSubmitted(
        job_id=job_id,
        budget="lab/a",
        user="alice",
        gpus_per_replica=1,
        min_runtime_s=60.0,
        duration_s=30.0,
        submitted_at=now,
        ts=now,
        producer="test",
    )
    ev = identity_for("alice", bootstrap=cluster.bootstrap).sign(ev)  # the dev keyring (tests/conftest.py)
    d = json.loads(events.encode(ev))
    d.update(over)
    return d


def text(d: dict[str, Any], **bare: str) -> bytes:
    """Compact JSON of ``d`` with the fields named in ``bare`` written as raw JSON tokens (NaN, Infinity)."""
    out = json.dumps({k: ("@" + k if k in bare else v) for k, v in d.items()}, separators=(",", ":"))
    for k, token in bare.items():
        out = out.replace(json.dumps("@" + k), token)
    return out.encode()


# Each case: (key, value, expected reason) for a poison job id, built on the running cluster.
Case = Callable[[Cluster, str], tuple[bytes | None, bytes | None, str]]

CASES: dict[str, Case] = {
    "Infinity": lambda c, j: (
        j.encode(),
        text(submission(c, j), duration_s="Infinity"),
        "duration_s: non-finite number Infinity",
    ),
    "NaN": lambda c, j: (
        j.encode(),
        text(submission(c, j), min_runtime_s="NaN"),
        "min_runtime_s: non-finite number NaN",
    ),
    "null value": lambda c, j: (j.encode(), None, "null record value (tombstone)"),
    "naive datetime": lambda c, j: (
        j.encode(),
        text(submission(c, j, submitted_at="2026-01-05T09:00:00")),
        f'submitted_at: {TIME}, got "2026-01-05T09:00:00"',
    ),
    "integer time": lambda c, j: (
        j.encode(),
        text(submission(c, j, submitted_at=12345)),
        f"submitted_at: {TIME}, got 12345",
    ),
    "wrong key": lambda c, j: (
        b"someone-else",
        text(submission(c, j)),
        f"key: record key 'someone-else' is not the event's key '{j}'",
    ),
    "newer schema_version": lambda c, j: (
        j.encode(),
        text(submission(c, j, schema_version=9)),
        "schema_version: JobSubmitted schema_version 9 is newer than this reader supports "
        f"({events.JobSubmitted.model_fields['schema_version'].default})",
    ),
    "garbage bytes": lambda c, j: (
        j.encode(),
        b"\x89PNG\r\n",
        "not valid JSON: 'utf-8' codec can't decode byte 0x89 in position 0: invalid start byte",
    ),
}


def letters_for(evs: list[Any], key: str) -> list[events.DeadLetter]:
    return [
        e
        for e in evs
        if isinstance(e, events.DeadLetter) and e.source_topic == topic_name(topics.SUBMISSIONS) and e.source_key == key
    ]


async def the_next_submission_is_placed(cluster: Cluster, job_id: str) -> list[Any]:
    cluster.submit(job_id, "lab/a", gpus=1, min_runtime_s=60, duration_s=30)
    return await cluster.until(lambda evs: "JobPlaced" in of_job(evs, job_id), f"{job_id} to be placed")


@pytest.mark.parametrize("poison", sorted(CASES))
async def test_a_poison_submission_is_dead_lettered_and_the_dispatcher_goes_on(cluster: Cluster, poison: str) -> None:
    job = f"poison-{uuid.uuid4().hex[:6]}"
    key, value, reason = CASES[poison](cluster, job)
    assert key is not None  # every case keys its record
    cluster.producer.send_raw(topic_name(topics.SUBMISSIONS), value, key).get(timeout=30)
    evs = await cluster.until(lambda evs: letters_for(evs, key.decode()), f"the dead letter of the {poison} record")
    (letter,) = {d.event_id: d for d in letters_for(evs, key.decode())}.values()  # one id, however often met
    assert letter.error == reason
    assert letter.producer == "dispatcher"
    assert letter.original_bytes() == (value or b"")
    assert letter.event_id == events.det_id(
        "DeadLetter", letter.source_topic, letter.source_partition, letter.source_offset
    )
    evs = await the_next_submission_is_placed(cluster, f"after-{job}")
    assert "JobQueued" not in of_job(evs, job)


async def test_a_reused_event_id_is_dead_lettered_and_the_first_job_runs(cluster: Cluster) -> None:
    first = f"first-{uuid.uuid4().hex[:6]}"
    reuse = f"reuse-{uuid.uuid4().hex[:6]}"
    original = submission(cluster, first)
    cluster.producer.send_raw(topic_name(topics.SUBMISSIONS), text(original), first.encode()).get(timeout=30)
    await cluster.until(lambda evs: "JobQueued" in of_job(evs, first), "the first job to be queued")
    copy = submission(cluster, reuse, event_id=original["event_id"])  # another job under the same id
    cluster.producer.send_raw(topic_name(topics.SUBMISSIONS), text(copy), reuse.encode()).get(timeout=30)
    cluster.producer.send_raw(topic_name(topics.SUBMISSIONS), text(original), first.encode()).get(timeout=30)  # a retry
    evs = await cluster.until(lambda evs: letters_for(evs, reuse), "the dead letter of the reused id")
    (letter,) = letters_for(evs, reuse)
    assert letter.error == f"event_id reused: {original['event_id']} was read before with a different payload"
    evs = await the_next_submission_is_placed(cluster, f"after-{reuse}")
    assert "JobQueued" not in of_job(evs, reuse)
    assert of_job(evs, first).count("JobQueued") == 1 and not letters_for(evs, first)  # the retry: a duplicate


async def test_tombstones_on_the_topics_of_accounting_and_policy_are_dead_lettered_and_both_go_on(
    cluster: Cluster,
) -> None:
    def latest(evs: list[Any], cls: type[Any]) -> Any:
        return max((e for e in evs if isinstance(e, cls)), key=lambda e: e.ts, default=None)

    evs = await cluster.until(lambda evs: latest(evs, events.FairShareRanking), "a first ranking")
    before = latest(evs, events.FairShareRanking).ts
    cluster.producer.send_raw(topic_name(topics.JOBS), None, b"tomb-job").get(timeout=30)
    cluster.producer.send_raw(topic_name(topics.BUDGETS), None, b"tomb-budget").get(timeout=30)

    def dead(evs: list[Any]) -> set[tuple[str, str, str]]:
        return {
            (e.producer, e.source_key, e.error)
            for e in evs
            if isinstance(e, events.DeadLetter) and e.source_key in ("tomb-job", "tomb-budget")
        }

    want = {
        ("accounting", "tomb-job", events.NULL_VALUE),
        ("accounting", "tomb-budget", events.NULL_VALUE),
        ("policy", "tomb-budget", events.NULL_VALUE),
    }
    await cluster.until(lambda evs: want <= dead(evs), "accounting and policy to dead-letter the tombstones")
    cluster.submit("after-tombs", "lab/a", gpus=1, min_runtime_s=60, duration_s=30)
    await cluster.until(
        lambda evs: "JobCompleted" in of_job(evs, "after-tombs") and latest(evs, events.FairShareRanking).ts > before,
        "the next job to complete and a new ranking",
    )
