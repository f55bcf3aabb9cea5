"""Dispatcher snapshots (``services/dispatcher/snapshot.py``): a restart from a snapshot plus the log's tail
gives the state a full replay gives, and decides the same from then on; unusable snapshots are refused
with their reason.

Runs on the in-memory log of ``test_dispatcher.py`` (one partition per topic).
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest

from apportion import events
from apportion.settings import topic_name
from apportion.statefile import CheckpointError, check_offsets
from apportion.timeutil import to_us
from services.dispatcher import snapshot as snapmod
from tests.kit.dispatcher import INPUTS, T0, ListLog, drive, history, service, submit
from tests.kit.narrowing import narrow_each

PREFIX = "snap-test."


def summary(svc: Any) -> dict[str, Any]:
    """Everything a decision can depend on, as plain values."""
    st = svc.state
    t = to_us(T0) + 3_600_000_000
    return {
        "jobs": {j: (r.status, r.attempt, r.submitted_at_us, r.queued_at_us) for j, r in st.jobs.items()},
        "finished": dict(st.finished),
        "pending": {b: [p.job_id for p in lst] for b, lst in st.pending.items()},
        "runs": dict(st.cluster.runs),
        "nodes": dict(st.cluster.nodes),
        "node_runs": dict(st.cluster.node_runs),
        "stopping": dict(st.stopping),
        "awaiting": dict(st.awaiting),
        "seen": dict(st.seen),
        "clock": st.clock_us,
        "tree": st.tree,
        "occupancy": st.ledger.occupancy(t),
        "capacity": st.ledger.capacity_gpu_s(t),
        "inputs": dict(svc.inputs),
        "ledger": len(svc.intake.ledger),
    }


def tail(log: ListLog, offsets: dict[str, int]) -> list[Any]:
    return [r for r in log.records if r.topic in INPUTS and r.offset >= offsets.get(f"{r.topic}:{r.partition}", 0)]


def test_a_restart_from_a_snapshot_equals_a_full_replay_and_decides_the_same() -> None:
    rounds = history()
    log = ListLog()
    leader = service(log, echoes=True)
    for inputs in rounds[:2]:
        log.put(*inputs)
        drive(leader, log)
    fields = snapmod.encode(leader.snapshot(), topic_prefix=PREFIX)
    log.put(*rounds[2])  # after the snapshot: a start report and a new submission
    drive(leader, log)

    snap = snapmod.decode(fields, window_s=leader.settings.window_s, topic_prefix=PREFIX)
    assert snap.fencing_token == 7
    resumed, replayed = service(ListLog(), echoes=False), service(ListLog(), echoes=False)
    resumed.restore(snap)
    short = tail(log, snap.offsets)
    everything = tail(log, {})
    assert 0 < len(short) < len(everything)
    out_resumed = resumed.bootstrap(short)
    out_replayed = replayed.bootstrap(everything)
    # the leader decided everything already; both send the starts of the runs without a JobStarted again
    assert out_resumed == out_replayed
    assert [(e.type, e.job_id) for e in narrow_each(events.StartWorkload, out_resumed)] == [
        ("StartWorkload", "j2"),
        ("StartWorkload", "j4"),
    ]
    # the one difference: the leader's own commands (on a topic it does not read) are in the resumed state's seen
    commands = [events.decode(v).event_id for t, v in log.published if t not in INPUTS]
    before = set(commands[:2])  # the two StartWorkloads decided before the snapshot (a third one after it)
    assert len(commands) == 3 and set(resumed.state.seen) - set(replayed.state.seen) == before
    for k in before:
        del resumed.state.seen[k]
    assert summary(resumed) == summary(replayed)
    assert summary(resumed)["jobs"] == summary(leader)["jobs"]

    # and from then on they decide alike, byte for byte
    more = [submit("j5", "lab/a", 1), submit("j6", "lab/b", 4)]
    sent = []
    for svc in (resumed, replayed):
        out = []
        for e in more:
            rec = type(short[0])(topic_name(events.TOPIC_OF[e.type]), 0, 10_000, e.job_id.encode(), events.encode(e), 0)
            got, _ = svc.ingest([rec])
            out += got
        out += svc.tick()
        sent.append([events.encode(e) for e in out])
    assert sent[0] == sent[1] and sent[0]


def test_snapshot_fields_are_checked() -> None:
    log = ListLog()
    svc = service(log, echoes=True)
    log.put(*history()[0])
    drive(svc, log)
    good = snapmod.encode(svc.snapshot(), topic_prefix=PREFIX)
    header = json.loads(good["header"])
    w = svc.settings.window_s

    def reason(fields: dict, window_s: float = w, prefix: str = PREFIX) -> str:
        with pytest.raises(CheckpointError) as exc:
            snapmod.decode(fields, window_s=window_s, topic_prefix=prefix)
        return exc.value.reason

    def with_header(**kw: Any) -> dict:
        return {**good, "header": json.dumps({**header, **kw}).encode()}

    assert reason({}) == "missing"
    assert reason({"header": b"[1]"}) == "corrupt"
    assert reason(with_header(format=0)) == "format"
    assert reason(with_header(layout="0" * 16)) == "layout"
    assert reason(good, window_s=w / 2) == "window"
    assert reason(good, prefix="other.") == "topic_prefix"
    assert reason({**good, "state": good["state"][:-1] + b"x"}) == "corrupt"
    evil = pickle.dumps({"state": __import__("os").system}, protocol=5)
    assert reason({**with_header(state_bytes=len(evil)), "state": evil}) == "corrupt"  # checksum first
    import hashlib

    digest = hashlib.blake2b(evil, digest_size=16).hexdigest()
    assert reason({**with_header(state_bytes=len(evil), state_blake2b=digest), "state": evil}) == "corrupt"
    ok = snapmod.decode(good, window_s=w, topic_prefix=PREFIX)
    assert ok.offsets == header["offsets"] and summary_jobs(ok.state) == summary_jobs(svc.state)


def summary_jobs(state: Any) -> dict:
    return {j: (r.status, r.attempt) for j, r in state.jobs.items()}


def test_a_snapshot_never_replaces_one_of_a_newer_leader() -> None:
    log = ListLog()
    svc = service(log, echoes=True, token=7)
    stored = snapmod.encode(svc.snapshot(), topic_prefix=PREFIX)
    assert snapmod.newer_than_stored({}, 1)
    assert snapmod.newer_than_stored({"header": b"garbage"}, 1)
    assert snapmod.newer_than_stored(stored, 7) and snapmod.newer_than_stored(stored, 8)
    assert not snapmod.newer_than_stored(stored, 6)


def test_offsets_that_no_longer_fit_the_log_are_refused() -> None:
    def reason(offsets: dict, begin: dict, end: dict) -> str:
        with pytest.raises(CheckpointError) as exc:
            check_offsets(offsets, begin, end)
        return exc.value.reason

    assert reason({"a:0": 5}, {"a:0": 0, "b:0": 0}, {"a:0": 9, "b:0": 0}) == "partitions"
    assert reason({"a:0": 5}, {"a:0": 6}, {"a:0": 9}) == "offsets_before_log_start"
    assert reason({"a:0": 10}, {"a:0": 0}, {"a:0": 9}) == "offsets_after_log_end"
    check_offsets({"a:0": 9}, {"a:0": 0}, {"a:0": 9})


def test_a_snapshot_names_every_input_partition_so_an_empty_one_does_not_void_it() -> None:
    """A new user's dispatcher rebuilt from 0 on every restart ("no usable snapshot (partitions: missing
    ['apportion.nodes:2'])"): the snapshot named only partitions a record was read from."""
    log = ListLog()
    svc = service(log, echoes=True)
    begin = {f"{t}:0": 0 for t in INPUTS} | {"apportion.nodes:2": 0}  # one partition that never gets a record
    svc.read_from(begin)
    for round_ in history():
        log.put(*round_)
        drive(svc, log)
    offsets = svc.snapshot().offsets
    assert offsets["apportion.nodes:2"] == 0 and set(offsets) == set(begin)
    end = {p: log.next_offset.get(p.split(":")[0], 0) for p in begin}
    check_offsets(offsets, begin, end)  # fits: no CheckpointError("partitions")
    assert {p: offsets[p] for p in begin if p != "apportion.nodes:2"} == {
        p: end[p] for p in begin if p != "apportion.nodes:2"
    }
