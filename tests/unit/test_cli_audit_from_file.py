"""Offline `apportion audit verify --from-file`: the export's own namespace, and 0 records is not a pass."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apportion.audit.source import ExportFormatError, export_prefix
from apportion.audit.verify import records_from_events, verify
from apportion.cli.main import app
from tests.kit.audit_history import export, history


@pytest.fixture(autouse=True)
def _no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    # a Kafka address: no running stack's stack.env brings its namespace; the prefix is restored after each test
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", "")


def test_export_prefix_is_the_namespace_of_the_headers_topics(tmp_path: Path) -> None:
    assert export_prefix(export(tmp_path / "a.gz", history(), "t1.")) == "t1."
    assert export_prefix(export(tmp_path / "b.gz", history(), "")) == ""
    assert export_prefix(export(tmp_path / "c.gz", [], "", topic_names=[])) == ""
    mixed = export(tmp_path / "d.gz", [], "", topic_names=["t1.apportion.jobs", "t2.apportion.nodes"])
    with pytest.raises(ExportFormatError, match="several namespaces"):
        export_prefix(mixed)


def test_verify_reads_an_export_of_another_namespace_and_re_runs_its_decisions(tmp_path: Path) -> None:
    log = history()
    path = export(tmp_path / "log.jsonl.gz", log, "t1.")
    # the same log verified in process, in the default namespace: the figures the CLI must print
    want = verify(records_from_events(log), config=None)
    res = CliRunner().invoke(app, ["audit", "verify", "--json", "--from-file", path])
    out = json.loads(res.stdout)
    # before the fix the environment's namespace ("") filtered every t1. record out: 0 decisions, "ok"
    assert out["decision_ticks"] == want.decisions == 3
    assert out["records"] == want.records == len(log)
    assert out["ok"] is want.ok


def test_verify_says_in_words_on_what_its_decisions_were_re_run(tmp_path: Path) -> None:
    # the history's dispatcher records no input positions: its 3 ticks are re-run in log order
    path = export(tmp_path / "log.jsonl.gz", history(), "")
    res = CliRunner().invoke(app, ["audit", "verify", "--from-file", path])
    assert "decision ticks re-run: 3 (3 in log order); read models: skipped" in " ".join(res.stdout.split())
    assert "{" not in res.stdout  # no Python dict printed


def test_verify_of_an_export_with_no_records_fails_with_a_reason(tmp_path: Path) -> None:
    path = export(tmp_path / "empty.jsonl.gz", [], "", topic_names=["apportion.jobs"])
    res = CliRunner().invoke(app, ["audit", "verify", "--from-file", path])
    assert res.exit_code == 1
    assert "no apportion records" in res.stderr
    assert "OK" not in res.stdout


def test_a_file_that_is_not_an_export_is_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"hello": 1}\n')
    res = CliRunner().invoke(app, ["audit", "verify", "--from-file", str(bad)])
    assert res.exit_code == 2
    assert "not an apportion export" in res.stderr
