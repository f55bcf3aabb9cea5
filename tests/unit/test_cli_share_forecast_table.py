"""`share --forecast 7d` at 80 columns: every budget name and value whole (they were cut to ``la…``, ``0.000…``);
the latest steps that do not fit follow the table, a line per budget."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from apportion.cli.main import app
from tests.kit.audit_history import export
from tests.kit.forecast_history import one_job


def test_share_forecast_7d_at_80_columns_cuts_no_cell(tmp_path: Path) -> None:
    path = export(tmp_path / "log.jsonl.gz", one_job().log, "")
    env = {"APPORTION_KAFKA_BOOTSTRAP": "127.0.0.1:1", "APPORTION_TOPIC_PREFIX": ""}
    res = CliRunner().invoke(app, ["share", "--forecast", "7d", "--from-file", path], env=env, terminal_width=80)
    assert res.exit_code == 0, res.output
    assert [line.rstrip() for line in res.stdout.splitlines()] == [
        "               r/rank from 2024-01-01T00:00:00+00:00, every 1d",
        "budget      now      +1d      +2d      +3d      +4d      +5d  can preempt from",
        "─" * 78,
        "lab       0.000    1.000    1.000    0.667    0.500    0.400  -",
        "  a     0.000/0  2.000/1  2.000/1  1.333/1  1.000/1  0.800/1  -",
        "  b     0.000/1  0.000/0  0.000/0  0.000/0  0.000/0  0.000/0  01-02 00:00",
        "lab: +6d 0.333, +7d 0.286",
        "lab/a: +6d 0.667/1, +7d 0.571/1",
        "lab/b: +6d 0.000/0, +7d 0.000/0",
    ]


def test_share_forecast_prints_its_time_at_seconds_and_its_json_keeps_the_microseconds(tmp_path: Path) -> None:
    path = export(tmp_path / "log.jsonl.gz", one_job().log, "")
    env = {"APPORTION_KAFKA_BOOTSTRAP": "127.0.0.1:1", "APPORTION_TOPIC_PREFIX": ""}
    args = ["share", "--forecast", "2d", "--at", "2024-01-01T00:00:00.250Z", "--from-file", path]
    res = CliRunner().invoke(app, args, env=env, terminal_width=80)
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].strip() == "r/rank from 2024-01-01T00:00:00+00:00, every 1d"
    res = CliRunner().invoke(app, [*args, "--json"], env=env, terminal_width=80)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["now"] == "2024-01-01T00:00:00.250000+00:00"
