"""Exports of the log and the logs of a local run hold every job's command and ``--env`` values: files 0600,
directories 0700 from the first byte whatever the umask, complete or not at all, never written through a link."""

from __future__ import annotations

import errno
import gzip
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from apportion.audit.source import write_export
from apportion.logrecord import LogRecord
from apportion.privatefiles import open_private_append, private_dir, private_file


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """umask 0: a file made with the default mode would be 0666, a directory 0777."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def record() -> LogRecord:
    return LogRecord(
        topic="apportion.submissions",
        partition=0,
        offset=0,
        key="j1",
        timestamp_ms=1,
        raw=b'{"env": {"K": "s"}}',
        event=None,
    )


def test_an_export_is_0600_under_umask_0_and_replaces_an_older_0644_one(tmp_path: Path, open_umask: None) -> None:
    out = tmp_path / "log.jsonl.gz"
    out.write_bytes(b"old")
    out.chmod(0o644)
    assert write_export([record()], out, topic_names=["apportion.submissions"], exported_at="t") == 1
    assert mode(out) == 0o600
    with gzip.open(out, "rt") as f:
        assert f.read().splitlines()[1] == (
            '{"topic":"apportion.submissions","partition":0,"offset":0,"key":"j1","timestamp_ms":1,'
            '"value":"{\\"env\\": {\\"K\\": \\"s\\"}}"}'
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl.gz"]  # no temporary left


def test_an_export_to_a_symbolic_link_is_refused_and_the_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "bashrc"
    target.write_text("mine\n")
    link = tmp_path / "week.jsonl.gz"
    link.symlink_to(target)
    with pytest.raises(OSError) as exc:
        write_export([record()], link, topic_names=[], exported_at="t")
    assert exc.value.errno == errno.ELOOP
    assert (target.read_text(), link.is_symlink()) == ("mine\n", True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bashrc", "week.jsonl.gz"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    out.write_text("old")
    with pytest.raises(RuntimeError), private_file(out) as f:
        f.write(b"half")
        raise RuntimeError("boom")
    assert out.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_private_dir_is_0700_new_or_narrowed_and_refuses_a_link(tmp_path: Path, open_umask: None) -> None:
    assert mode(private_dir(tmp_path / "run" / "demo")) == 0o700
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    assert mode(private_dir(old)) == 0o700
    (tmp_path / "elsewhere").symlink_to(old)
    with pytest.raises(OSError) as exc:
        private_dir(tmp_path / "elsewhere")
    assert exc.value.errno == errno.ELOOP


def test_a_service_log_is_0600_appended_and_never_opened_through_a_link(tmp_path: Path, open_umask: None) -> None:
    log = tmp_path / "policy.log"
    log.write_bytes(b"one\n")
    log.chmod(0o644)
    with open_private_append(log) as f:
        f.write(b"two\n")
    assert (mode(log), log.read_bytes()) == (0o600, b"one\ntwo\n")
    (tmp_path / "link.log").symlink_to(log)
    with pytest.raises(OSError) as exc:
        open_private_append(tmp_path / "link.log")
    assert exc.value.errno == errno.ELOOP
