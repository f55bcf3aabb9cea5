"""Node agent checkpoints: progress-file parsing, once-per-value publishing, the last look after exit, resume.

Pure parts are tables with exact values; runtime tests drive
:class:`services.node_agent.service.NodeAgent` with a list sink, a
:class:`ManualClock` and real processes (``sys.executable``) in ``tmp_path``.
Waits are on conditions (a file's content, an event), each bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from apportion.clock import ManualClock
from apportion.events import JobCheckpointed, JobCompleted, JobFailed, JobStarted, StartWorkload, StopWorkload, det_id
from apportion.gpu import FakeGpuProbe
from services.node_agent import logic
from services.node_agent.logic import NodeSpec, ProgressWatch, Workload
from services.node_agent.service import NodeAgent
from services.node_agent.store import Journal
from tests.kit.checkpoint_workload import WORKLOAD
from tests.kit.node_agent import WAIT_S, Sink, until
from tests.kit.node_boundary import running

T0 = datetime(2025, 3, 1, tzinfo=UTC)
# --------------------------------------------------------------------------- parsing

VALID = [
    # id, file content, progress seconds
    ("integer", b"120", 120.0),
    ("decimal with newline and spaces", b"  42.5\n", 42.5),
    ("zero", b"0", 0.0),
    ("leading plus", b"+7", 7.0),
    ("exponent", b"1.5e3", 1500.0),
    ("leading dot", b".5", 0.5),
    ("trailing dot", b"5.", 5.0),
    ("JSON object", b'{"progress_s": 7}', 7.0),
    ("JSON object with other keys", b'{"step": 900, "progress_s": 3600.25}\n', 3600.25),
]


@pytest.mark.parametrize("case_id,raw,expected", VALID, ids=[c[0] for c in VALID])
def test_parse_progress_valid(case_id, raw, expected):
    assert logic.parse_progress(raw) == expected


INVALID = [
    # id, file content, reason (exact)
    ("empty", b"", "empty"),
    ("white space only", b" \n", "empty"),
    ("word", b"abc", "not a number: 'abc'"),
    ("negative", b"-5", "negative: -5"),
    ("nan", b"nan", "not a number: 'nan'"),
    ("inf", b"inf", "not a number: 'inf'"),
    ("overflows to inf", b"1e999", "not finite: inf"),
    ("underscore digits", b"1_000", "not a number: '1_000'"),
    ("two numbers", b"10 20", "not a number: '10 20'"),
    ("JSON list", b"[1]", "not a number: '[1]'"),
    ("not UTF-8", b"\xff\xfe", "not UTF-8"),
    ("JSON without progress_s", b'{"step": 3}', 'JSON object without "progress_s"'),
    ("JSON bool", b'{"progress_s": true}', '"progress_s" is not a number: True'),
    ("JSON string", b'{"progress_s": "10"}', "\"progress_s\" is not a number: '10'"),
    ("JSON negative", b'{"progress_s": -1}', "negative: -1.0"),
    ("JSON NaN", b'{"progress_s": NaN}', "not finite: nan"),
    ("torn JSON", b'{"progress_s": 1', "invalid JSON: Expecting ',' delimiter: line 1 column 17 (char 16)"),
    ("too large", b"1" * (logic.MAX_PROGRESS_BYTES + 1), f"larger than {logic.MAX_PROGRESS_BYTES} bytes"),
]


@pytest.mark.parametrize("case_id,raw,reason", INVALID, ids=[c[0] for c in INVALID])
def test_parse_progress_invalid(case_id, raw, reason):
    with pytest.raises(logic.ProgressError) as exc:
        logic.parse_progress(raw)
    assert str(exc.value) == reason


# --------------------------------------------------------------------------- directories and environment

DIR_NAMES = [
    # id, job id, directory name
    ("plain id kept", "j-0042", "j-0042"),
    ("dots and underscores kept", "train_v2.run", "train_v2.run"),
    ("slash", "a b/c", "a_b_c-539138d518391ec4"),
    ("parent directory", "../x", "_x-d6b96a97d147daaa"),
    ("dot-dot alone", "..", "job-5ec1f7e700f37c3d"),
    # the hashed form is <stem>-<first 16 hex digits of sha256(id)>; a plain id of that shape is hashed too
    ("colon", "carol:exp1", "carol_exp1-a69867c53fd6dbaa"),
    (
        "plain id equal to another id's hashed name",
        "carol_exp1-a69867c53fd6dbaa",
        "carol_exp1-a69867c53fd6dbaa-8fbd81c67dd14e1a",
    ),
    ("plain id ending in upper-case hex", "x-0123456789ABCDEF", "x-0123456789ABCDEF-e6cbce49d550122d"),
    ("plain id equal to the empty stem's name", "job-5ec1f7e700f37c3d", "job-5ec1f7e700f37c3d-c0e3d4e97d859dee"),
    ("15 hex digits kept", "x-0123456789abcde", "x-0123456789abcde"),
    ("17 hex digits kept", "x-0123456789abcdefa", "x-0123456789abcdefa"),
]


@pytest.mark.parametrize("case_id,job_id,name", DIR_NAMES, ids=[c[0] for c in DIR_NAMES])
def test_job_dir_name(case_id, job_id, name):
    assert logic.job_dir_name(job_id) == name
    assert "/" not in name and name not in (".", "..")


def test_job_dir_name_keeps_sanitised_ids_apart():
    assert logic.job_dir_name("a/b") != logic.job_dir_name("a_b") == "a_b"
    assert logic.job_dir_name("a/b") != logic.job_dir_name("a:b")


@pytest.mark.parametrize("job_id", ["carol:exp1", "a b/c", "../x", "..", ""])
def test_an_id_chosen_equal_to_another_ids_directory_gets_a_directory_of_its_own(job_id):
    """Every hashed name is a plain file name ending in ``-`` and 16 hex digits; as an id it is hashed again."""
    mapped = logic.job_dir_name(job_id)
    assert logic.job_dir_name(mapped) != mapped
    assert logic.job_dir_name(mapped) == logic.job_dir_name(mapped)


def test_job_files_layout_and_process_env():
    job_env = {"APPORTION_ATTEMPT": "99", "LR": "0.1", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    w = Workload("n1", "j1", 3, 0, (2, 3), ("train",), None, job_env)
    files = logic.job_files("/ckpt", "/logs", w)
    assert files == logic.JobFiles(
        "/ckpt/j1",
        "/ckpt/j1/progress",
        "/logs/j1/attempt-3.replica-0.out",
        "/logs/j1/attempt-3.replica-0.err",
        "/logs/j1/tmp.attempt-3.replica-0",
    )
    other = logic.job_files("/ckpt", None, logic.replace(w, replica=2))
    assert other == logic.JobFiles("/ckpt/j1", "/ckpt/j1/progress.2", None, None, "/ckpt/j1/tmp.attempt-3.replica-2")
    assert logic.replace(w, files=files).process_env() == {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LR": "0.1",
        "APPORTION_ATTEMPT": "3",  # the agent's value wins over the job's env
        "CUDA_VISIBLE_DEVICES": "2,3",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # indices in NVML's (PCI) order, whatever the job asked
        "NVIDIA_VISIBLE_DEVICES": "2,3",
        "APPORTION_JOB_ID": "j1",
        "APPORTION_REPLICA": "0",
        "APPORTION_NODE_ID": "n1",
        "APPORTION_CHECKPOINT_DIR": "/ckpt/j1",
        "APPORTION_PROGRESS_FILE": "/ckpt/j1/progress",
        "TMPDIR": "/logs/j1/tmp.attempt-3.replica-0",
    }
    assert "APPORTION_CHECKPOINT_DIR" not in w.process_env()
    alice = logic.Account("alice", 2001, 2001, (2001,), "/home/alice")
    job_env = {"PATH": "/opt/conda/bin", "HOME": "/root", "USER": "root"}
    env = logic.replace(w, env=job_env, account=alice).process_env("/bin", "en_GB.UTF-8")
    # the job's PATH wins over the node's; HOME and USER are always the account's
    assert (env["PATH"], env["LANG"], env["HOME"], env["USER"]) == (
        "/opt/conda/bin",
        "en_GB.UTF-8",
        "/home/alice",
        "alice",
    )
    array_vars = {"APPORTION_ARRAY_ID", "APPORTION_ARRAY_INDEX"}  # an array element's only
    assert (
        set(env)
        == set(logic.JOB_ENV_ALLOWED) - {"APPORTION_CHECKPOINT_DIR", "APPORTION_PROGRESS_FILE", "TMPDIR"} - array_vars
    )
    element = logic.replace(w, env={"APPORTION_ARRAY_ID": "sweep", "APPORTION_ARRAY_INDEX": "7"}).process_env()
    assert (element["APPORTION_ARRAY_ID"], element["APPORTION_ARRAY_INDEX"]) == ("sweep", "7")


# --------------------------------------------------------------------------- once per new value

W = Workload("n1", "j1", 2, 0, (0,), ("train",), None)


def test_observe_progress_publishes_once_per_new_value():
    """A history of looks at the file -> exactly the events and problems expected."""
    looks = [
        # stamp, content, expected progress published (or None), expected problem
        (None, None, None, None),  # no file yet
        ((1, 2, 100), b"10", 10.0, None),
        ((1, 2, 100), None, None, None),  # same stamp: not read again, nothing
        ((2, 2, 200), b"10", None, None),  # rewritten with the same value: nothing
        ((3, 3, 300), b"abc", None, "not a number: 'abc'"),
        ((4, 1, 400), b"5", None, "went backwards: 5 after 10"),
        ((5, 17, 500), b'{"progress_s": 20}', 20.0, None),
        ((6, 4, 600), None, None, "could not be read"),
        ((7, 4, 700), b"30.5", 30.5, None),
        (None, None, None, None),  # file removed: nothing, and the last value stays
        ((8, 2, 800), b"30", None, "went backwards: 30 after 30.5"),
    ]
    watch = ProgressWatch()
    published, problems = [], []
    for stamp, raw, want_value, want_problem in looks:
        seen = logic.observe_progress(watch, W.key, stamp, raw, T0)
        assert (seen.event.progress_s if seen.event else None, seen.problem) == (want_value, want_problem), stamp
        assert seen.watch.stamp == stamp
        watch = seen.watch
        if seen.event is not None:
            published.append(seen.event)
        if seen.problem is not None:
            problems.append(seen.problem)
    assert [(e.job_id, e.attempt, e.replica, e.node_id, e.progress_s, e.ts) for e in published] == [
        ("j1", 2, 0, "n1", 10.0, T0),
        ("j1", 2, 0, "n1", 20.0, T0),
        ("j1", 2, 0, "n1", 30.5, T0),
    ]
    assert watch == ProgressWatch(stamp=(8, 2, 800), published=30.5)
    assert len(problems) == 4


def test_checkpoint_event_id_is_deterministic_per_run_and_value():
    a = logic.checkpointed_event(W.key, 10.0, T0)
    assert a.event_id == logic.checkpointed_event(W.key, 10.0, datetime(2030, 1, 1, tzinfo=UTC)).event_id
    assert a.event_id == det_id("JobCheckpointed", "n1", "j1", 2, 0, "10.0")
    others = {
        logic.checkpointed_event(W.key, 11.0, T0).event_id,
        logic.checkpointed_event(logic.replace(W, attempt=3).key, 10.0, T0).event_id,
        logic.checkpointed_event(logic.replace(W, replica=1).key, 10.0, T0).event_id,
    }
    assert a.event_id not in others and len(others) == 3


def test_baseline_stamp_hides_the_previous_attempts_report():
    """Launch takes the stamp of the file left by attempt 1: unchanged, it is not attempt 2's checkpoint."""
    baseline = ProgressWatch(stamp=(9, 2, 900))
    assert logic.observe_progress(baseline, W.key, (9, 2, 900), None, T0).event is None
    again = logic.observe_progress(baseline, W.key, (10, 2, 950), b"25", T0)  # attempt 2 rewrote 25: its checkpoint now
    assert again.event is not None and again.event.progress_s == 25.0 and again.event.attempt == 2


