"""The CLI's pure checks: budget diffs, the safe order of a file's changes, rollbacks, key partitions."""

from __future__ import annotations

import pytest

from apportion import events
from apportion.cli.verdicts import budget_diff, partition_of, restore_events, safe_order
from apportion.domain.budgets import BudgetError, BudgetTree
from tests.unit.builders import T0_DT

#   lab (1.0)
#   ├── prior (0.6) ── robotics (0.5, members alice,bob)
#   └── vision (0.4)
IN_FORCE = BudgetTree.from_mapping(
    {
        "lab": 1.0,
        "lab/prior": 0.6,
        "lab/prior/robotics": {"share": 0.5, "members": ["alice", "bob"]},
        "lab/vision": {"share": 0.4, "max_min_runtime_s": 28800.0},
    }
)


def _fold(tree: BudgetTree, evts: list) -> BudgetTree:
    for ev in evts:
        tree = tree.apply(ev)
    return tree


def test_a_move_valid_only_as_a_whole_is_ordered_shrink_first() -> None:
    target = BudgetTree.from_mapping(
        {
            "lab": 1.0,
            "lab/prior": 0.7,
            "lab/prior/robotics": {"share": 0.5, "members": ["alice", "bob"]},
            "lab/vision": {"share": 0.3, "max_min_runtime_s": 28800.0},
        }
    )
    order = safe_order(IN_FORCE, target, T0_DT)
    assert [(e.path, e.share) for e in order] == [("lab/vision", 0.3), ("lab/prior", 0.7)]
    assert _fold(IN_FORCE, order) == target  # every step valid: apply raises otherwise


def test_new_budgets_come_parents_first_and_unchanged_ones_are_not_published() -> None:
    spec = dict(IN_FORCE.to_mapping())
    spec["lab/vision/a"] = {"share": 0.5}
    spec["lab/vision/a/b"] = {"share": 1.0}
    order = safe_order(IN_FORCE, BudgetTree.from_mapping(spec), T0_DT)
    assert [e.path for e in order] == ["lab/vision/a", "lab/vision/a/b"]


def test_a_file_that_cannot_fit_beside_a_budget_kept_in_force_is_refused() -> None:
    target = BudgetTree.from_mapping({"lab": 1.0, "lab/vision": 0.5})  # prior 0.6 stays: 1.1
    with pytest.raises(BudgetError) as e:
        safe_order(IN_FORCE, target, T0_DT)
    assert e.value.reason == "over_allocated"


def test_diff_names_added_changed_removed_fields_and_kept_budgets() -> None:
    target = BudgetTree.from_mapping(
        {
            "lab": 1.0,
            "lab/prior": 0.6,
            "lab/prior/robotics": 0.5,
            "lab/vision": {"share": 0.3, "members": ["c"]},
            "lab/new": 0.1,
        }
    )
    got = [(c.path, c.kind, c.field, c.old, c.new) for c in budget_diff(IN_FORCE, target)]
    assert got == [
        ("lab/new", "added", "share", None, 0.1),
        ("lab/prior/robotics", "removed", "members", ["alice", "bob"], None),
        ("lab/vision", "changed", "share", 0.4, 0.3),
        ("lab/vision", "added", "members", None, ["c"]),
        ("lab/vision", "removed", "max_min_runtime_s", 28800.0, None),
    ]
    partial = BudgetTree.from_mapping({"lab": 1.0})
    assert [(c.path, c.kind) for c in budget_diff(IN_FORCE, partial)] == [
        ("lab/prior", "kept"),
        ("lab/prior/robotics", "kept"),
        ("lab/vision", "kept"),
    ]


def test_restore_events_undo_accepted_changes_in_reverse_order() -> None:
    spec = dict(IN_FORCE.to_mapping())
    spec["lab/vision"] = {"share": 0.3}
    spec["lab/new"] = {"share": 0.1}
    order = safe_order(IN_FORCE, BudgetTree.from_mapping(spec), T0_DT)
    undo = restore_events(IN_FORCE, order, T0_DT)
    assert [(e.type, e.path) for e in undo] == [("BudgetRemoved", "lab/new"), ("BudgetSet", "lab/vision")]
    assert _fold(_fold(IN_FORCE, order), undo) == IN_FORCE


@pytest.mark.parametrize("key", ["j1", "alice-0123456789ab", "sim-07", "ü-unicode"])
def test_partition_of_matches_the_producers_partitioner(key: str) -> None:
    from kafka.partitioner.default import murmur2

    for n in (1, 3, 12):
        assert partition_of(key, n) == (murmur2(key.encode()) & 0x7FFFFFFF) % n
    assert partition_of(key, 1) == 0


def test_budget_set_events_carry_the_file_fields() -> None:
    target = BudgetTree.from_mapping(dict(IN_FORCE.to_mapping(), **{"lab/vision": {"share": 0.4, "members": ["x"]}}))
    [ev] = safe_order(IN_FORCE, target, T0_DT)
    assert isinstance(ev, events.BudgetSet)
    assert (ev.members, ev.max_min_runtime_s, ev.by) == (("x",), None, "cli")
