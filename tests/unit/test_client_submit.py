"""``apportion.client.submit``: typed arguments, the verdict when asked to wait, typed errors, nothing published
for a submission the schema refuses. Kafka is replaced by recorders (the client's two edges: ``publish`` and
``VerdictWatcher``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from apportion import client, events
from apportion.identity.canonical import signer_of
from tests.kit.signing import identity

ALICE = identity("alice")
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


class Recorder:
    """Stands in for Kafka: records what is published and answers the watcher with ``answer``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, answer: events.Event | None = None) -> None:
        self.published: list[events.JobSubmitted] = []
        self.watched: list[str] = []
        self.closed = 0
        rec = self

        class Watcher:
            def __init__(self, job_ids: list[str]) -> None:
                self.job_ids = job_ids
                rec.watched.extend(job_ids)

            @classmethod
            def for_submissions(cls, subs: list[events.JobSubmitted], *, bootstrap: str | None = None) -> Watcher:
                return cls([s.job_id for s in subs])

            def wait_all(self, timeout_s: float) -> list[events.Event | None]:
                return [None if answer is None else answer.model_copy(update={"job_id": j}) for j in self.job_ids]

            def close(self) -> None:
                rec.closed += 1

        def publish(*evts: events.Event, bootstrap: str | None = None) -> list[int]:
            self.published.extend(e for e in evts if isinstance(e, events.JobSubmitted))
            return list(range(len(evts)))

        def no_identity(*_: Any, **__: Any) -> Any:
            raise AssertionError("the identity is looked up only for a valid submission")

        monkeypatch.setattr(client, "publish", publish)
        monkeypatch.setattr(client, "VerdictWatcher", Watcher)
        monkeypatch.setattr(client, "identity_for", no_identity)


def test_without_wait_it_returns_the_signed_submission_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    kafka = Recorder(monkeypatch)
    ev = client.submit(
        budget="lab/a",
        gpus=2,
        min_runtime="2h",
        command=["python", "train.py"],
        time_limit="4h",
        env={"SEED": "7"},
        hold=True,
        job_id="alice-1",
        identity=ALICE,
        now=NOW,
    )
    assert kafka.published == [ev] and kafka.watched == []
    assert (ev.job_id, ev.user, ev.gpus_per_replica, ev.min_runtime_s, ev.time_limit_s) == (
        "alice-1",
        "alice",
        2,
        7200.0,
        14400.0,
    )
    assert (ev.env, ev.hold, ev.command) == ({"SEED": "7"}, True, ("python", "train.py"))
    assert signer_of(events.encode(ev)) == ALICE.public_key


def test_with_wait_it_returns_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    queued = events.JobQueued(
        job_id="x",
        budget="lab/a",
        user="alice",
        allocated=True,
        gpus_per_replica=1,
        replicas=1,
        min_runtime_s=60.0,
        duration_s=60.0,
        submitted_at=NOW,
        ts=NOW,
    )
    kafka = Recorder(monkeypatch, queued)
    verdict = client.submit(budget="lab/a", gpus=1, min_runtime=60, duration=60, identity=ALICE, wait=5)
    assert isinstance(verdict, events.JobQueued) and verdict.job_id == kafka.watched[0] == kafka.published[0].job_id


@pytest.mark.parametrize(
    "reason,kwargs,bound",
    [
        (events.RejectReason.NOT_A_MEMBER, {"gpus": 1}, None),
        (events.RejectReason.UNSATISFIABLE_TOPOLOGY, {"gpus": 8, "replicas": 5, "topology_bound": "block"}, "block"),
    ],
)
def test_a_rejection_is_returned_with_its_reason(
    monkeypatch: pytest.MonkeyPatch, reason: events.RejectReason, kwargs: dict[str, Any], bound: str | None
) -> None:
    rejected = events.JobRejected(job_id="x", budget="lab/a", user="alice", reason=reason, message="why", ts=NOW)
    kafka = Recorder(monkeypatch, rejected)
    verdict = client.submit(budget="lab/a", min_runtime=60, duration=60, identity=ALICE, wait=5, **kwargs)
    assert [e.topology_bound for e in kafka.published] == [bound]
    assert isinstance(verdict, events.JobRejected) and verdict.reason is reason


def test_no_verdict_in_time_raises_naming_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    kafka = Recorder(monkeypatch, None)
    with pytest.raises(client.NoVerdict) as err:
        client.submit(budget="lab/a", gpus=1, duration=60, job_id="alice-9", identity=ALICE, wait=0.5)
    assert isinstance(err.value, client.ApportionError) and err.value.job_id == "alice-9"
    assert str(err.value) == "no verdict from the dispatcher within 0.5 s for alice-9; the submission is in the log"
    assert [e.job_id for e in kafka.published] == ["alice-9"]


@pytest.mark.parametrize(
    "kwargs,field,message",
    [
        ({"gpus": 0, "duration": 60}, "gpus_per_replica", "Input should be greater than or equal to 1"),
        ({"gpus": 1}, "job", "a job needs a command (real workload) or duration_s (simulated workload)"),
        (
            {"gpus": 1, "duration": 60, "min_runtime": "soon"},
            "min_runtime_s",
            "bad duration 'soon': use seconds or forms like 90s, 30m, 2h, 1d12h",
        ),
        ({"gpus": 1, "duration": 60, "env": {"PATH": "/x"}}, "env", "env name 'PATH' is reserved"),
        ({"gpus": 1, "duration": 60, "time_limit": "1h", "time_limit_s": 60.0}, "time_limit_s", "give time_limit"),
        ({"gpus": 1, "duration": 60, "job_id": "a b"}, "job_id", "invalid job id 'a b'"),
        ({"gpus": 8, "replicas": 2, "duration": 60, "topology_bound": "row"}, "topology_bound", "Input should be"),
    ],
)
def test_an_invalid_submission_raises_the_field_and_publishes_nothing(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], field: str, message: str
) -> None:
    kafka = Recorder(monkeypatch)
    with pytest.raises(client.InvalidSubmission) as err:
        client.submit(budget="lab/a", user="alice", wait=5, **kwargs)
    assert isinstance(err.value, client.ApportionError) and isinstance(err.value, ValueError)
    assert err.value.field == field and err.value.message.startswith(message)
    assert str(err.value) == f"invalid submission: {field}: {err.value.message}"
    assert kafka.published == [] and kafka.watched == []