# --------------------------------------------------------------------------- runtime with real processes


def make_agent(clock: ManualClock, sink: Sink, root: Path) -> NodeAgent:
    probe = FakeGpuProbe.with_gpus(4)
    node = NodeSpec("n1", probe.inventory.gpus, "sim", False)
    return NodeAgent(
        [(node, probe)],
        sink,
        clock,
        claim_prefix="n",
        checkpoint_root=root / "ckpt",
        job_log_dir=root / "logs",
    )


def start(command: tuple[str, ...], attempt: int = 1, job: str = "j1") -> StartWorkload:
    return StartWorkload(ts=T0, node_id="n1", job_id=job, attempt=attempt, gpus=(0,), command=command, fencing_token=1)


def stop(attempt: int = 1, job: str = "j1") -> StopWorkload:
    return StopWorkload(ts=T0, node_id="n1", job_id=job, attempt=attempt, grace_s=30.0)


def content_is(path: Path, text: str):
    def check() -> bool:
        try:
            return path.read_text() == text
        except FileNotFoundError:
            return False

    return check


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_checkpoints_final_checkpoint_on_sigterm_and_resume(tmp_path):
    """Attempt 1: 10, 20, then 25 on SIGTERM, before its JobFailed; attempt 2 sees attempt 2 and 25, writes 35."""
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink, tmp_path)
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    cmd = (sys.executable, str(script))
    ckpt = tmp_path / "ckpt" / "j1"
    progress = ckpt / "progress"

    await agent.on_event(start(cmd))
    await until(content_is(progress, "10.0"), "the first checkpoint")
    await agent.poll_progress()
    await agent.poll_progress()  # nothing new: no second event
    assert [e.progress_s for e in sink.of(JobCheckpointed)] == [10.0]
    (ckpt / "go").touch()
    await until(content_is(progress, "20.0"), "the second checkpoint")
    await agent.poll_progress()
    await agent.on_event(stop())
    await until(lambda: sink.of(JobFailed), "attempt 1 to exit")

    await agent.on_event(start(cmd, attempt=2))
    await asyncio.wait_for(agent.idle(), WAIT_S)

    kinds = [(type(e).__name__, e.attempt, getattr(e, "progress_s", None)) for e in sink.events]
    assert kinds == [
        ("JobStarted", 1, None),
        ("JobCheckpointed", 1, 10.0),
        ("JobCheckpointed", 1, 20.0),
        ("JobCheckpointed", 1, 25.0),  # written on SIGTERM, published before the exit
        ("JobFailed", 1, None),
        ("JobStarted", 2, None),
        ("JobCheckpointed", 2, 35.0),  # written just before a clean exit: the last look publishes it
        ("JobCompleted", 2, None),
    ]
    failed = sink.of(JobFailed)[0]
    assert (failed.reason, failed.exit_code) == ("stopped", 0)
    assert all((e.node_id, e.replica, e.ts) == ("n1", 0, T0) for e in sink.of(JobCheckpointed))
    seen1 = json.loads((ckpt / "seen-1.json").read_text())
    seen2 = json.loads((ckpt / "seen-2.json").read_text())
    assert seen1 == {"attempt": 1, "resumed_s": 0.0, "cwd": str(ckpt), "job": "j1"}
    assert seen2 == {"attempt": 2, "resumed_s": 25.0, "cwd": str(ckpt), "job": "j1"}
    logs = tmp_path / "logs" / "j1"
    assert (logs / "attempt-1.replica-0.out").read_text() == "attempt 1 resumed from 0.0\nfinal checkpoint at 25.0\n"
    assert (logs / "attempt-2.replica-0.out").read_text() == "attempt 2 resumed from 25.0\n"
    assert (logs / "attempt-1.replica-0.err").read_text() == ""
    assert not agent._progress  # nothing left watched


