"""The event contract (rule D4.events): golden files, round trips, compatibility rules.

* every golden fixture in ``tests/kit/fixtures/events/`` decodes, forever (old
  versions through the upcasters);
* every event type has a golden file for its current version;
* every event round-trips through JSON (hypothesis, strategies derived from
  the models' fields and constraints);
* unknown fields are ignored, future versions rejected, naive timestamps
  rejected, and :class:`DecodeError` names the offending field.
"""

from __future__ import annotations

import enum
import json
import types
import typing
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import annotated_types
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from apportion import events as ev
from tests.kit.narrowing import narrow

GOLDEN = Path(__file__).resolve().parents[1] / "kit" / "fixtures" / "events"
GOLDEN_FILES = sorted(GOLDEN.glob("*.json"))


def _version(cls: type[ev.Event]) -> int:
    return int(cls.model_fields["schema_version"].default)


# --------------------------------------------------------------------------- golden files


def test_golden_files_exist_for_every_type_and_version() -> None:
    names = {p.name for p in GOLDEN_FILES}
    for type_name, cls in ev.EVENT_TYPES.items():
        for v in range(1, _version(cls) + 1):
            assert f"{type_name}.v{v}.json" in names, f"missing golden {type_name}.v{v}.json"


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[p.name for p in GOLDEN_FILES])
def test_golden_file_decodes(path: Path) -> None:
    raw = path.read_bytes()
    obj = json.loads(raw)
    event = ev.decode(raw)
    assert event.type == obj["type"] == path.name.split(".")[0]
    assert event.schema_version == _version(type(event))  # upcast to current
    assert str(event.event_id) == obj["event_id"]
    assert event.ts.tzinfo is not None and event.ts.utcoffset() == timedelta(0)
    # decoding is stable: what we re-encode decodes to the same event
    assert ev.decode(ev.encode(event)) == event


def test_job_submitted_v1_upcasts_to_gangs_and_explicit_units() -> None:
    event = ev.decode((GOLDEN / "JobSubmitted.v1.json").read_bytes())
    assert isinstance(event, ev.JobSubmitted)
    # v1 "gpus": 2, "min_runtime": 1800.0 -> one replica of 2 GPUs, 1800 s protection
    assert (event.gpus_per_replica, event.replicas, event.min_runtime_s) == (2, 1, 1800.0)
    assert event.allocated and event.gpus == 2


def test_job_submitted_v1_without_gpus_names_the_field() -> None:
    obj = json.loads((GOLDEN / "JobSubmitted.v1.json").read_bytes())
    del obj["gpus"]
    with pytest.raises(ev.DecodeError) as err:
        ev.decode(json.dumps(obj))
    assert err.value.field == "gpus"


def test_infinite_ratio_travels_as_a_string() -> None:
    event = narrow(ev.OccupancySnapshot, ev.decode((GOLDEN / "OccupancySnapshot.v1.json").read_bytes()))
    assert event.budgets[0].ratio == float("inf")
    assert b'"Infinity"' in ev.encode(event)


# --------------------------------------------------------------------------- compatibility


def _golden(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / f"{name}.v{_version(ev.EVENT_TYPES[name])}.json").read_bytes())


@pytest.mark.parametrize("type_name", sorted(ev.EVENT_TYPES))
def test_unknown_fields_are_ignored(type_name: str) -> None:
    obj = _golden(type_name)
    plain = ev.decode(json.dumps(obj))
    obj["added_by_a_newer_writer"] = {"nested": [1, 2, 3]}
    assert ev.decode(json.dumps(obj)) == plain


@pytest.mark.parametrize("type_name", sorted(ev.EVENT_TYPES))
def test_future_version_is_rejected(type_name: str) -> None:
    obj = _golden(type_name)
    obj["schema_version"] = _version(ev.EVENT_TYPES[type_name]) + 1
    with pytest.raises(ev.DecodeError) as err:
        ev.decode(json.dumps(obj))
    assert err.value.field == "schema_version"
    assert "newer" in err.value.reason


