"""`apportion logs --json`: the job's output file as JSON, and its refusals as a verdict object (no stack needed)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apportion.cli.history import TAIL_BYTES, OutputTail, read_output
from apportion.cli.main import app


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"APPORTION_KAFKA_BOOTSTRAP": "127.0.0.1:1"})


def test_logs_json_gives_the_latest_attempt_and_its_text(tmp_path: Path) -> None:
    job = tmp_path / "j1"
    job.mkdir()
    (job / "attempt-1.replica-0.out").write_text("first\n")
    (job / "attempt-2.replica-0.out").write_text("second\n")
    res = run("logs", "j1", "--dir", str(tmp_path), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {
        "ok": True,
        "job_id": "j1",
        "attempt": 2,
        "attempts": [1, 2],
        "replica": 0,
        "stream": "stdout",
        "path": str(job / "attempt-2.replica-0.out"),
        "text": "second\n",
        "size": 7,
        "offset": 0,
        "cut": False,
    }


def test_logs_json_refusals_are_verdict_objects_with_exit_1(tmp_path: Path) -> None:
    (tmp_path / "j1").mkdir()
    (tmp_path / "j1" / "attempt-1.replica-0.out").write_text("x\n")
    res = run("logs", "j1", "--dir", str(tmp_path), "--attempt", "3", "--json")
    assert res.exit_code == 1
    assert json.loads(res.stdout) == {
        "ok": False,
        "verdict": "not_found",
        "reason": "no_attempt",
        "message": "job j1 has no attempt 3 here (attempts: 1)",
        "exit_code": 1,
        "job_id": "j1",
        "attempts": [1],
    }
    res = run("logs", "nobody", "--dir", str(tmp_path), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert (doc["ok"], doc["verdict"], doc["reason"]) == (False, "not_found", "no_output")
    assert res.stderr.strip() == "error: " + doc["message"]


def test_logs_reads_the_directory_the_agent_names_so_an_id_shaped_like_a_hashed_name_never_reads_anothers(
    tmp_path: Path,
) -> None:
    """``carol:exp1`` lives in ``carol_exp1-<16 hex of its sha256>``; the plain id equal to that name lives in a
    directory hashed again, so neither reads the other's output."""
    carols = tmp_path / "carol_exp1-a69867c53fd6dbaa"
    carols.mkdir()
    (carols / "attempt-1.replica-0.out").write_text("carol\n")
    res = run("logs", "carol:exp1", "--dir", str(tmp_path))
    assert (res.exit_code, res.stdout) == (0, "carol\n")
    res = run("logs", "carol_exp1-a69867c53fd6dbaa", "--dir", str(tmp_path), "--json")
    assert res.exit_code == 1
    assert json.loads(res.stdout)["message"] == (
        "no output of job carol_exp1-a69867c53fd6dbaa (replica 0) in\n"
        f"  {tmp_path}/carol_exp1-a69867c53fd6dbaa-8fbd81c67dd14e1a\n"
        "  only a started command has output (`apportion audit explain carol_exp1-a69867c53fd6dbaa`)"
    )


def test_logs_of_a_job_with_no_output_says_so_a_line_each_within_80_columns(tmp_path: Path) -> None:
    """The folder looked in on a line of its own: one line of 260 characters ran far past the edge."""
    res = run("logs", "j-42", "--dir", str(tmp_path / "logs"))
    assert res.exit_code == 1
    assert res.stderr.splitlines() == [
        "error: no output of job j-42 (replica 0) in",
        f"  {tmp_path / 'logs' / 'j-42'}",
        "  only a started command has output (`apportion audit explain j-42`)",
    ]
    assert [len(line) for line in res.stderr.splitlines() if "logs" not in line] == [43, 68]


def test_logs_never_follows_a_link_a_job_planted_as_a_later_attempt(tmp_path: Path) -> None:
    """The job's directory is the job's: it names a symbolic link to a secret file as attempt 9, and a hard
    link to another file as attempt 5. The latest is still attempt 1's own output, asking for attempt 9 or 5
    finds nothing, and nothing of the secret is printed."""
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secret\n")
    other = tmp_path / "other"
    other.write_text("someone else's\n")
    job = tmp_path / "logs" / "j1"
    job.mkdir(parents=True)
    (job / "attempt-1.replica-0.out").write_text("mine\n")
    (job / "attempt-9.replica-0.out").symlink_to(secret)
    os.link(other, job / "attempt-5.replica-0.out")
    res = run("logs", "j1", "--dir", str(tmp_path / "logs"))
    assert (res.exit_code, res.stdout) == (0, "mine\n")
    for attempt in ("9", "5"):
        res = run("logs", "j1", "--dir", str(tmp_path / "logs"), "--attempt", attempt, "--json")
        assert res.exit_code == 1
        assert json.loads(res.stdout)["message"] == f"job j1 has no attempt {attempt} here (attempts: 1)"
        assert "secret" not in res.output


def test_read_output_refuses_a_link_a_hard_link_or_a_fifo_on_the_descriptor(tmp_path: Path) -> None:
    """What :func:`read_output` opens may have been swapped since the directory was listed."""
    (tmp_path / "secret").write_text("secret\n")
    (tmp_path / "link").symlink_to(tmp_path / "secret")
    os.link(tmp_path / "secret", tmp_path / "hard")
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open would hang
    for name, code in (("link", errno.ELOOP), ("hard", errno.EPERM), ("fifo", errno.EINVAL)):
        with pytest.raises(OSError) as exc:
            read_output(tmp_path / name)
        assert exc.value.errno == code, name
    assert str(exc.value) == f"[Errno 22] not a regular file: '{tmp_path / 'fifo'}'"
    (tmp_path / "plain").write_text("plain\n")
    assert read_output(tmp_path / "plain") == OutputTail("plain\n", size=6, offset=0, cut=False)


