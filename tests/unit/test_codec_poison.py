"""Poison records: every class the readers refuse, with the exact reason its dead letter carries.

The codec (:func:`apportion.events.decode`, :func:`apportion.events.check_record`)
and the reader edge (:mod:`apportion.bus.intake`) decide what every reader
accepts; docs/reliability.md lists the classes. Each case is one poison
applied to a valid payload. Both decode paths (the fast one and the slow
one that parses the JSON itself) must give the same reason: each case is
also decoded with a harmless ``NaN`` in a string, which sends it the slow way.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from apportion import events
from apportion.bus.intake import (
    IdLedger,
    Intake,
    apply_failure,
    dead_letter,
    screen,
)
from apportion.logrecord import LogRecord
from apportion.settings import topic_name
from apportion.topics import JOBS, SUBMISSIONS
from tests.kit.narrowing import narrow

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
FIXTURES = Path(__file__).resolve().parents[1] / "kit" / "fixtures" / "events"


def submitted(**over: Any) -> dict[str, Any]:
    ev = events.JobSubmitted(
        event_id=events.det_id("test", "j1"),
        job_id="j1",
        budget="lab/a",
        user="alice",
        gpus_per_replica=1,
        min_runtime_s=60.0,
        duration_s=600.0,
        submitted_at=T0,
        ts=T0,
        producer="test",
    )
    d = json.loads(events.encode(ev))
    d.update(over)
    return d


def raw_of(d: dict[str, Any], *, replace: dict[str, str] | None = None) -> bytes:
    """Compact JSON of ``d``; ``replace`` swaps a quoted marker for raw JSON text (bare tokens)."""
    text = json.dumps(d, separators=(",", ":"))
    for marker, token in (replace or {}).items():
        text = text.replace(json.dumps(marker), token)
    return text.encode()


def placed_with(**victim: Any) -> bytes:
    d = json.loads((FIXTURES / "JobPlaced.v1.json").read_text())
    d["decision"]["victims"][0].update(victim)
    return raw_of(d)


def ranking_with(ratio: Any) -> bytes:
    d = json.loads((FIXTURES / "FairShareRanking.v1.json").read_text())
    d["budgets"][0]["ratio"] = ratio
    return raw_of(d)


TIME = events.NOT_ISO_TIME

# (case id, record value, exact reason)
POISON = [
    ("tombstone (null value)", None, "null record value (tombstone)"),
    (
        "bare Infinity",
        raw_of(submitted(duration_s="@"), replace={"@": "Infinity"}),
        "duration_s: non-finite number Infinity",
    ),
    (
        "bare -Infinity",
        raw_of(submitted(min_runtime_s="@"), replace={"@": "-Infinity"}),
        "min_runtime_s: non-finite number -Infinity",
    ),
    ("bare NaN", raw_of(submitted(duration_s="@"), replace={"@": "NaN"}), "duration_s: non-finite number NaN"),
    ("Infinity as a string", raw_of(submitted(duration_s="Infinity")), "duration_s: non-finite number Infinity"),
    ("NaN as a string", raw_of(submitted(checkpoint_interval_s="NaN")), "checkpoint_interval_s: non-finite number NaN"),
    (
        "a literal that overflows",
        raw_of(submitted(duration_s="@"), replace={"@": "1e999"}),
        "duration_s: non-finite number Infinity",
    ),
    ("NaN in a field nobody reads", raw_of(submitted(extra="@"), replace={"@": "NaN"}), "extra: non-finite number NaN"),
    (
        "Infinity nested in an unknown list",
        raw_of(submitted(extra=[1, "@"]), replace={"@": "Infinity"}),
        "extra.1: non-finite number Infinity",
    ),
    (
        "NaN in a nested ratio",
        placed_with(victim_ratio="NaN"),
        "decision.victims.0.victim_ratio: non-finite number NaN",
    ),
    ("-Infinity in a ratio", ranking_with("-Infinity"), "budgets.0.ratio: non-finite number -Infinity"),
    ("integer time", raw_of(submitted(submitted_at=12345)), f"submitted_at: {TIME}, got 12345"),
    ("float time", raw_of(submitted(ts=1.7e9)), f"ts: {TIME}, got 1700000000.0"),
    ("numeric string time", raw_of(submitted(submitted_at="12345")), f'submitted_at: {TIME}, got "12345"'),
    (
        "naive time",
        raw_of(submitted(submitted_at="2026-01-05T09:00:00")),
        f'submitted_at: {TIME}, got "2026-01-05T09:00:00"',
    ),
    ("date without time", raw_of(submitted(ts="2026-01-05")), f'ts: {TIME}, got "2026-01-05"'),
    (
        "naive nested time",
        placed_with(protected_until="2024-01-01T11:30:00"),
        f'decision.victims.0.protected_until: {TIME}, got "2024-01-01T11:30:00"',
    ),
    (
        "time key with blanks",
        raw_of(submitted()).replace(b'"submitted_at":', b'"submitted_at" : 12345, "x":'),
        f"submitted_at: {TIME}, got 12345",
    ),
    (
        "time spelled with escapes",
        raw_of(submitted()).replace(b'"submitted_at":', b'"submitted\\u005fat":"12345","x":'),
        f'submitted_at: {TIME}, got "12345"',
    ),
    (
        "a later duplicate key wins",
        raw_of(submitted())[:-1] + b',"submitted_at":"12345"}',
        f'submitted_at: {TIME}, got "12345"',
    ),
    (
        "garbage bytes",
        b"\x89PNG\r\n",
        "not valid JSON: 'utf-8' codec can't decode byte 0x89 in position 0: invalid start byte",
    ),
    ("not an object", b"[1, 2]", "an event must be a JSON object, got list"),
    (
        "nested too deeply",
        b'{"type":"JobSubmitted","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "not valid JSON: nested too deeply",
    ),
]


@pytest.mark.parametrize(("value", "reason"), [c[1:] for c in POISON], ids=[c[0] for c in POISON])
def test_a_poison_value_is_refused_with_its_reason(value: bytes | None, reason: str) -> None:
    with pytest.raises(events.DecodeError) as err:
        events.decode(value)
    assert str(err.value) == reason


@pytest.mark.parametrize(
    ("value", "reason"),
    [c[1:] for c in POISON if c[1] is not None and c[1].startswith(b'{"event_id"')],
    ids=[c[0] for c in POISON if c[1] is not None and c[1].startswith(b'{"event_id"')],
)
def test_the_slow_path_gives_the_same_reason(value: bytes, reason: str) -> None:
    slow = value.replace(b'"producer":"', b'"producer":"NaN-', 1)  # a harmless NaN in a string: the slow path
    assert slow != value
    with pytest.raises(events.DecodeError) as err:
        events.decode(slow)
    assert str(err.value) == reason


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(ranking_with("Infinity"), id="+inf ratio as the encoder writes it"),
        pytest.param(raw_of(submitted(submitted_at="2026-01-05T10:00:00+01:00")), id="offset time"),
        pytest.param(raw_of(submitted(job_id="12345")), id="numeric string that is not a time"),
        pytest.param(raw_of(submitted(user="NaN-Infinity-\\u")), id="the words in strings"),
        pytest.param(raw_of(submitted(), replace={}).replace(b",", b", "), id="blanks between fields"),
        pytest.param(raw_of(submitted(extra="@"), replace={"@": "1e999"}), id="overflow in a field nobody reads"),
        pytest.param(raw_of(submitted(extra="@", user="NaN"), replace={"@": "1e999"}), id="the same on the slow path"),
    ],
)
def test_what_is_not_poison_still_decodes(value: bytes) -> None:
    assert events.decode(value).type in ("JobSubmitted", "FairShareRanking")


def test_an_infinite_ratio_survives_the_round_trip() -> None:
    ev = narrow(events.FairShareRanking, events.decode(ranking_with("Infinity")))
    assert ev.budgets[0].ratio == float("inf")
    assert events.decode(events.encode(ev)) == ev


# --------------------------------------------------------------------------- key and topic


JOB = events.JobSubmitted.model_validate(submitted())


@pytest.mark.parametrize(
    ("key", "topic", "reason"),
    [
        ("other", None, "key: record key 'other' is not the event's key 'j1'"),
        (b"other", topic_name(SUBMISSIONS), "key: record key 'other' is not the event's key 'j1'"),
        (None, None, "key: record key missing, the event's key is 'j1'"),
        (
            b"j1",
            topic_name(JOBS),
            "type: JobSubmitted does not belong on apportion.jobs (it is written to apportion.submissions)",
        ),
    ],
    ids=["wrong key", "wrong key as bytes", "no key", "type on another registry topic"],
)
def test_a_record_that_disagrees_with_its_event_is_refused(key: Any, topic: str | None, reason: str) -> None:
    with pytest.raises(events.DecodeError) as err:
        screen(events.encode(JOB), key, topic)
    assert str(err.value) == reason


def test_the_right_key_on_the_right_topic_or_a_topic_outside_the_registry_passes() -> None:
    assert screen(events.encode(JOB), b"j1", topic_name(SUBMISSIONS)) == JOB
    assert screen(events.encode(JOB), "j1", "test.scratch") == JOB


# --------------------------------------------------------------------------- ids


def test_same_id_same_payload_is_a_duplicate_and_another_payload_is_a_reused_id() -> None:
    ledger = IdLedger()
    assert ledger.check(JOB) is False
    assert ledger.check(JOB) is True
    later = JOB.model_copy(update={"ts": datetime(2026, 1, 6, tzinfo=UTC), "producer": "retry"})
    assert ledger.check(later) is True  # envelope only: the same fact written again
    other = JOB.model_copy(update={"job_id": "j2"})
    with pytest.raises(events.DecodeError) as err:
        ledger.check(other)
    assert str(err.value) == f"event_id reused: {JOB.event_id} was read before with a different payload"


def test_a_decision_re_derived_by_another_leader_is_a_duplicate() -> None:
    d = json.loads((FIXTURES / "JobPlaced.v1.json").read_text())
    first = narrow(events.JobPlaced, events.decode(raw_of(d)))
    again = first.model_copy(
        update={"fencing_token": 9, "decision": first.decision.model_copy(update={"rank": 7, "ratio": 0.5})}
    )
    moved = first.model_copy(update={"placements": (events.Placement(node_id="n9", gpus=(0,)),)})
    assert events.payload_digest(again) == events.payload_digest(first)
    assert events.payload_digest(moved) != events.payload_digest(first)


def test_the_ledger_is_bounded() -> None:
    ledger = IdLedger(capacity=2)
    evs = [JOB.model_copy(update={"event_id": uuid.uuid4()}) for _ in range(3)]
    for e in evs:
        ledger.check(e)
    assert len(ledger) == 2
    assert ledger.check(evs[0]) is False  # forgotten, so new again


# --------------------------------------------------------------------------- dead letters


def test_dead_letter_has_the_id_of_the_record_position_whoever_writes_it() -> None:
    a = dead_letter(topic="t", partition=1, offset=7, key=b"k", value=None, reason="r", ts=T0, producer="dispatcher")
    b = dead_letter(
        topic="t", partition=1, offset=7, key="k", value=None, reason="r", ts=datetime.now(UTC), producer="policy"
    )
    assert a.event_id == b.event_id == events.det_id("DeadLetter", "t", 1, 7)
    assert a.original_bytes() == b"" and a.source_key == "k" and events.key_of(a) == "k"


class Rec:
    """The fields of a kafka-python record the reader edge reads."""

    def __init__(
        self, value: bytes | None, key: bytes | None, offset: int = 0, topic: str = topic_name(SUBMISSIONS)
    ) -> None:
        self.topic, self.partition, self.offset, self.key, self.value, self.timestamp = topic, 0, offset, key, value, 0


def test_intake_dead_letters_poison_drops_duplicates_and_survives_a_failing_fold() -> None:
    letters: list[events.DeadLetter] = []
    intake = Intake("svc", lambda: T0, on_dead=letters.append)
    good = Rec(events.encode(JOB), b"j1", 0)
    assert intake.admit(good) == JOB
    assert intake.admit(Rec(events.encode(JOB), b"j1", 1)) is None  # duplicate
    assert intake.admit(Rec(None, b"j1", 2)) is None
    reused = JOB.model_copy(update={"job_id": "j2"})
    assert intake.admit(Rec(events.encode(reused), b"j2", 3)) is None

    def fold(_: events.Event) -> None:
        raise OverflowError("cannot convert float infinity to integer")

    assert intake.apply(good, fold, JOB) is None
    assert [(d.source_offset, d.error) for d in letters] == [
        (2, "null record value (tombstone)"),
        (3, f"event_id reused: {JOB.event_id} was read before with a different payload"),
        (0, "apply failed: OverflowError: cannot convert float infinity to integer"),
    ]
    assert (intake.stats.events, intake.stats.duplicates, intake.stats.dead_lettered) == (1, 1, 3)
    assert apply_failure(ValueError("x")) == "apply failed: ValueError: x"


# --------------------------------------------------------------------------- export


def test_export_keeps_a_tombstone_and_reading_it_back_refuses_it(tmp_path: Path) -> None:
    from apportion.audit.source import iter_export, write_export

    recs = [
        LogRecord(topic_name(SUBMISSIONS), 0, 0, "j1", 1, events.encode(JOB), JOB),
        LogRecord(topic_name(SUBMISSIONS), 0, 1, "j1", 2, None, None, "null record value (tombstone)"),
        LogRecord(topic_name(SUBMISSIONS), 0, 2, "bad", 3, b"\xff", None, "x"),
    ]
    path = tmp_path / "log.jsonl.gz"
    assert write_export(recs, path, topic_names=[topic_name(SUBMISSIONS)], exported_at="now") == 3
    back = list(iter_export(path))
    assert [r.raw for r in back] == [events.encode(JOB), None, b"\xff"]
    assert back[0].event == JOB
    assert back[1].event is None and back[1].error == "null record value (tombstone)"
    assert back[2].event is None and back[2].error is not None and back[2].error.startswith("not valid JSON")
