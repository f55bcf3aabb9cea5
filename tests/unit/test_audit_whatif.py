"""whatif on a tiny hand-built log, numbers checked by hand.

One node with 2 GPUs; a1 (lab/a) and b1 (lab/b) each want 2 GPUs for 1 h,
both submitted at T0, allocated (1 h minimum runtime)::

    recorded               new
    lab (1.0)              lab (1.0)
    ├── a  0.5             └── b  1.0
    └── b  0.5

Recorded: r_a = r_b = 0, ties by path -> a1 runs 0-1 h, b1 1-2 h.
  a: wait 0, b: wait 3600 s; each holds 2 GPU x 3600 s of a 2 GPU x 7200 s
  capacity -> alloc share 0.5 each.
New: lab/a is gone, a1 is rejected (never placed); b1 runs 0-1 h: wait 0,
  alloc share 7200 / 7200 = 1.0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apportion import events
from apportion.audit.verify import records_from_events
from apportion.audit.whatif import jobs_from_log, load_tree, nodes_from_log, whatif
from apportion.timeutil import from_us

T0 = 1_700_000_000_000_000


def tiny_log() -> list:
    t = from_us(T0)
    evs: list = [
        events.BudgetSet(path=p, share=s, ts=t, producer="ops")
        for p, s in (("lab", 1.0), ("lab/a", 0.5), ("lab/b", 0.5))
    ]
    evs.append(events.NodeRegistered(node_id="n0", gpu_count=2, ts=t, producer="agent"))
    for jid, b in (("a1", "lab/a"), ("b1", "lab/b")):
        evs.append(
            events.JobSubmitted(
                job_id=jid,
                budget=b,
                user="u",
                gpus_per_replica=2,
                min_runtime_s=3600,
                duration_s=3600,
                submitted_at=t,
                ts=t,
                producer="test",
            )
        )
    return records_from_events(evs)


def test_inputs_from_the_log() -> None:
    recs = tiny_log()
    jobs, skipped = jobs_from_log(recs)
    assert [(j.job_id, j.budget, j.gpus_per_replica, j.duration_s, j.submit_us) for j in jobs] == [
        ("a1", "lab/a", 2, 3600.0, T0),
        ("b1", "lab/b", 2, 3600.0, T0),
    ]
    assert skipped == []
    assert [(n.node_id, n.gpus) for n in nodes_from_log(recs)] == [("n0", 2)]


def test_side_by_side(tmp_path: Path) -> None:
    f = tmp_path / "new.yaml"
    f.write_text("budgets:\n  lab: 1.0\n  lab/b: 1.0\n")
    w = whatif(tiny_log(), load_tree(f))
    rows = {r["path"]: r for r in w.rows}
    a, b = rows["lab/a"], rows["lab/b"]
    assert a["new"] is None and a["recorded"]["alloc_share"] == pytest.approx(0.5)
    assert a["recorded"]["wait_p50_s"] == 0
    assert b["recorded"]["alloc_share"] == pytest.approx(0.5) and b["recorded"]["wait_p50_s"] == 3600
    assert b["new"]["alloc_share"] == pytest.approx(1.0) and b["new"]["wait_p50_s"] == 0
    assert b["diff"]["wait_p50_s"] == -3600 and b["diff"]["alloc_share"] == pytest.approx(0.5)
    assert w.new.never == 1 and w.recorded.never == 0
    assert (w.jobs, w.nodes, w.gpus) == (2, 1, 2)


def test_a_bare_mapping_is_a_tree(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("lab: 1.0\nlab/x: 0.5\n")
    assert "lab/x" in load_tree(f)
