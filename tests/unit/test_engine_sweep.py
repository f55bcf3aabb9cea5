"""``bench/engine_sweep.py``'s specs: ``knob=value,...`` read as typed ``EngineConfig`` values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from engine_sweep import RUN_ARGS, parse_spec

from apportion.domain.engine import EngineConfig

SPEC_CASES = [
    pytest.param("base", {}, id="base: every default"),
    pytest.param("patience_s=3600", {"patience_s": 3600.0}, id="a float knob"),
    pytest.param("churn_bound=4", {"churn_bound": 4}, id="an optional int knob takes an int"),
    pytest.param("protection_doublings=none", {"protection_doublings": None}, id="none is None"),
    pytest.param(
        "free_las=true,reservation_after_s=1800",
        {"free_las": True, "reservation_after_s": 1800.0},
        id="two knobs, a boolean and a float",
    ),
    pytest.param("free_las=0", {"free_las": False}, id="a boolean off"),
]


@pytest.mark.parametrize(("spec", "expected"), SPEC_CASES)
def test_a_spec_reads_as_typed_engine_knobs(spec, expected):
    got = parse_spec(spec)
    assert got == expected
    assert all(type(v) is type(expected[k]) for k, v in got.items())
    EngineConfig(**got)  # every knob is a field


def test_an_unknown_knob_or_a_missing_value_is_refused():
    with pytest.raises(SystemExit, match="KNOB=VALUE"):
        parse_spec("no_such_knob=1")
    with pytest.raises(SystemExit, match="KNOB=VALUE"):
        parse_spec("delta")


def test_the_knobs_the_runner_takes_by_name_are_engine_fields():
    fields = set(EngineConfig.__dataclass_fields__)
    assert set(RUN_ARGS) <= fields