def _sparse_output(tmp_path: Path, size: int, head: bytes, tail: bytes) -> Path:
    """A job's attempt-1 stdout of ``size`` bytes: ``head``, a hole of zero bytes, ``tail`` (a sparse file, as
    ``os.ftruncate(1, size)`` in the job makes one: no disk, any size)."""
    job = tmp_path / "j1"
    job.mkdir()
    path = job / "attempt-1.replica-0.out"
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size - len(tail))
        f.seek(size - len(tail))
        f.write(tail)
    assert path.stat().st_size == size
    return path


def test_logs_of_a_50_gib_sparse_output_reads_its_tail_and_says_it_was_cut(tmp_path: Path) -> None:
    """A job that truncated its stdout to 50 GiB: ``logs`` reads 1 MiB, not 50 GiB (it died of MemoryError), and
    says on stderr what it left out; ``--lines 2`` gives the last two lines; ``--json`` says so in fields."""
    size = 50 * 2**30
    _sparse_output(tmp_path, size, b"first line\n", b"\nsecond to last\nlast\n")
    res = run("logs", "j1", "--dir", str(tmp_path))
    assert res.exit_code == 0, res.stderr
    assert len(res.stdout) == TAIL_BYTES == 1_048_576
    assert res.stdout.endswith("\0\nsecond to last\nlast\n")
    assert res.stderr == (
        "note: output cut: the last 1,048,576 of 53,687,091,200 bytes shown (--bytes N or --lines N for another "
        "tail, --all for the whole file)\n"
    )
    res = run("logs", "j1", "--dir", str(tmp_path), "--lines", "2", "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["text"], doc["size"], doc["offset"], doc["cut"]) == ("second to last\nlast\n", size, size - 20, True)
    res = run("logs", "j1", "--dir", str(tmp_path), "--bytes", "5")
    assert (res.exit_code, res.stdout) == (0, "last\n")


def test_logs_all_copies_the_whole_file_in_chunks_and_refuses_json(tmp_path: Path) -> None:
    """``--all`` streams the whole file (3 MiB + 3 bytes, 49 chunks) to stdout unchanged;
    with ``--json`` it would have to hold the file: exit 2."""
    body = b"x" * (3 * 2**20) + b"end"
    _sparse_output(tmp_path, len(body), body, b"")
    res = run("logs", "j1", "--dir", str(tmp_path), "--all")
    assert (res.exit_code, res.stdout_bytes, res.stderr) == (0, body, "")
    res = run("logs", "j1", "--dir", str(tmp_path))
    assert (len(res.stdout), res.stderr.startswith("note: output cut: the last 1,048,576 of 3,145,731 bytes")) == (
        TAIL_BYTES,
        True,
    )
    res = run("logs", "j1", "--dir", str(tmp_path), "--all", "--json")
    assert res.exit_code == 2
    assert json.loads(res.stdout)["reason"] == ""


def test_logs_of_an_output_the_job_replaced_by_a_link_says_so_not_that_it_never_ran(tmp_path: Path) -> None:
    """A job swapped its only output file for a link to a secret: nothing of the secret is printed, and the
    refusal names what lies there instead (it said "only a started command has output", of a job that ran)."""
    secret = tmp_path / "stack.env"
    secret.write_text("APPORTION_KAFKA_PASSWORD=secret\n")
    job = tmp_path / "logs" / "j1"
    job.mkdir(parents=True)
    out = job / "attempt-1.replica-0.out"
    out.symlink_to(secret)
    res = run("logs", "j1", "--dir", str(tmp_path / "logs"))
    assert (res.exit_code, res.stdout) == (1, "")
    message = f"job j1's output {out} is not read: a symbolic link, not the node agent's file (a job may change what its own directory holds)"
    assert res.stderr == f"error: {message}\n"
    res = run("logs", "j1", "--dir", str(tmp_path / "logs"), "--json")
    doc = json.loads(res.stdout)
    assert (res.exit_code, doc["reason"], doc["path"], doc["message"]) == (1, "not_a_plain_file", str(out), message)
    assert "secret" not in res.output


def test_logs_of_an_array_id_names_its_elements_whose_output_is_there(tmp_path: Path) -> None:
    """``apportion logs sweep`` of `submit --array 0-11 --job-id sweep`: the array has no output of its own, each
    element has; the error says so, with the command that shows the first, and how many are there (``sweep_x`` and
    ``sweep2_1`` are no elements of it)."""
    for name in ("sweep_10", "sweep_2", "sweep_0", "sweep_1", "sweep_x", "sweep2_1"):
        (tmp_path / name).mkdir()
    res = run("logs", "sweep", "--dir", str(tmp_path))
    assert res.exit_code == 1
    assert res.stderr.splitlines() == [
        "error: no output of job sweep (replica 0) in",
        f"  {tmp_path / 'sweep'}",
        "  only a started command has output (`apportion audit explain sweep`)",
        "  a job array: its 4 elements here have output, e.g. `apportion logs sweep_0`",
    ]
    assert len(res.stderr.splitlines()[-1]) <= 80
    assert run("logs", "sweep_3", "--dir", str(tmp_path)).stderr.count("\n") == 3  # an element: no such line