SLEEPER = "import time\nwhile True:\n    time.sleep(1)\n"


async def test_invalid_reports_are_logged_and_ignored_and_agent_keeps_running(tmp_path, caplog):
    """The test plays the workload's writer: garbage, a value, a repeat, a step back, a bigger value."""
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink, tmp_path)
    ckpt = tmp_path / "ckpt" / "j1"
    ckpt.mkdir(parents=True)
    progress = ckpt / "progress"
    write_atomically(progress, "7")  # left by an earlier attempt: not this attempt's checkpoint
    await agent.on_event(start((sys.executable, "-c", SLEEPER), attempt=2))
    await agent.poll_progress()
    assert not sink.of(JobCheckpointed)

    published = []
    with caplog.at_level(logging.WARNING, logger="apportion.node_agent"):
        for text in ["three", "30", "30", "20", '{"progress_s": 45.5}', "-1"]:
            write_atomically(progress, text)
            await agent.poll_progress()
            published.append([e.progress_s for e in sink.of(JobCheckpointed)])
    assert published == [[], [30.0], [30.0], [30.0], [30.0, 45.5], [30.0, 45.5]]
    problems = [r.getMessage() for r in caplog.records if "ignored progress report" in r.getMessage()]
    assert problems == [
        f"ignored progress report of j1 attempt 2 replica 0 ({progress}): not a number: 'three'",
        f"ignored progress report of j1 attempt 2 replica 0 ({progress}): went backwards: 20 after 30",
        f"ignored progress report of j1 attempt 2 replica 0 ({progress}): negative: -1",
    ]
    assert set(agent.state.running) == {("n1", "j1", 2, 0)}  # still running, still watched
    await agent.on_event(stop(attempt=2))
    await asyncio.wait_for(agent.idle(), WAIT_S)
    assert [type(e).__name__ for e in sink.events] == [
        "JobStarted",
        "JobCheckpointed",
        "JobCheckpointed",
        "JobFailed",
    ]


