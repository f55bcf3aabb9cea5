"""The stale read-model notice: ``share`` says so when the accounting read model lags the log it folds by more than
``STALE_AFTER_RECORDS`` records (its meta's ``offsets`` against the log's end offsets), and ``--json`` carries it."""

from __future__ import annotations

import json

import pytest

from apportion import readmodel
from apportion.readmodel import STALE_AFTER_RECORDS, lag_records, stale_notice
from tests.kit.cli import no_stack, run
from tests.kit.fakes import FakeRedis

OFFSETS = {"apportion.jobs:0": 400, "apportion.budgets:0": 7}
META = {"at": "2026-01-05T10:00:00+00:00", "offsets": OFFSETS}


@pytest.mark.parametrize(
    ("ends", "lag"),
    [
        ({"apportion.jobs:0": 400, "apportion.budgets:0": 7}, 0),  # caught up
        ({"apportion.jobs:0": 450, "apportion.budgets:0": 9}, 52),  # 50 + 2
        ({"apportion.jobs:0": 300}, 0),  # ends below the fold (a truncated log): never negative; missing: 0
    ],
    ids=["caught-up", "behind", "never-negative"],
)
def test_lag_is_the_records_not_yet_folded(ends: dict[str, int], lag: int) -> None:
    assert lag_records(OFFSETS, ends) == lag


def test_the_notice_starts_past_the_threshold() -> None:
    at = {"apportion.jobs:0": 400 + STALE_AFTER_RECORDS, "apportion.budgets:0": 7}
    assert stale_notice(META, at) is None
    assert stale_notice(META, {**at, "apportion.budgets:0": 8}) == (
        "stale: the read model (as of 2026-01-05T10:00:00+00:00) is 101 records behind the log; is its service running?"
    )


@pytest.fixture
def share_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    from apportion.cli import budgets

    no_stack(monkeypatch)
    r = FakeRedis()
    readmodel.replace_hash(r, readmodel.usage_key(), {"meta": META})
    row = {"path": "lab", "share": 1.0, "abs_share": 1.0, "occupancy_gpu_s": 0.0, "ratio": 0.0, "rank": None}
    readmodel.replace_hash(r, readmodel.budgets_key(), {"lab": row})
    monkeypatch.setattr(budgets, "_redis", lambda url: r)
    monkeypatch.setattr(budgets, "end_offsets", lambda b, keys: {"apportion.jobs:0": 900, "apportion.budgets:0": 7})


def test_share_says_it_is_stale(share_behind: None) -> None:
    res = run("share")
    assert res.exit_code == 0
    assert res.stdout.splitlines()[0] == (
        "note: stale: the read model (as of 2026-01-05T10:00:00+00:00) is 500 records behind the log; "
        "is its service running?"
    )


def test_share_json_carries_the_notice(share_behind: None) -> None:
    doc = json.loads(run("share", "--json").stdout)
    assert doc["stale"].startswith("stale: the read model (as of 2026-01-05T10:00:00+00:00) is 500 records behind")