@pytest.mark.parametrize("field_name", ["ts", "submitted_at"])
def test_naive_timestamp_is_rejected(field_name: str) -> None:
    obj = _golden("JobSubmitted")
    obj[field_name] = "2024-01-01T12:00:00"
    with pytest.raises(ev.DecodeError) as err:
        ev.decode(json.dumps(obj))
    assert err.value.field == field_name


def test_non_utc_offset_is_normalised_to_utc() -> None:
    obj = _golden("JobCompleted")
    obj["ts"] = "2024-01-01T14:00:00+02:00"
    event = ev.decode(json.dumps(obj))
    assert event.ts == datetime(2024, 1, 1, 12, tzinfo=UTC)
    assert event.ts.utcoffset() == timedelta(0)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda o: o.update(gpus_per_replica=0), "gpus_per_replica"),
        (lambda o: o.pop("job_id"), "job_id"),
        (lambda o: o.update(replicas="many"), "replicas"),
        (lambda o: o.update(min_runtime_s=-1), "min_runtime_s"),
    ],
    ids=["gpus below 1", "missing job_id", "replicas not an int", "negative min runtime"],
)
def test_decode_error_names_the_field(mutate, field) -> None:
    obj = _golden("JobSubmitted")
    mutate(obj)
    with pytest.raises(ev.DecodeError) as err:
        ev.decode(json.dumps(obj))
    assert err.value.field == field
    assert field in str(err.value)


def test_decode_error_names_a_nested_field() -> None:
    obj = _golden("JobPlaced")
    del obj["placements"][1]["node_id"]
    with pytest.raises(ev.DecodeError) as err:
        ev.decode(json.dumps(obj))
    assert err.value.field == "placements.1.node_id"


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"type": "NoSuchEvent", "ts": "2024-01-01T00:00:00Z"}', "unknown event type"),
    ],
    ids=["not json", "not an object", "unknown type"],
)
def test_decode_error_for_whole_payload(raw: bytes, reason: str) -> None:
    with pytest.raises(ev.DecodeError) as err:
        ev.decode(raw)
    assert reason in err.value.reason


# --------------------------------------------------------------------------- round trips


