"""Simulated workloads checkpoint like the simulator's (``docs/checkpoints.md``, rules D1.checkpoint and D3.checkpoints).

A ``StartWorkload`` with ``progress_s`` (the job's last saved progress) and
``checkpoint_interval_s`` runs ``duration_s - progress_s`` event seconds,
publishes ``JobCheckpointed`` at each multiple of the interval its progress
reaches (never at the resume point again, never at the end) and saves its
progress on SIGTERM when the stop has a grace period. A command without
``progress_s`` (older dispatchers) runs its whole duration and saves nothing.

Pure helpers are tables with hand-computed values; runtime tests drive
:class:`services.node_agent.service.NodeAgent` with a list sink and a
:class:`ManualClock`, waiting on the clock's sleepers (bounded), never on wall time.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest

from apportion.clock import ManualClock
from apportion.events import JobCheckpointed, JobCompleted, JobFailed, JobLost, JobStarted, StartWorkload, StopWorkload
from apportion.gpu import FakeGpuProbe
from services.node_agent import logic
from services.node_agent.logic import NodeSpec, Workload
from services.node_agent.service import NodeAgent
from services.node_agent.store import Journal
from tests.kit.node_agent import Sink

T0 = datetime(2025, 3, 1, tzinfo=UTC)
KEY = ("n1", "j1", 2, 0)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def start(
    *,
    duration_s: float = 150.0,
    progress_s: float | None = 60.0,
    every: float | None = 60.0,
    attempt: int = 2,
    gpus: tuple[int, ...] = (0, 1),
) -> StartWorkload:
    return StartWorkload(
        ts=T0,
        node_id="n1",
        job_id="j1",
        attempt=attempt,
        gpus=gpus,
        duration_s=duration_s,
        progress_s=progress_s,
        checkpoint_interval_s=every,
        fencing_token=1,
    )


def stop(grace_s: float = 30.0, attempt: int = 2) -> StopWorkload:
    return StopWorkload(ts=T0, node_id="n1", job_id="j1", attempt=attempt, grace_s=grace_s, fencing_token=1)


def wl(duration_s: float, progress_s: float | None, every: float | None, grace_s: float = 30.0) -> Workload:
    return Workload(
        "n1", "j1", 2, 0, (0,), None, duration_s, grace_s=grace_s, progress_s=progress_s, checkpoint_interval_s=every
    )


# --------------------------------------------------------------------------- pure helpers

REMAINING = [
    # id, workload, event seconds it runs
    ("resumes from 60 of 150", wl(150, 60, 60), 90.0),
    ("first attempt", wl(150, 0, 60), 150.0),
    ("older command: the whole duration", wl(150, None, None), 150.0),
    ("saved past the duration (clamped)", wl(150, 200, 60), 0.0),
]


@pytest.mark.parametrize("case_id,w,expected", REMAINING, ids=[c[0] for c in REMAINING])
def test_sim_remaining_s(case_id, w, expected):
    assert logic.sim_remaining_s(w) == expected


CHECKPOINT_K = [
    # id, workload, elapsed s, checkpoints saved (k: progress k * interval)
    ("the resume point counts as saved", wl(150, 60, 60), 0.0, 1),
    ("just before 120", wl(150, 60, 60), 59.999, 1),
    ("at 120", wl(150, 60, 60), 60.0, 2),
    ("none at or past the end: 150 is not a multiple, 120 is the last", wl(150, 60, 60), 90.0, 2),
    ("duration a multiple: 180 is the end, no checkpoint there", wl(180, 0, 60), 180.0, 2),
    ("no interval", wl(150, 0, None), 100.0, 0),
    ("older command", wl(150, None, 60), 100.0, 0),
    ("a tenth-second interval at 0.3 s (float progress)", wl(10, 0, 0.1), 0.3, 3),
]


@pytest.mark.parametrize("case_id,w,elapsed,k", CHECKPOINT_K, ids=[c[0] for c in CHECKPOINT_K])
def test_sim_checkpoint_k(case_id, w, elapsed, k):
    assert logic.sim_checkpoint_k(w, elapsed) == k


NEXT_WAKE = [
    # id, workload, elapsed s, next happening (s into the run) or None
    ("next checkpoint 120 is 60 s in", wl(150, 60, 60), 0.0, 60.0),
    ("after it, the end at 90 s", wl(150, 60, 60), 60.0, 90.0),
    ("done", wl(150, 60, 60), 90.0, None),
    ("no interval: the end", wl(150, 0, None), 10.0, 150.0),
    ("older command: the end", wl(150, None, None), 0.0, 150.0),
]


@pytest.mark.parametrize("case_id,w,elapsed,wake", NEXT_WAKE, ids=[c[0] for c in NEXT_WAKE])
def test_sim_next_wake_s(case_id, w, elapsed, wake):
    assert logic.sim_next_wake_s(w, elapsed) == wake


STOP_PROGRESS = [
    # id, workload, elapsed s at SIGTERM, progress saved or None
    ("85 s in from 0", wl(600, 0, 60), 85.0, 85.0),
    ("25 s in from 60", wl(150, 60, 60), 25.0, 85.0),
    ("no interval still saves (the simulator's checkpoint_on_stop=all)", wl(600, 0, None), 10.0, 10.0),
    ("no grace: SIGKILL at once saves nothing", wl(600, 0, 60, grace_s=0.0), 85.0, None),
    ("older command saves nothing", wl(600, None, None), 85.0, None),
]


@pytest.mark.parametrize("case_id,w,elapsed,saved", STOP_PROGRESS, ids=[c[0] for c in STOP_PROGRESS])
def test_sim_stop_progress_s(case_id, w, elapsed, saved):
    assert logic.sim_stop_progress_s(w, elapsed) == saved


def test_decide_start_passes_progress_and_interval_to_a_simulated_workload_only():
    st = logic.initial_state([spec()], claim_prefix="n")
    w = logic.decide_start(st, start(), T0)
    assert isinstance(w, logic.Launch)
    assert (w.workload.progress_s, w.workload.checkpoint_interval_s, w.workload.duration_s) == (60.0, 60.0, 150.0)
    real = logic.initial_state([spec(simulated=False)])
    proc = logic.decide_start(real, start().model_copy(update={"command": ("true",)}), T0)
    assert isinstance(proc, logic.Launch)
    assert (proc.workload.progress_s, proc.workload.checkpoint_interval_s) == (None, None)  # a process saves itself


def test_old_start_records_decode_without_the_fields():
    old = json.loads(start().model_dump_json())
    del old["progress_s"], old["checkpoint_interval_s"]
    from apportion.events import decode

    ev = decode(json.dumps(old))
    assert isinstance(ev, StartWorkload) and (ev.progress_s, ev.checkpoint_interval_s) == (None, None)


# --------------------------------------------------------------------------- runtime


def spec(simulated: bool = True) -> NodeSpec:
    return NodeSpec("n1", FakeGpuProbe.with_gpus(4).inventory.gpus, "sim", simulated)


def make_agent(clock: ManualClock, sink: Sink, journal: Journal | None = None) -> NodeAgent:
    return NodeAgent([(spec(), FakeGpuProbe.with_gpus(4))], sink, clock, journal=journal, claim_prefix="n")


async def settle(clock: ManualClock, sleepers: int = 1, deadline_s: float = 5.0) -> None:
    """Let tasks run until ``sleepers`` wait on the manual clock (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while clock.sleepers < sleepers:
        assert loop.time() < end, "tasks did not reach the clock in time"
        await asyncio.sleep(0.001)


async def tick(clock: ManualClock, seconds: float) -> None:
    """Advance the clock and let the woken workload publish and sleep again (or end)."""
    clock.advance(seconds)
    for _ in range(20):  # a few loop turns: wake, publish, sleep again
        await asyncio.sleep(0)


def checkpoints(sink: Sink) -> list[tuple[datetime, float, int | None]]:
    return [(e.ts, e.progress_s, e.replica) for e in sink.of(JobCheckpointed)]


async def test_resumed_workload_checkpoints_at_120_only_and_completes_after_90_event_seconds():
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(start())  # interval 60, duration 150, resuming from 60
    await settle(clock)
    await tick(clock, 59)
    assert checkpoints(sink) == []  # not 60 again: that is where it resumed
    await tick(clock, 1)
    assert checkpoints(sink) == [(at(60), 120.0, 0)]
    (cp,) = sink.of(JobCheckpointed)
    assert cp.event_id == logic.checkpointed_event(KEY, 120.0, at(60)).event_id  # the id is by value
    await settle(clock)
    await tick(clock, 29)
    assert not sink.of(JobCompleted)
    await tick(clock, 1)
    await asyncio.wait_for(agent.idle(), 5)
    (done,) = sink.of(JobCompleted)
    assert done.ts == at(90) and done.exit_code == 0
    assert checkpoints(sink) == [(at(60), 120.0, 0)]  # none at the end: it completed instead
    assert [type(e).__name__ for e in sink.events[-3:]] == ["JobStarted", "JobCheckpointed", "JobCompleted"]


async def test_a_late_wake_publishes_only_the_last_checkpoint_passed_and_still_ends_on_time():
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(start(duration_s=300.0, progress_s=0.0))
    await settle(clock)
    await tick(clock, 150)  # one jump past 60 and 120
    assert checkpoints(sink) == [(at(150), 120.0, 0)]
    await settle(clock)
    await tick(clock, 150)
    await asyncio.wait_for(agent.idle(), 5)
    # the jump reaches the end (300 s): it completes there, 180 and 240 were passed in the same jump
    assert [c[1] for c in checkpoints(sink)] == [120.0]
    (done,) = sink.of(JobCompleted)
    assert done.ts == at(300)


async def test_stopped_workload_saves_its_progress_at_the_sigterm_before_its_exit_report():
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(start(duration_s=600.0, progress_s=0.0, attempt=1))
    await settle(clock)
    await tick(clock, 60)
    await settle(clock)
    await tick(clock, 25)
    await agent.on_event(stop(grace_s=30.0, attempt=1))
    await asyncio.wait_for(agent.idle(), 5)
    assert checkpoints(sink) == [(at(60), 60.0, 0), (at(85), 85.0, 0)]
    (failed,) = sink.of(JobFailed)
    assert (failed.reason, failed.exit_code, failed.ts) == ("stopped", -15, at(85))
    assert [type(e).__name__ for e in sink.events[-2:]] == ["JobCheckpointed", "JobFailed"]


async def test_a_stop_without_grace_saves_nothing_and_an_old_command_never_checkpoints():
    for cmd, grace in (
        (start(duration_s=600.0, progress_s=0.0, attempt=1), 0.0),
        (
            start(duration_s=600.0, progress_s=None, attempt=1),
            30.0,
        ),
    ):
        clock, sink = ManualClock(T0), Sink()
        agent = make_agent(clock, sink)
        await agent.start(heartbeats=False)
        await agent.on_event(cmd)
        await settle(clock)
        await tick(clock, 30)
        await agent.on_event(stop(grace_s=grace, attempt=1))
        await asyncio.wait_for(agent.idle(), 5)
        assert checkpoints(sink) == []
        assert [f.reason for f in sink.of(JobFailed)] == ["stopped"]


async def test_old_command_runs_its_whole_duration():
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(start(progress_s=None))  # interval given but no resume point: the old behaviour
    await settle(clock)
    await tick(clock, 149)
    assert not sink.of(JobCompleted)
    await tick(clock, 1)
    await asyncio.wait_for(agent.idle(), 5)
    assert sink.of(JobCompleted)[0].ts == at(150) and checkpoints(sink) == []


async def test_agent_shutdown_saves_progress_then_reports_the_run_lost():
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(start())
    await settle(clock)
    await tick(clock, 40)
    await agent.shutdown()
    assert checkpoints(sink) == [(at(40), 100.0, 0)]  # 60 + 40
    assert [type(e).__name__ for e in sink.events[-2:]] == ["JobCheckpointed", "JobLost"]
    assert len(sink.of(JobLost)) == 1


async def test_restart_adopts_a_simulated_run_with_its_checkpoints_and_its_journalled_end(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    path = tmp_path / "agent.journal"
    agent = make_agent(clock, sink, Journal(path))
    await agent.on_event(start(duration_s=300.0))  # from 60 s of 300: ends at 240 s; progress 60 + t
    (line,) = [json.loads(x) for x in path.read_text().splitlines() if '"start"' in x]
    assert (line["sim_until"], line["sim_progress"], line["sim_every"]) == (at(240).isoformat(), 60.0, 60.0)
    await settle(clock)
    await tick(clock, 60)
    await settle(clock)
    await tick(clock, 10)
    assert checkpoints(sink) == [(at(60), 120.0, 0)]
    for t in list(agent._tasks.values()):  # "crash": no shutdown, no reports
        t.cancel()
    await asyncio.gather(*agent._tasks.values(), return_exceptions=True)
    clock.advance(70)  # down until 140 s: progress 200, the checkpoint at 180 was passed meanwhile
    sink2 = Sink()
    agent2 = make_agent(clock, sink2, Journal(path))
    await agent2.start(heartbeats=False)
    assert sink2.events[0] == sink.of(JobStarted)[0]  # re-published as journalled
    await settle(clock)
    assert checkpoints(sink2) == [(at(140), 180.0, 0)]
    await tick(clock, 40)
    assert checkpoints(sink2) == [(at(140), 180.0, 0), (at(180), 240.0, 0)]  # counted from the original start
    await settle(clock)
    await tick(clock, 59)
    assert not sink2.of(JobCompleted)
    await tick(clock, 1)
    await asyncio.wait_for(agent2.idle(), 5)
    (done,) = sink2.of(JobCompleted)
    assert done.ts == at(240)
