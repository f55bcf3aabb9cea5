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
from apportion.privatefiles import open_private_append, private_dir, private_file, write_private


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


# --------------------------------------------------------------------------- the writer, case by case


@pytest.fixture(params=[0o022, 0o077], ids=["umask-022", "umask-077"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


@pytest.mark.parametrize(
    ("asked", "exclusive"),
    [
        pytest.param(0o600, False, id="secret-replaced"),
        pytest.param(0o600, True, id="secret-created-once"),
        pytest.param(0o644, False, id="certificate-others-read"),
        pytest.param(0o640, True, id="group-reads"),
    ],
)
def test_the_mode_asked_for_is_the_files_whatever_the_umask(
    tmp_path: Path, umask: int, asked: int, exclusive: bool
) -> None:
    out = tmp_path / "f"
    write_private(out, b"data", mode=asked, exclusive=exclusive)
    assert (mode(out), out.read_bytes()) == (asked, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_replacing_takes_the_new_mode_and_content_of_a_file_already_there(tmp_path: Path) -> None:
    out = tmp_path / "f"
    out.write_bytes(b"old")
    out.chmod(0o666)
    write_private(out, b"new")
    assert (mode(out), out.read_bytes()) == (0o600, b"new")


@pytest.mark.parametrize(
    "there",
    [
        pytest.param("file", id="a-file"),
        pytest.param("link", id="a-link-to-a-file"),
        pytest.param("dangling", id="a-dangling-link"),
    ],
)
def test_exclusive_creation_refuses_anything_at_the_name_and_leaves_it(tmp_path: Path, there: str) -> None:
    target = tmp_path / "target"
    out = tmp_path / "key.json"
    if there == "file":
        out.write_bytes(b"mine")
    else:
        if there == "link":
            target.write_bytes(b"theirs")
        out.symlink_to(target)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(FileExistsError) as exc:
        write_private(out, b"new", exclusive=True)
    assert (exc.value.errno, exc.value.filename) == (errno.EEXIST, str(out))
    assert "never overwritten" in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary left
    assert out.is_symlink() == (there != "file")
    if there != "dangling":
        assert out.read_bytes() == (b"mine" if there == "file" else b"theirs")


def test_exclusive_creation_refuses_a_file_made_while_it_was_writing(tmp_path: Path) -> None:
    out = tmp_path / "admin.password"
    with pytest.raises(FileExistsError) as exc, private_file(out, exclusive=True) as f:
        f.write(b"mine")
        out.write_bytes(b"theirs")  # another process made it first
    assert (exc.value.errno, exc.value.filename, out.read_bytes()) == (errno.EEXIST, str(out), b"theirs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin.password"]


@pytest.mark.parametrize(
    ("replace_link", "outcome"),
    [pytest.param(False, "refused", id="refused-by-default"), pytest.param(True, "replaced", id="replaced-when-asked")],
)
def test_a_link_at_the_name_is_never_written_through(tmp_path: Path, replace_link: bool, outcome: str) -> None:
    target = tmp_path / "bashrc"
    target.write_bytes(b"theirs")
    out = tmp_path / "server.key"
    out.symlink_to(target)
    if outcome == "refused":
        with pytest.raises(OSError) as exc:
            write_private(out, b"key", replace_link=replace_link)
        assert exc.value.errno == errno.ELOOP
        assert out.is_symlink()
    else:
        write_private(out, b"key", replace_link=replace_link)
        assert (out.is_symlink(), out.read_bytes(), mode(out)) == (False, b"key", 0o600)
    assert target.read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bashrc", "server.key"]


@pytest.mark.parametrize("exclusive", [False, True], ids=["replace", "exclusive"])
def test_a_write_that_fails_leaves_no_temporary_and_no_file(tmp_path: Path, exclusive: bool) -> None:
    out = tmp_path / "password"
    with pytest.raises(RuntimeError), private_file(out, exclusive=exclusive) as f:
        f.write(b"half")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_durable_syncs_the_file_before_it_takes_the_name_and_then_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "a.journal"
    synced: list[str] = []

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.append("dir" if stat.S_ISDIR(st.st_mode) else f"file named={out.exists()}")

    monkeypatch.setattr(os, "fsync", fsync)
    write_private(out, b"{}\n", durable=True)
    write_private(tmp_path / "plain", b"")
    assert synced == ["file named=False", "dir"]
