"""The JSON Schemas in ``schemas/`` are current with the event models.

When this fails, regenerate them and commit the result::

    .venv/bin/python -m apportion.schemas_export
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apportion.events import EVENT_TYPES
from apportion.schemas_export import render, stale, write

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def test_schema_files_are_current() -> None:
    problems = stale(SCHEMAS)
    assert not problems, f"stale JSON Schemas {problems}: run `python -m apportion.schemas_export` and commit"


def test_one_schema_per_event_type() -> None:
    assert set(render()) == {f"{name}.json" for name in EVENT_TYPES}


def test_schemas_name_their_type_and_dialect() -> None:
    for name, text in render().items():
        doc = json.loads(text)
        assert doc["$schema"].startswith("https://json-schema.org/")
        assert doc["properties"]["type"]["const"] == name.removesuffix(".json")


def test_stale_detects_edits_and_write_repairs(tmp_path: Path) -> None:
    write(tmp_path)
    assert stale(tmp_path) == []
    (tmp_path / "JobPlaced.json").write_text("{}\n")
    (tmp_path / "Gone.json").write_text("{}\n")
    assert stale(tmp_path) == ["Gone.json", "JobPlaced.json"]
    assert sorted(write(tmp_path)) == ["Gone.json", "JobPlaced.json"]
    assert stale(tmp_path) == []


def _submission(**over: object) -> dict:
    doc = {
        "event_id": "6c07c248-0be4-5cf4-8717-d755e0cc6125",
        "type": "JobSubmitted",
        "schema_version": 5,
        "ts": "2026-12-01T12:00:00Z",
        "job_id": "j-42",
        "budget": "lab/vision",
        "user": "carol",
        "gpus_per_replica": 2,
        "min_runtime_s": 3600,
        "submitted_at": "2026-12-01T12:00:00Z",
        "duration_s": 600,
    }
    doc.update(over)
    return {k: v for k, v in doc.items() if v is not None}


@pytest.mark.parametrize(
    "case,doc,ok",
    [
        pytest.param("simulated", _submission(), True, id="duration only"),
        pytest.param("real", _submission(duration_s=None, command=["python", "train.py"]), True, id="command only"),
        pytest.param("both", _submission(command=["sleep", "1"]), True, id="command and duration"),
        pytest.param("neither", _submission(duration_s=None), False, id="neither command nor duration"),
        pytest.param("null command", _submission(duration_s=None, command=None) | {"command": None}, False, id="null"),
        pytest.param("no type", {k: v for k, v in _submission().items() if k != "type"}, False, id="type missing"),
        pytest.param("no id", {k: v for k, v in _submission().items() if k != "event_id"}, False, id="id missing"),
        pytest.param("no version", {k: v for k, v in _submission().items() if k != "schema_version"}, False, id="v"),
        pytest.param("no user", {k: v for k, v in _submission().items() if k != "user"}, False, id="user missing"),
    ],
)
def test_the_jobsubmitted_schema_marks_required_fields_and_encodes_command_or_duration(
    case: str, doc: dict, ok: bool
) -> None:
    """The file another language validates against agrees with the decoder on every case it can express."""
    import jsonschema

    from apportion import events

    schema = json.loads((SCHEMAS / "JobSubmitted.json").read_text())
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    assert (not errors) == ok, (case, [e.message for e in errors])
    if "type" in doc and "event_id" in doc and "schema_version" in doc:  # what the reader tolerates, it fills in
        try:
            events.decode(json.dumps(doc).encode())
            decoded = True
        except events.DecodeError:
            decoded = False
        assert decoded == ok, case


def test_every_schema_requires_the_envelope_a_reader_cannot_do_without() -> None:
    for name, text in render().items():
        required = json.loads(text)["required"]
        assert required[:3] == ["event_id", "type", "schema_version"], name
        assert "ts" in required, name


def test_apportion_schemas_prints_the_committed_file_and_lists_types_with_topic_and_key() -> None:
    from typer.testing import CliRunner

    from apportion.cli.main import app

    runner = CliRunner()
    res = runner.invoke(app, ["schemas", "JobSubmitted"])
    assert res.exit_code == 0
    assert res.stdout == (SCHEMAS / "JobSubmitted.json").read_text()
    listing = runner.invoke(app, ["schemas"], env={"COLUMNS": "200"})
    assert listing.exit_code == 0
    row = next(ln for ln in listing.stdout.splitlines() if " JobSubmitted " in ln)
    assert [c.strip() for c in row.split("│")[1:4]] == ["JobSubmitted", "apportion.submissions", "job_id"]
    bad = runner.invoke(app, ["schemas", "Nope"])
    assert (bad.exit_code, "no event type 'Nope'" in bad.stderr) == (2, True)
