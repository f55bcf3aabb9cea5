"""``audit explain`` after a forged node report the services refused, on a local stack's log (exported to
``tests/kit/fixtures/forged_completion_log.jsonl.gz``, cut at 22:36:31): a ``JobCompleted`` of the running job
``t2-victim`` (``apportion.jobs:1@21``), published as a node agent with another run's signature and dead-lettered
``unauthenticated_node`` by the dispatcher and the accounting. The services went on as if it had never been
written; ``explain`` folds it, so the next placement of the cluster (``carol-82c049967a75`` at 22:36:30) re-runs
with the victim's GPU free and its occupancy gone, says ``DIFFERS`` and exits 1 though the dispatcher decided
right (rule D10.proven-user). A rogue node agent can so make every later job's audit trail read as tampered."""

from __future__ import annotations

from pathlib import Path

import pytest

from apportion.audit.explain import explain
from apportion.audit.source import load_log
from apportion.cli.audit import _dispatch_config

LOG = Path(__file__).resolve().parents[1] / "kit" / "fixtures" / "forged_completion_log.jsonl.gz"
FORGED = ("apportion.jobs", 1, 21)


@pytest.fixture(autouse=True)
def _default_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", "")


def test_a_forged_completion_the_services_dead_lettered_leaves_the_next_placement_the_same() -> None:
    recs = load_log(from_file=LOG)
    cfg = _dispatch_config(recs, None, None, None, None, None)
    forged = [r for r in recs if (r.topic, r.partition, r.offset) == FORGED]
    assert [type(r.event).__name__ for r in forged] == ["JobCompleted"]
    honest = [r for r in recs if (r.topic, r.partition, r.offset) != FORGED]
    assert explain(honest, "carol-82c049967a75", cfg).decisions_match  # the log without the forgery re-runs same
    assert explain(recs, "carol-82c049967a75", cfg).decisions_match


def test_the_victims_timeline_shows_the_forged_completion_as_refused() -> None:
    recs = load_log(from_file=LOG)
    x = explain(recs, "t2-victim", _dispatch_config(recs, None, None, None, None, None))
    why = "unauthenticated_node: JobCompleted of node 'sim-0' is not signed by a key registered for it"
    forged = [e for e in x.timeline if e.offset == "apportion.jobs:1@21"]
    assert [(e.kind, e.summary, e.refused) for e in forged] == [
        ("JobCompleted", f"refused by the services: replica 0 completed ({why})", why)
    ]
    assert [e.refused for e in x.timeline].count(None) == len(x.timeline) - 1  # the victim's own records: folded
    assert x.to_dict()["timeline"][x.timeline.index(forged[0])]["refused"] == why
