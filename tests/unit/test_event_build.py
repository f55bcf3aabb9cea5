"""Events the engine builds without validating again (``emit.built``) are the events validation builds.

Every value checked to be what validation returns (exact types, within bounds) gives an instance equal
to ``cls(**values)`` in its fields, its JSON, its fields set and its field order; any other value goes
through validation (converted, or refused as before). Event ids are uuid5 whatever their parts.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from apportion.domain.cluster import Run
from apportion.domain.engine.emit import built, emit_placed, preempt_events, start_events, stop_event
from apportion.domain.engine.inputs import EngineConfig, PendingJob
from apportion.events import (
    EVENT_NAMESPACE,
    Decision,
    JobPlaced,
    JobPreempted,
    Placement,
    StartWorkload,
    StopWorkload,
    Victim,
    det_id,
    encode,
)
from apportion.timeutil import to_us

TS = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
EID = uuid.UUID("12345678-1234-5678-1234-567812345678")


class Colour(str, enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param(("JobPlaced",), id="one part"),
        pytest.param(("JobPlaced", "j1"), id="two parts"),
        pytest.param(("JobPlaced", "j1", 3), id="kind, job, attempt"),
        pytest.param(("StartWorkload", "j1", 3, 7), id="kind, job, attempt, replica"),
        pytest.param(("x", "y", 1, 2, 3.5), id="five parts"),
        pytest.param(("x", Colour.RED, None), id="str() of an enum member, not its format()"),
        pytest.param(("é", "ünï", 0), id="non-ascii"),
    ],
)
def test_det_id_is_uuid5_of_the_parts_joined_by_unit_separators(parts: tuple[object, ...]) -> None:
    got = det_id(*parts)
    want = uuid.uuid5(EVENT_NAMESPACE, "\x1f".join(map(str, parts)))
    assert got == want
    assert (str(got), got.version, got.hex, hash(got), got.is_safe) == (
        str(want),
        5,
        want.hex,
        hash(want),
        uuid.SafeUUID.unknown,
    )


def test_det_id_reads_only_its_own_parts_call_after_call() -> None:
    """The namespace's hash is copied per id: an id does not depend on the ids made before it."""
    first = [det_id("JobPlaced", f"j{i}", 1) for i in range(3)]
    again = [det_id("JobPlaced", f"j{i}", 1) for i in range(3)]
    assert first == again == [uuid.uuid5(EVENT_NAMESPACE, f"JobPlaced\x1fj{i}\x1f1") for i in range(3)]


def _same(a: BaseModel, b: BaseModel) -> None:
    """``a`` and ``b`` are the same instance in everything a reader or writer sees."""
    assert type(a) is type(b)
    assert a == b
    assert a.model_dump_json() == b.model_dump_json()
    assert list(a.__dict__) == list(b.__dict__)
    assert a.__pydantic_fields_set__ == b.__pydantic_fields_set__
    assert (a.__pydantic_extra__, a.__pydantic_private__) == (b.__pydantic_extra__, b.__pydantic_private__)
    assert repr(a) == repr(b)
    try:
        want = hash(b)
    except TypeError:  # (a dict field)
        with pytest.raises(TypeError):
            hash(a)
    else:
        assert hash(a) == want


VICTIM: dict[str, Any] = {
    "job_id": "v1",
    "attempt": 2,
    "budget": "lab/b",
    "allocated": True,
    "gpus": 8,
    "protected_until": TS,
    "rule": "expired_behind",
    "lca": "lab",
    "victim_ratio": 1.25,
    "preemptor_ratio": 0.5,
    "preemptor_ratio_after": 0.75,
    "lost_gpu_s": 120.0,
    "idle_s": None,
}
PLAIN: list[tuple[type[Any], dict[str, Any]]] = [
    (Victim, VICTIM),
    (
        Decision,
        {
            "rank": 4,
            "budget_rank": 1,
            "ratio": float("inf"),
            "victims": (Victim(**VICTIM),),
            "reservation": False,
            "policy_version": "p",
            "protection_s": 3600.0,
            "preemptions": 0,
        },
    ),
    (
        StartWorkload,
        {
            "event_id": EID,
            "ts": TS,
            "producer": "dispatcher",
            "node_id": "n1",
            "job_id": "j1",
            "attempt": 1,
            "replica": 0,
            "gpus": (2, 3),
            "command": ("run", "it"),
            "duration_s": 60.0,
            "progress_s": 0.0,
            "checkpoint_interval_s": None,
        },
    ),
    (
        StopWorkload,
        {
            "event_id": EID,
            "ts": TS,
            "producer": "dispatcher",
            "node_id": "n1",
            "job_id": "j1",
            "attempt": 1,
            "grace_s": 30.0,
            "reason": "preempted",
        },
    ),
]


@pytest.mark.parametrize(("cls", "values"), PLAIN, ids=[c.__name__ for c, _ in PLAIN])
def test_built_without_validation_is_the_validated_instance(cls: type[Any], values: dict[str, Any]) -> None:
    fast = built(cls, values, True)
    _same(fast, cls(**values))
    _same(fast.model_copy(update={}), fast)


def test_a_default_factory_gives_each_instance_its_own_value() -> None:
    a = built(StartWorkload, dict(PLAIN)[StartWorkload], True)
    b = built(StartWorkload, dict(PLAIN)[StartWorkload], True)
    assert a.env == {} and a.env is not b.env