def test_submit_array_publishes_one_signed_record_for_every_element(monkeypatch: pytest.MonkeyPatch) -> None:
    kafka = Recorder(monkeypatch)
    ev = client.submit_array(
        "0-99%8", budget="lab/a", gpus=1, min_runtime="30m", command=["python", "sweep.py"], job_id="sweep-7",
        identity=ALICE, now=NOW,
    )  # fmt: skip
    assert kafka.published == [ev] and isinstance(ev, events.JobSubmitted)
    assert (ev.array, len(ev.job_ids), ev.job_ids[:2], ev.array_spec and ev.array_spec.throttle) == (
        "0-99%8",
        100,
        ("sweep-7_0", "sweep-7_1"),
        8,
    )
    assert signer_of(events.encode(ev)) == ALICE.public_key
    with pytest.raises(client.InvalidSubmission) as err:
        client.submit_array("9-0", budget="lab/a", gpus=1, duration=60, identity=ALICE)
    assert err.value.field == "array" and "ends below its start" in err.value.message


def test_submit_many_publishes_once_and_returns_each_verdict_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    queued = events.JobQueued(
        job_id="x", budget="lab/a", user="alice", allocated=True, gpus_per_replica=1, replicas=1, min_runtime_s=60.0,
        duration_s=60.0, submitted_at=NOW, ts=NOW,
    )  # fmt: skip
    calls: list[int] = []
    kafka = Recorder(monkeypatch, queued)
    inner = client.publish

    def counted(*evts: events.Event, bootstrap: str | None = None) -> list[int]:
        calls.append(len(evts))
        return inner(*evts)

    monkeypatch.setattr(client, "publish", counted)
    jobs = [{"budget": "lab/a", "gpus": 1, "duration": 60, "job_id": f"m-{i}", "now": NOW} for i in range(3)]
    verdicts = client.submit_many(jobs, identity=ALICE, wait=5)
    assert calls == [3] and [e.job_id for e in kafka.published] == ["m-0", "m-1", "m-2"]
    assert [(type(v).__name__, v.job_id) for v in verdicts] == [
        ("JobQueued", "m-0"),
        ("JobQueued", "m-1"),
        ("JobQueued", "m-2"),
    ]
    with pytest.raises(client.InvalidSubmission) as err:
        client.submit_many([*jobs, {"budget": "lab/a", "gpus": 0, "duration": 60}], identity=ALICE)
    assert err.value.field == "jobs[3].gpus_per_replica"


class FakeProducer:
    """Stands in for :class:`apportion.bus.producer.EventProducer` in :func:`client.publish`: keeps its settings."""

    made: list[dict[str, Any]] = []

    def __init__(self, bootstrap: str, **config: Any) -> None:
        FakeProducer.made.append(config)
        self.sent = 0

    def send(self, ev: events.Event) -> Any:
        self.sent += 1
        offset = self.sent - 1

        class Acked:
            def get(self, timeout: float) -> Any:
                return type("Meta", (), {"offset": offset})()

        return Acked()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("n", "linger_ms"), [(1, 0), (2, 2), (5, 2)], ids=["one is sent at once", "two", "five"])
def test_one_event_is_published_without_linger_and_several_with_the_client_linger(
    monkeypatch: pytest.MonkeyPatch, n: int, linger_ms: int
) -> None:
    from apportion.bus import producer

    FakeProducer.made = []
    monkeypatch.setattr(producer, "EventProducer", FakeProducer)
    evs = [events.BudgetSet(path=f"lab/b{i}", share=1.0, ts=NOW, producer="test") for i in range(n)]
    assert client.publish(*evs, bootstrap="127.0.0.1:9") == list(range(n))
    assert [m["linger_ms"] for m in FakeProducer.made] == [linger_ms]


def test_a_kafka_that_cannot_be_reached_is_an_apportion_error_with_kafkas_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from kafka.errors import KafkaTimeoutError

    kafka = Recorder(monkeypatch)
    down = KafkaTimeoutError("Unable to bootstrap from 127.0.0.1:1")

    def unreachable(*_: Any, **__: Any) -> list[int]:
        raise down

    monkeypatch.setattr(client, "publish", unreachable)
    submit: dict[str, Any] = {"budget": "lab/a", "gpus": 1, "min_runtime": "1h", "duration": "1h"}
    calls = [
        lambda: client.submit(**submit, identity=ALICE, bootstrap="127.0.0.1:1"),
        lambda: client.submit_many([submit], identity=ALICE, bootstrap="127.0.0.1:1"),
        lambda: client.cancel("j1", identity=ALICE, bootstrap="127.0.0.1:1"),
    ]
    for call in calls:
        with pytest.raises(client.ApportionError) as got:
            call()
        assert isinstance(got.value, client.KafkaFailure) and isinstance(got.value, ConnectionError)
        assert got.value.error is down and got.value.__cause__ is down
        assert str(got.value) == "Kafka at 127.0.0.1:1: KafkaTimeoutError: Unable to bootstrap from 127.0.0.1:1"
    assert kafka.published == []