def _bounds(metadata: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            out["min_value"] = m.ge
        elif isinstance(m, annotated_types.Gt):
            out["min_value"] = m.gt
            out["exclude_min"] = True
        elif isinstance(m, annotated_types.Le):
            out["max_value"] = m.le
        elif isinstance(m, annotated_types.Lt):
            out["max_value"] = m.lt
            out["exclude_max"] = True
        elif isinstance(m, annotated_types.MinLen):
            out["min_size"] = m.min_length
        elif isinstance(m, annotated_types.MaxLen):
            out["max_size"] = m.max_length
    return out


_TEXT = st.characters(blacklist_categories=["Cs"])  # a list: mypy infers a tuple literal as tuple[str]
_UTC_DATES = st.datetimes(
    min_value=datetime(2000, 1, 1),
    max_value=datetime(2100, 1, 1),
    timezones=st.sampled_from([UTC, timezone(timedelta(hours=5))]),
)


def strategy_for(annotation: Any, metadata: list[Any] | None = None) -> st.SearchStrategy:
    """A strategy producing valid-looking values of a field annotation."""
    b = _bounds(metadata or [])
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return st.sampled_from(typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return st.one_of([strategy_for(a, metadata) for a in typing.get_args(annotation)])
    if origin is typing.Annotated:
        inner, *extra = typing.get_args(annotation)
        return strategy_for(inner, list(metadata or []) + extra)
    if origin is tuple:
        args = typing.get_args(annotation)
        return st.lists(strategy_for(args[0]), max_size=3).map(tuple)
    if origin is dict:
        k, v = typing.get_args(annotation)
        return st.dictionaries(strategy_for(k), strategy_for(v), max_size=3)
    if annotation is type(None):
        return st.none()
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.integers(min_value=b.get("min_value", -(2**40)), max_value=b.get("max_value", 2**40))
    if annotation is float:
        if b:
            return st.floats(
                allow_nan=False,
                allow_infinity=False,
                **{k: v for k, v in b.items() if k != "min_size" and k != "max_size"},
            )
        return st.floats(allow_nan=False, allow_infinity=False)  # non-finite is refused (docs/reliability.md)
    if annotation is str:
        return st.text(_TEXT, min_size=b.get("min_size", 0), max_size=min(b.get("max_size", 20), 20))
    if annotation is datetime:
        return _UTC_DATES
    if annotation is uuid.UUID:
        return st.uuids()
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return st.sampled_from(list(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_strategy(annotation)
    raise NotImplementedError(f"no strategy for {annotation!r}")


def model_strategy(cls: type[BaseModel]) -> st.SearchStrategy:
    fields = {name: strategy_for(f.annotation, list(f.metadata)) for name, f in cls.model_fields.items()}
    for name in ev.RATIO_FIELDS & set(fields):  # a ratio may be +inf (travels as the string "Infinity")
        fields[name] = st.one_of(fields[name], st.just(float("inf")))
    if "schema_version" in fields:  # writers always write their current version
        fields["schema_version"] = st.just(cls.model_fields["schema_version"].default)

    @st.composite
    def build(draw):
        data = {name: draw(s) for name, s in fields.items()}
        try:
            return cls.model_validate(data)
        except ValidationError:
            assume(False)

    return build()


@pytest.mark.parametrize("type_name", sorted(ev.EVENT_TYPES))
def test_every_event_round_trips_through_json(type_name: str) -> None:
    cls = ev.EVENT_TYPES[type_name]

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(event=model_strategy(cls))
    def round_trip(event: ev.Event) -> None:
        raw = ev.encode(event)
        back = ev.decode(raw)
        assert back == event
        assert ev.encode(back) == raw
        assert ev.key_of(back) == ev.key_of(event)

    round_trip()


def test_submissions_past_the_longest_duration_are_refused() -> None:
    import pydantic
    import pytest as _pytest

    from apportion.events import MAX_SECONDS, JobSubmitted
    from apportion.timeutil import from_us

    ok: dict[str, Any] = {"job_id": "j", "budget": "lab/a", "user": "u", "gpus_per_replica": 1, "min_runtime_s": 60.0}
    ts = from_us(0)
    JobSubmitted(**ok, duration_s=MAX_SECONDS, submitted_at=ts, ts=ts, producer="t")
    for field in ("duration_s", "min_runtime_s", "checkpoint_interval_s"):
        args = {**ok, "duration_s": 10.0, field: MAX_SECONDS * 10}
        with _pytest.raises(pydantic.ValidationError, match=field):
            JobSubmitted(**args, submitted_at=ts, ts=ts, producer="t")


# --------------------------------------------------------------------------- "allocated": one definition


@pytest.mark.parametrize(
    ("min_runtime_s", "allocated"),
    [
        pytest.param(0.0, False, id="min runtime 0: unallocated (free, runs only on idle GPUs)"),
        pytest.param(1.0, True, id="min runtime 1 s: allocated (charged, protected)"),
        pytest.param(1e-6, True, id="any positive min runtime is allocated"),
    ],
)
def test_is_allocated_is_min_runtime_above_zero(min_runtime_s: float, allocated: bool) -> None:
    from apportion.domain.engine import PendingJob

    assert ev.is_allocated(min_runtime_s) is allocated
    sub = ev.JobSubmitted(
        job_id="j", budget="lab/a", user="u", gpus_per_replica=1, min_runtime_s=min_runtime_s, duration_s=60.0,
        submitted_at=datetime(2026, 1, 1, tzinfo=UTC), ts=datetime(2026, 1, 1, tzinfo=UTC), producer="t",
    )  # fmt: skip
    pending = PendingJob(
        job_id="j", attempt=1, budget="lab/a", user="u", gpus_per_replica=1, replicas=1,
        min_runtime_s=min_runtime_s, submitted_at_us=0, queued_at_us=0,
    )  # fmt: skip
    assert sub.allocated is allocated and pending.allocated is allocated  # the models ask the same function