JOB = PendingJob(
    job_id="j1",
    attempt=2,
    budget="lab/a",
    user="alice",
    gpus_per_replica=2,
    replicas=2,
    min_runtime_s=3600.0,
    submitted_at_us=to_us(TS) - 10_000_000,
    queued_at_us=to_us(TS) - 5_000_000,
    duration_s=7200.0,
    progress_s=600.0,
    checkpoint_interval_s=900.0,
)
PLACED = (Placement(node_id="n1", gpus=(0, 1)), Placement(node_id="n2", gpus=(4, 5)))
RUN = Run(
    job_id="v1",
    attempt=1,
    budget="lab/b",
    user="bob",
    allocated=True,
    gpus_per_replica=2,
    replicas=2,
    min_runtime_us=3_600_000_000,
    placements=PLACED,
    placed_at_us=to_us(TS) - 7_300_000_000,
    submitted_at_us=to_us(TS) - 7_400_000_000,
    started_at_us=to_us(TS) - 7_200_000_000,
    open_replicas=frozenset({0, 1}),
)


def _validated(make: Any) -> list[Any]:
    """What ``make()`` builds when every value goes through validation."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("apportion.domain.engine.emit.built", lambda cls, values, plain: cls(**values))
        return make()


def _placed(job: PendingJob = JOB, r: float = 0.5) -> list[Any]:
    out: list[Any] = []
    victim = built(Victim, VICTIM, True)
    emit_placed(out, job, PLACED, (victim,), "lab/a", 3, {"lab/a": 1}, r, True, TS, EngineConfig(), None)
    return out


BUILDERS = [
    pytest.param(_placed, id="JobPlaced with its decision"),
    pytest.param(lambda: start_events("j1", 2, PLACED, TS, 7200.0, None, "dispatcher", progress_s=600.0), id="starts"),
    pytest.param(lambda: preempt_events(RUN, TS, 30.0, "dispatcher", by_job_id="j1", by_budget="lab/a"), id="stops"),
    pytest.param(lambda: [stop_event(RUN, 1, TS, 0.0, "dispatcher", "drain")], id="one stop"),
]


@pytest.mark.parametrize("make", BUILDERS)
def test_the_engines_events_are_those_validation_builds(make: Any) -> None:
    fast, slow = make(), _validated(make)
    assert len(fast) == len(slow) > 0
    for a, b in zip(fast, slow, strict=True):
        _same(a, b)
        assert encode(a) == encode(b)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: start_events("j1", 2, PLACED, TS, 7200, None, "d"), id="an int duration"),
        pytest.param(lambda: _placed(_int_job()), id="an int minimum runtime"),
        pytest.param(lambda: _placed(r=0), id="an int ratio"),
        pytest.param(
            lambda: start_events("j1", 2, PLACED, TS.astimezone(timezone(timedelta(hours=2))), 1.0, None, "d"),
            id="a time in another zone",
        ),
    ],
)
def test_values_validation_would_change_go_through_it(make: Any) -> None:
    fast, slow = make(), _validated(make)
    for a, b in zip(fast, slow, strict=True):
        _same(a, b)
    e = fast[0]
    assert e.ts.tzinfo is UTC
    if isinstance(e, JobPlaced):
        assert type(e.min_runtime_s) is float and type(e.decision.ratio) is float
    else:
        assert type(e.duration_s) is float


def _int_job() -> PendingJob:
    return dataclasses.replace(JOB, min_runtime_s=3600)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda: start_events("j1", 1, PLACED, TS, 1.0, None, "d", progress_s=-1.0), id="negative progress"
        ),
        pytest.param(
            lambda: start_events("j1", 1, PLACED, TS, 1.0, None, "d", checkpoint_interval_s=0.0), id="a zero interval"
        ),
        pytest.param(lambda: preempt_events(RUN, TS, 30.0, "d", victim="x"), id="a victim that is not one"),  # type: ignore[arg-type]
    ],
)
def test_invalid_values_are_refused_as_before(make: Any) -> None:
    with pytest.raises(ValidationError):
        make()


def test_the_checks_cover_every_field_the_engine_fills() -> None:
    """The fields, types and bounds the engine's checks assume; a change to these models needs the checks in
    ``apportion.domain.engine.emit`` (and ``search._plain_victim``) looked at again."""
    got = {
        cls.__name__: {name: (str(f.annotation), [repr(m) for m in f.metadata]) for name, f in cls.model_fields.items()}
        for cls, _ in PLAIN
    } | {
        cls.__name__: {name: (str(f.annotation), [repr(m) for m in f.metadata]) for name, f in cls.model_fields.items()}
        for cls in (JobPlaced, JobPreempted)
    }
    bounded = {
        ("StartWorkload", "progress_s"): ["Ge(ge=0)", "Le(le=1000000000.0)"],
        ("StartWorkload", "checkpoint_interval_s"): ["Gt(gt=0)", "Le(le=1000000000.0)"],
        ("StartWorkload", "time_limit_s"): ["Gt(gt=0)", "Le(le=1000000000.0)"],
        ("JobPlaced", "checkpoint_interval_s"): ["Gt(gt=0)", "Le(le=1000000000.0)"],
        ("JobPreempted", "lost_gpu_s"): ["Ge(ge=0)"],
    }
    for cls_name, fields in got.items():
        for name, (_, meta) in fields.items():
            assert meta == bounded.get((cls_name, name), []), (cls_name, name)
    for cls in (Victim, Decision, JobPlaced, JobPreempted, StartWorkload, StopWorkload):
        dec = cls.__pydantic_decorators__
        assert not dec.model_validators
        assert {n for d in dec.field_validators.values() for n in d.info.fields} <= {
            "ts",
            "submitted_at",
            "charged_until",
            "last_heartbeat",
            "at",
        }
    assert got["JobPlaced"]["min_runtime_s"][0] == "<class 'float'>"
    assert got["Decision"]["ratio"][0] == "<class 'float'>"
