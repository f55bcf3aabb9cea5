"""The CLI's pure checks: budget diffs, a file's changes as one batch (partial files, --prune), key partitions."""

from __future__ import annotations

import pytest

from apportion import events
from apportion.cli.verdicts import batch_of, budget_diff, partition_of
from apportion.domain.budgets import Budget, BudgetBatchError, BudgetTree
from tests.kit.builders import T0_DT

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


def _budgets(spec: dict) -> dict[str, Budget]:
    """A file's budgets (path -> Budget), as ``budgetfile.load_budgets`` gives them: not checked as a tree."""
    out = {}
    for p, v in spec.items():
        v = v if isinstance(v, dict) else {"share": v}
        m = v.get("members")
        out[p] = Budget(p, v["share"], frozenset(m) if m is not None else None, v.get("max_min_runtime_s"))
    return out


FILE = {
    "lab": 1.0,
    "lab/prior": 0.7,
    "lab/prior/robotics": {"share": 0.5, "members": ["alice", "bob"]},
    "lab/vision": {"share": 0.3, "max_min_runtime_s": 28800.0},
}


def test_a_move_valid_only_as_a_whole_is_one_batch_of_the_changed_budgets() -> None:
    batch = batch_of(IN_FORCE, _budgets(FILE), False, T0_DT)
    assert batch is not None
    assert [(s.path, s.share) for s in batch.sets] == [("lab/prior", 0.7), ("lab/vision", 0.3)]  # unchanged: left out
    assert (batch.removes, batch.by) == ((), "cli")
    after = IN_FORCE.apply(batch)
    assert after.to_mapping() == BudgetTree.from_mapping(FILE).to_mapping()


def test_a_partial_file_keeps_budgets_it_does_not_name_and_takes_parents_from_the_tree_in_force() -> None:
    partial = _budgets({"lab/vision/a": 0.5, "lab/vision/a/b": 1.0})  # no lab, no lab/vision in the file
    batch = batch_of(IN_FORCE, partial, False, T0_DT)
    assert batch is not None and [s.path for s in batch.sets] == ["lab/vision/a", "lab/vision/a/b"]
    after = IN_FORCE.apply(batch)
    assert set(after.paths()) == set(IN_FORCE.paths()) | {"lab/vision/a", "lab/vision/a/b"}
    assert batch_of(IN_FORCE, _budgets({"lab/prior": 0.6}), False, T0_DT) is None  # nothing to change


def test_prune_removes_what_the_file_does_not_name_in_the_same_batch() -> None:
    batch = batch_of(IN_FORCE, _budgets({"lab": 1.0, "lab/vision": 1.0}), True, T0_DT)
    assert batch is not None
    assert [(s.path, s.share) for s in batch.sets] == [("lab/vision", 1.0)]  # 0.4 -> 1.0 fits once prior is gone
    assert batch.removes == ("lab/prior", "lab/prior/robotics")
    assert IN_FORCE.apply(batch).paths() == ("lab", "lab/vision")


def test_a_file_that_cannot_fit_beside_a_budget_kept_in_force_is_refused_naming_each_path() -> None:
    with pytest.raises(BudgetBatchError) as e:
        batch_of(IN_FORCE, _budgets({"lab": 1.0, "lab/vision": 0.5, "lab/ghost/x": 0.1}), False, T0_DT)
    assert [(f.path, f.reason) for f in e.value.failures] == [
        ("lab/ghost/x", "no_parent"),
        ("lab/vision", "over_allocated"),  # prior 0.6 stays: 1.1
    ]


def test_diff_names_added_changed_removed_fields_and_kept_or_pruned_budgets() -> None:
    target = _budgets(
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
    partial = _budgets({"lab": 1.0})
    assert [(c.path, c.kind) for c in budget_diff(IN_FORCE, partial)] == [
        ("lab/prior", "kept"),
        ("lab/prior/robotics", "kept"),
        ("lab/vision", "kept"),
    ]
    assert [c.kind for c in budget_diff(IN_FORCE, partial, prune=True)] == ["pruned"] * 3


@pytest.mark.parametrize("key", ["j1", "alice-0123456789ab", "sim-07", "ü-unicode"])
def test_partition_of_matches_the_producers_partitioner(key: str) -> None:
    from kafka.partitioner.default import murmur2

    for n in (1, 3, 12):
        assert partition_of(key, n) == (murmur2(key.encode()) & 0x7FFFFFFF) % n
    assert partition_of(key, 1) == 0


def test_batch_specs_carry_the_file_fields() -> None:
    wanted = _budgets(dict(IN_FORCE.to_mapping(), **{"lab/vision": {"share": 0.4, "members": ["x"]}}))
    batch = batch_of(IN_FORCE, wanted, False, T0_DT)
    assert batch is not None
    [spec] = batch.sets
    assert isinstance(batch, events.BudgetBatch)
    assert (spec.path, spec.members, spec.max_min_runtime_s) == ("lab/vision", ("x",), None)


class _Hashes:
    """The one Redis call ``read_model_folded`` makes (HGETALL), on a dict."""

    def __init__(self, hashes: dict[str, dict[str, str]]) -> None:
        self.hashes = hashes

    def hgetall(self, key: str) -> dict[str, str]:
        return self.hashes.get(key, {})


def test_read_model_folded_reads_the_budgets_offset_the_accounting_wrote_with_its_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json

    from apportion import readmodel
    from apportion.cli.verdicts import read_model_folded

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", "t1.")

    def meta(offsets: dict[str, int]) -> _Hashes:
        return _Hashes({readmodel.usage_key(): {"meta": json.dumps({"offsets": offsets})}})

    # accounting stores the next offset to read: 8 means it folded the record at offset 7
    assert read_model_folded(meta({"t1.apportion.budgets:0": 8}), 7) is True
    assert read_model_folded(meta({"t1.apportion.budgets:0": 7}), 7) is False
    assert read_model_folded(meta({"apportion.budgets:0": 8}), 7) is False  # another namespace's
    assert read_model_folded(_Hashes({}), 0) is False  # no snapshot yet
