"""The JSON Schemas in ``schemas/`` are current with the event models.

When this fails, regenerate them and commit the result::

    .venv/bin/python -m apportion.schemas_export
"""

from __future__ import annotations

import json
from pathlib import Path

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