async def test_links_hard_links_and_fifos_are_not_read(tmp_path):
    """A workload cannot make the agent follow a link to another file, read a file it hard-linked there, or
    block on a FIFO: each counts as absent."""
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink, tmp_path)
    await agent.on_event(start((sys.executable, "-c", SLEEPER)))
    try:
        progress = tmp_path / "ckpt" / "j1" / "progress"
        secret = tmp_path / "secret"
        secret.write_text("77")
        progress.symlink_to(secret)
        await agent.poll_progress()
        progress.unlink()
        os.link(secret, progress)  # the same file under the progress file's name
        await agent.poll_progress()
        progress.unlink()
        os.mkfifo(progress)
        await asyncio.wait_for(agent.poll_progress(), WAIT_S)
        assert not sink.of(JobCheckpointed)
        progress.unlink()
        write_atomically(progress, "12")
        await agent.poll_progress()
        assert [e.progress_s for e in sink.of(JobCheckpointed)] == [12.0]
    finally:  # the sleeper never outlives the test, failed or not
        await agent.on_event(stop())
        await asyncio.wait_for(agent.idle(), WAIT_S)


async def test_simulated_workloads_get_no_files(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    probe = FakeGpuProbe.with_gpus(4)
    agent = NodeAgent(
        [(NodeSpec("n1", probe.inventory.gpus, "sim", True), probe)],
        sink,
        clock,
        checkpoint_root=tmp_path / "ckpt",
        job_log_dir=tmp_path / "logs",
    )
    await agent.on_event(
        StartWorkload(ts=T0, node_id="n1", job_id="s1", attempt=1, gpus=(0,), duration_s=5.0, fencing_token=1)
    )
    assert agent.state.running[("n1", "s1", 1, 0)].files is None
    await until(lambda: clock.sleepers >= 1, "the simulated workload to sleep")
    clock.advance(5)
    await asyncio.wait_for(agent.idle(), WAIT_S)
    assert [type(e) for e in sink.events] == [JobStarted, JobCompleted]
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "logs").exists()


