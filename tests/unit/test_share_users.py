"""``apportion share --users``: each budget's users under it, with the figures ``usage --by-user`` computes
(:func:`apportion.domain.user_usage.usage_by_user`) over the read model's window at its time.

The log is ``test_usage_by_user.LOG``; over 24 h at 3 h: lab/a alice 6 GPU-h allocated (60% of lab/a's 10),
bob 4 allocated and 2 unallocated (40%); lab/b carol 1 allocated (100%); j5 (alice, 32 GPU-h, 30 h to 26 h
before) is outside the window.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from apportion import readmodel
from apportion.audit.verify import records_from_events
from apportion.cli.main import app
from tests.kit.builders import dt, h
from tests.kit.cli import no_stack, run
from tests.kit.fakes import FakeRedis
from tests.unit.test_usage_by_user import LOG

META = {"at": dt(h(3)).isoformat(), "window_s": 86_400.0, "capacity_gpus": 8}


def row(path: str, share: float, o_h: float, u_h: float, rank: int | None) -> dict[str, Any]:
    return {
        "path": path,
        "share": share,
        "abs_share": share,
        "occupancy_gpu_s": o_h * 3600,
        "unallocated_gpu_s": u_h * 3600,
        "entitlement_gpu_s": share * 8 * 24 * 3600,
        "ratio": None if rank is None else o_h / (share * 8 * 24),
        "rank": rank,
    }


@pytest.fixture(autouse=True)
def stack(monkeypatch: pytest.MonkeyPatch) -> None:
    from apportion.bus import reader
    from apportion.cli import budgets, history
    from apportion.settings import Connection

    no_stack(monkeypatch)
    r = FakeRedis()
    readmodel.replace_hash(r, readmodel.usage_key(), {"meta": META})
    rows = [row("lab", 1.0, 11.0, 2.0, None), row("lab/a", 0.5, 10.0, 2.0, 2), row("lab/b", 0.5, 1.0, 0.0, 1)]
    readmodel.replace_hash(r, readmodel.budgets_key(), {x["path"]: x for x in rows})
    monkeypatch.setattr(budgets, "_redis", lambda url: r)
    monkeypatch.setattr(history, "_require_topics", lambda bootstrap, *names: Connection.resolve(bootstrap=bootstrap))
    monkeypatch.setattr(reader, "read_log", lambda bootstrap, topics: records_from_events(LOG))


def test_each_budgets_users_stand_under_it_at_80_columns() -> None:
    res = CliRunner().invoke(app, ["share", "--users"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[4:] == [
        "│ lab       │ 1.000 │ 1.000 │    11.0 │     2.0 │   192.0 │     - │      │",
        "│   a       │ 0.500 │ 0.500 │    10.0 │     2.0 │    96.0 │ 0.104 │    2 │",
        "│     alice │   60% │       │     6.0 │     0.0 │         │       │      │",
        "│     bob   │   40% │       │     4.0 │     2.0 │         │       │      │",
        "│   b       │ 0.500 │ 0.500 │     1.0 │     0.0 │    96.0 │ 0.010 │    1 │",
        "│     carol │  100% │       │     1.0 │     0.0 │         │       │      │",
        "└───────────┴───────┴───────┴─────────┴─────────┴─────────┴───────┴──────┘",
        "users: under their budget; share: their part of its O",
    ]


def test_the_json_carries_the_usage_by_user_rows() -> None:
    doc = json.loads(run("share", "--users", "--json").stdout)
    assert doc["users"] == [
        {"budget": "lab/a", "user": "alice", "allocated_gpu_h": 6.0, "unallocated_gpu_h": 0.0, "share_of_budget": 0.6},
        {"budget": "lab/a", "user": "bob", "allocated_gpu_h": 4.0, "unallocated_gpu_h": 2.0, "share_of_budget": 0.4},
        {"budget": "lab/b", "user": "carol", "allocated_gpu_h": 1.0, "unallocated_gpu_h": 0.0, "share_of_budget": 1.0},
    ]
    assert "users" not in json.loads(run("share", "--json").stdout)  # without --users the log is not read


def test_a_budget_gone_from_the_tree_still_lists_its_users(monkeypatch: pytest.MonkeyPatch) -> None:
    from apportion.cli import budgets

    r = FakeRedis()
    readmodel.replace_hash(r, readmodel.usage_key(), {"meta": META})
    readmodel.replace_hash(r, readmodel.budgets_key(), {"lab/a": row("lab/a", 1.0, 10.0, 2.0, 1)})
    monkeypatch.setattr(budgets, "_redis", lambda url: r)
    assert run("share", "-a").stdout.splitlines()[-4:-2] == [
        "│ lab/b (not in the tree) │       │       │         │         │         │       │      │",
        "│   carol                 │  100% │       │     1.0 │     0.0 │         │       │      │",
    ]


def test_users_do_not_go_with_forecast() -> None:
    res = run("share", "--users", "--forecast", "7d")
    assert res.exit_code == 2
    assert res.stderr == "error: --users shows the table now; it does not go with --forecast\n"