async def test_unwritable_checkpoint_root_is_a_spawn_failure(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    probe = FakeGpuProbe.with_gpus(4)
    agent = NodeAgent(
        [(NodeSpec("n1", probe.inventory.gpus, "sim", False), probe)], sink, clock, checkpoint_root=blocker
    )
    await agent.on_event(start((sys.executable, "-c", "pass")))
    (failed,) = sink.of(JobFailed)
    assert failed.reason.startswith("spawn failed") and not agent.state.running and not agent._progress


def journaled_agent(tmp_path: Path, sink: Sink, clock: ManualClock) -> NodeAgent:
    """An agent on real node n1 with its journal and checkpoint root in ``tmp_path`` (the same for a restart)."""
    probe = FakeGpuProbe.with_gpus(4)
    node = NodeSpec("n1", probe.inventory.gpus, "sim", False)
    return NodeAgent(
        [(node, probe)],
        sink,
        clock,
        journal=Journal(tmp_path / "agent.journal"),
        claim_prefix="n",
        checkpoint_root=tmp_path / "ckpt",
    )


async def crash(agent: NodeAgent) -> None:
    """Drop the agent without shutdown: its processes keep running, nothing more is reported."""
    for t in list(agent._tasks.values()):
        t.cancel()
    await asyncio.gather(*agent._tasks.values(), return_exceptions=True)


async def test_restarted_agent_publishes_the_orphans_last_checkpoint_and_adopts_it(tmp_path):
    """Agent 1 publishes 40, the workload then writes 55, agent 1 dies; agent 2 publishes 55 and adopts the process.

    The adopted process can still be stopped (JobFailed "stopped", exit code unknown) and its JobStarted is
    published again exactly as before (same id and content: readers de-duplicate it).
    """
    clock, sink = ManualClock(T0), Sink()
    agent = journaled_agent(tmp_path, sink, clock)
    await agent.on_event(start((sys.executable, "-c", SLEEPER)))
    progress = tmp_path / "ckpt" / "j1" / "progress"
    write_atomically(progress, "40")
    await agent.poll_progress()
    assert [e.progress_s for e in sink.of(JobCheckpointed)] == [40.0]
    write_atomically(progress, "55")
    pid = agent._procs[("n1", "j1", 1, 0)].pid
    await crash(agent)

    sink2 = Sink()
    agent2 = journaled_agent(tmp_path, sink2, clock)
    await agent2.start(heartbeats=False, poll_progress=False)
    kinds = [(type(e).__name__, getattr(e, "progress_s", None), getattr(e, "pid", None)) for e in sink2.events]
    assert kinds == [("JobCheckpointed", 55.0, None), ("JobStarted", None, pid), ("NodeRegistered", None, None)]
    assert sink2.events[0].event_id == logic.checkpointed_event(("n1", "j1", 1, 0), 55.0, T0).event_id
    assert sink2.events[1] == sink.of(JobStarted)[0]
    assert running(pid) and agent2.state.running[("n1", "j1", 1, 0)].adopted
    await agent2.on_event(stop())
    await asyncio.wait_for(agent2.idle(), WAIT_S)
    (failed,) = sink2.of(JobFailed)
    assert (failed.reason, failed.exit_code) == ("stopped", None)
    await until(lambda: not running(pid), "the adopted process to be stopped")


async def test_restarted_agent_republishes_an_already_published_checkpoint_with_the_same_id(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    agent = journaled_agent(tmp_path, sink, clock)
    await agent.on_event(start((sys.executable, "-c", SLEEPER)))
    pid = agent._procs[("n1", "j1", 1, 0)].pid
    write_atomically(tmp_path / "ckpt" / "j1" / "progress", "40")
    await agent.poll_progress()
    await crash(agent)
    sink2 = Sink()
    agent2 = journaled_agent(tmp_path, sink2, clock)
    await agent2.start(heartbeats=False, poll_progress=False)
    (again,) = sink2.of(JobCheckpointed)
    assert again.event_id == sink.of(JobCheckpointed)[0].event_id  # readers de-duplicate it
    await agent2.shutdown(grace_s=0)
    await until(lambda: not running(pid), "the adopted process to be stopped")


async def test_restarted_agent_publishes_nothing_when_the_orphan_never_reported(tmp_path):
    """The file still holds the previous attempt's report (the stamp journalled at start): not this attempt's."""
    clock, sink = ManualClock(T0), Sink()
    (tmp_path / "ckpt" / "j1").mkdir(parents=True)
    write_atomically(tmp_path / "ckpt" / "j1" / "progress", "25")
    agent = journaled_agent(tmp_path, sink, clock)
    await agent.on_event(start((sys.executable, "-c", SLEEPER), attempt=2))
    pid = agent._procs[("n1", "j1", 2, 0)].pid
    await crash(agent)
    sink2 = Sink()
    agent2 = journaled_agent(tmp_path, sink2, clock)
    await agent2.start(heartbeats=False, poll_progress=False)
    assert [type(e).__name__ for e in sink2.events] == ["JobStarted", "NodeRegistered"]
    await agent2.shutdown(grace_s=0)
    await until(lambda: not running(pid), "the adopted process to be stopped")


async def test_orphan_whose_process_died_is_reported_lost_with_its_last_checkpoint(tmp_path):
    """The process dies while the agent is down: JobCheckpointed 30, then JobLost (requeued), never JobFailed."""
    clock, sink = ManualClock(T0), Sink()
    agent = journaled_agent(tmp_path, sink, clock)
    await agent.on_event(start((sys.executable, "-c", SLEEPER)))
    proc = agent._procs[("n1", "j1", 1, 0)]
    write_atomically(tmp_path / "ckpt" / "j1" / "progress", "30")
    await crash(agent)
    proc.kill()
    await proc.wait()
    sink2 = Sink()
    agent2 = journaled_agent(tmp_path, sink2, clock)
    await agent2.start(heartbeats=False, poll_progress=False)
    kinds = [(type(e).__name__, getattr(e, "progress_s", None)) for e in sink2.events]
    assert kinds == [("JobCheckpointed", 30.0), ("JobLost", None), ("NodeRegistered", None)]
    lost = sink2.events[1]
    assert (lost.job_id, lost.attempt, lost.node_id, lost.charged_until) == ("j1", 1, "n1", T0)
    assert not agent2.state.running and ("j1", 1) in agent2.state.lost_runs
    # a third start reads the journal: nothing is reported twice, the lost run stays lost
    sink3 = Sink()
    agent3 = journaled_agent(tmp_path, sink3, clock)
    await agent3.start(heartbeats=False, poll_progress=False)
    assert [type(e).__name__ for e in sink3.events] == ["NodeRegistered"]
    assert ("j1", 1) in agent3.state.lost_runs


async def test_adopted_process_that_exits_on_its_own_is_reported_lost(tmp_path):
    """Its exit code belongs to init after the restart: the outcome is unknown, so the run is lost (requeued)."""
    clock, sink = ManualClock(T0), Sink()
    agent = journaled_agent(tmp_path, sink, clock)
    go = tmp_path / "go"
    code = f"import os,time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\n"
    await agent.on_event(start((sys.executable, "-c", code)))
    await crash(agent)
    sink2 = Sink()
    agent2 = journaled_agent(tmp_path, sink2, clock)
    agent2.progress_poll_wall_s = 0.02
    await agent2.start(heartbeats=False, poll_progress=False)
    go.touch()
    await asyncio.wait_for(agent2.idle(), WAIT_S)
    assert [type(e).__name__ for e in sink2.events] == ["JobStarted", "NodeRegistered", "JobLost"]
    assert not sink2.of(JobFailed)


def test_settings_default_roots(tmp_path, monkeypatch):
    from services.node_agent.config import NodeAgentSettings

    monkeypatch.delenv("APPORTION_CHECKPOINT_ROOT", raising=False)
    monkeypatch.delenv("APPORTION_JOB_LOG_DIR", raising=False)
    with_state = NodeAgentSettings(node_id="gpu-7", state_dir=tmp_path / "state")
    assert with_state.checkpoint_root_path() == tmp_path / "state" / "checkpoints"
    assert with_state.job_log_path() == tmp_path / "state" / "job-logs"
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    bare = NodeAgentSettings(sim_nodes=4, node_prefix="rack1-")
    assert bare.checkpoint_root_path() == tmp_path / "tmp" / "apportion-node-agent-rack1" / "checkpoints"
    monkeypatch.setenv("APPORTION_CHECKPOINT_ROOT", str(tmp_path / "nfs"))
    monkeypatch.setenv("APPORTION_JOB_LOG_DIR", str(tmp_path / "out"))
    assert NodeAgentSettings().checkpoint_root_path() == tmp_path / "nfs"
    assert NodeAgentSettings().job_log_path() == tmp_path / "out"
