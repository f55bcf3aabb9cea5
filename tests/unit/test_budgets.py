"""Budget tree: validation reasons, absolute shares, inheritance, folding events."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from apportion.domain.budgets import BudgetBatchError, BudgetError, BudgetTree, ancestors_of, parent_of
from apportion.events import BudgetBatch, BudgetRejected, BudgetRemoved, BudgetSet, BudgetSpec

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def bset(path: str, share: float, **kw: Any) -> BudgetSet:
    return BudgetSet(path=path, share=share, ts=T0, **kw)


# lab 1.0
# ├── prior 0.6 ── robotics 0.5   (abs 0.3)
# └── vision 0.4                  (abs 0.4)
LAB = {"lab": 1.0, "lab/prior": 0.6, "lab/prior/robotics": 0.5, "lab/vision": 0.4}


def test_abs_share_is_product_along_path() -> None:
    tree = BudgetTree.from_mapping(LAB)
    assert tree.abs_share("lab") == 1.0
    assert tree.abs_share("lab/prior") == pytest.approx(0.6)
    assert tree.abs_share("lab/prior/robotics") == pytest.approx(0.3)
    assert tree.abs_share("lab/vision") == pytest.approx(0.4)
    assert tree.abs_share("nope") == 0.0
    assert tree.leaves() == ("lab/prior/robotics", "lab/vision")
    assert tree.children("lab") == ("lab/prior", "lab/vision")
    assert tree.children() == ("lab",)


@pytest.mark.parametrize(
    "spec,change,reason",
    [
        pytest.param(LAB, bset("lab//x", 0.1), "bad_path", id="empty segment"),
        pytest.param(LAB, bset("/lab", 0.1), "bad_path", id="leading slash"),
        pytest.param(LAB, bset("lab/a b", 0.1), "bad_path", id="space"),
        pytest.param(LAB, bset("lab/ghost/x", 0.1), "no_parent", id="missing parent"),
        pytest.param(LAB, bset("lab/extra", 0.1), "over_allocated", id="siblings over 1"),
        pytest.param(LAB, BudgetRemoved(path="lab/prior", ts=T0), "has_children", id="remove with children"),
        pytest.param(LAB, BudgetRemoved(path="lab/none", ts=T0), "unknown_budget", id="remove unknown"),
    ],
)
def test_invalid_changes_name_their_reason(
    spec: dict[str, float], change: BudgetSet | BudgetRemoved | BudgetBatch, reason: str
) -> None:
    tree = BudgetTree.from_mapping(spec)
    with pytest.raises(BudgetError) as exc:
        tree.apply(change)
    assert exc.value.reason == reason


def test_share_bounds_are_enforced_by_the_event_and_the_tree() -> None:
    with pytest.raises(ValueError):
        bset("lab", 0.0)
    with pytest.raises(BudgetError) as exc:
        BudgetTree.from_mapping({"lab": 1.5})
    assert exc.value.reason == "bad_share"


def test_update_replaces_own_share_in_sibling_sum() -> None:
    tree = BudgetTree.from_mapping(LAB)
    # vision 0.4 -> 0.4 again is fine (own old share not double-counted)
    assert tree.apply(bset("lab/vision", 0.4)).abs_share("lab/vision") == pytest.approx(0.4)
    with pytest.raises(BudgetError):
        tree.apply(bset("lab/vision", 0.41))


def test_remove_refused_while_in_use() -> None:
    tree = BudgetTree.from_mapping(LAB)
    with pytest.raises(BudgetError) as exc:
        tree.apply(BudgetRemoved(path="lab/vision", ts=T0), in_use=frozenset({"lab/vision"}))
    assert exc.value.reason == "in_use"
    assert "lab/vision" not in tree.apply(BudgetRemoved(path="lab/vision", ts=T0))


def test_members_and_limit_inherit_down_the_tree() -> None:
    tree = BudgetTree.from_events(
        [
            bset("lab", 1.0, members=("alice", "bob"), max_min_runtime_s=8 * 3600),
            bset("lab/prior", 0.6),
            bset("lab/prior/robotics", 0.5, members=("carol",)),
            bset("lab/vision", 0.4, max_min_runtime_s=3600),
        ]
    )
    assert tree.members("lab/prior") == frozenset({"alice", "bob"})
    assert tree.members("lab/prior/robotics") == frozenset({"carol"})
    assert tree.max_min_runtime_s("lab/prior/robotics") == 8 * 3600
    assert tree.max_min_runtime_s("lab/vision") == 3600
    assert BudgetTree.from_mapping({"x": 1.0}).members("x") is None


def test_tree_is_immutable_and_roundtrips_through_mapping() -> None:
    tree = BudgetTree.from_mapping(LAB)
    changed = tree.apply(bset("lab/vision", 0.2))
    assert tree.share("lab/vision") == 0.4 and changed.share("lab/vision") == 0.2
    assert BudgetTree.from_mapping(tree.to_mapping()) == tree


def test_path_helpers() -> None:
    assert parent_of("a/b/c") == "a/b"
    assert parent_of("a") == ""
    assert ancestors_of("a/b/c") == ("a", "a/b", "a/b/c")
    assert ancestors_of("") == ()


# --------------------------------------------------------------------------- batches (issue 13: all or nothing)


def batch(*sets: tuple[str, float], removes: tuple[str, ...] = ()) -> BudgetBatch:
    return BudgetBatch(sets=tuple(BudgetSpec(path=p, share=s) for p, s in sets), removes=removes, ts=T0)


def _failures(tree: BudgetTree, change: BudgetBatch, in_use: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    with pytest.raises(BudgetBatchError) as err:
        tree.apply(change, in_use=in_use)
    return [(f.path, f.reason) for f in err.value.failures]


def test_a_batch_valid_only_as_a_whole_applies_in_either_order() -> None:
    # lab: prior 0.6 -> 0.7, vision 0.4 -> 0.3; each change alone would make the siblings sum 1.1
    tree = BudgetTree.from_mapping(LAB)
    with pytest.raises(BudgetError, match="over_allocated"):
        tree.apply(bset("lab/prior", 0.7))
    for order in (
        (("lab/prior", 0.7), ("lab/vision", 0.3)),
        (("lab/vision", 0.3), ("lab/prior", 0.7)),
    ):
        after = tree.apply(batch(*order))
        assert (after.share("lab/prior"), after.share("lab/vision")) == (0.7, 0.3)
        assert after.share("lab/prior/robotics") == 0.5  # not named: kept
        assert after.version == tree.version + 1


def test_a_batch_removes_a_parent_with_its_children_and_adds_a_subtree() -> None:
    tree = BudgetTree.from_mapping(LAB)
    after = tree.apply(batch(("lab/audio", 0.4), ("lab/audio/asr", 1.0), removes=("lab/vision",)))
    assert after.paths() == ("lab", "lab/audio", "lab/audio/asr", "lab/prior", "lab/prior/robotics")
    after = tree.apply(batch(removes=("lab/prior/robotics", "lab/prior")))
    assert after.paths() == ("lab", "lab/vision")


def test_an_invalid_batch_names_every_failing_path_and_changes_nothing() -> None:
    tree = BudgetTree.from_mapping(LAB)
    bad = batch(("lab/ghost/x", 0.1), ("lab/vision/a", 0.5), removes=("lab/none", "lab/prior"))
    assert _failures(tree, bad) == [
        ("lab/none", "unknown_budget"),
        ("lab/ghost/x", "no_parent"),
        ("lab/prior", "has_children"),  # robotics stays
    ]
    assert _failures(tree, batch(("lab/vision", 0.3), ("lab/vision", 0.2))) == [("lab/vision", "bad_batch")]
    # over-allocation is named on each budget of the batch under the over-full parent, and only there
    assert _failures(tree, batch(("lab/prior", 0.7), ("lab/extra", 0.1), ("lab/vision/a", 0.5))) == [
        ("lab/prior", "over_allocated"),
        ("lab/extra", "over_allocated"),
    ]
    assert tree == BudgetTree.from_mapping(LAB)  # immutable: nothing changed


def test_a_batch_checks_paths_shares_use_and_emptiness() -> None:
    tree = BudgetTree.from_mapping(LAB)
    assert _failures(tree, batch(("lab/a b", 0.1))) == [("lab/a b", "bad_path")]
    assert _failures(tree, batch(removes=("lab/vision",)), in_use=frozenset({"lab/vision"})) == [
        ("lab/vision", "in_use")
    ]
    assert _failures(tree, batch()) == [("", "bad_batch")]
    with pytest.raises(BudgetBatchError) as err:
        tree.apply(batch(("lab/prior", 0.7), ("lab/extra", 0.1)))
    assert err.value.reason == "over_allocated"
    assert err.value.message == (
        "lab/prior: over_allocated: shares under 'lab' would sum to 1.2 > 1; "
        "lab/extra: over_allocated: shares under 'lab' would sum to 1.2 > 1"
    )


def test_fold_budget_log_applies_a_batch_whole_or_skips_it_whole() -> None:
    from apportion.domain.budgets import fold_budget_log

    start = [bset(p, s) for p, s in LAB.items()]
    good = batch(("lab/prior", 0.7), ("lab/vision", 0.3))
    bad = batch(("lab/prior", 0.8), ("lab/vision", 0.3))  # 1.1
    tree = fold_budget_log([*start, bad])
    assert (tree.share("lab/prior"), tree.share("lab/vision")) == (0.6, 0.4)
    tree = fold_budget_log([*start, good, bad])
    assert (tree.share("lab/prior"), tree.share("lab/vision")) == (0.7, 0.3)
    rejected = BudgetRejected(path="lab/prior", reason="x", message="x", rejected_event_id=good.event_id, ts=T0)
    tree = fold_budget_log([*start, good, rejected])  # the policy's word is final
    assert (tree.share("lab/prior"), tree.share("lab/vision")) == (0.6, 0.4)


# lab       default 2h (set here)
# └── vision  max 1h (set here): default in force 2h > max 1h
def test_a_default_time_limit_above_the_max_in_force_is_refused_where_set_or_inherited() -> None:
    tree = BudgetTree.from_mapping(LAB)
    with pytest.raises(BudgetError) as exc:
        tree.apply(bset("lab/vision", 0.4, default_time_limit_s=7200.0, max_time_limit_s=3600.0))
    assert exc.value.reason == "bad_time_limit"
    assert exc.value.message == (
        "default time limit 2h of 'lab/vision' is above its max time limit 1h: every job that gives no time "
        "limit would be refused; lower the default or raise the maximum"
    )
    # a parent's default above a child's max: refused whichever of the two is set second
    with_default = tree.apply(bset("lab", 1.0, default_time_limit_s=7200.0))
    with pytest.raises(BudgetError) as exc:
        with_default.apply(bset("lab/vision", 0.4, max_time_limit_s=3600.0))
    assert exc.value.message == (
        "default time limit 2h (inherited from 'lab') of 'lab/vision' is above its max time limit 1h: every job "
        "that gives no time limit would be refused; lower the default or raise the maximum"
    )
    with_max = tree.apply(bset("lab/vision", 0.4, max_time_limit_s=3600.0))
    with pytest.raises(
        BudgetError, match="bad_time_limit: default time limit 2h \\(inherited from 'lab'\\) of 'lab/vision'"
    ):
        with_max.apply(bset("lab", 1.0, default_time_limit_s=7200.0))
    # equal limits, or a child default that meets its own max under the parent's larger default, are valid
    assert tree.apply(bset("lab/vision", 0.4, default_time_limit_s=3600.0, max_time_limit_s=3600.0))
    ok = with_default.apply(bset("lab/vision", 0.4, default_time_limit_s=1800.0, max_time_limit_s=3600.0))
    assert ok.time_limits_s("lab/vision") == (1800.0, 3600.0)


def test_a_batch_leaving_a_default_time_limit_above_the_max_names_each_budget() -> None:
    tree = BudgetTree.from_mapping(LAB)
    bad = BudgetBatch(
        sets=(
            BudgetSpec(path="lab", share=1.0, default_time_limit_s=7200.0),
            BudgetSpec(path="lab/prior", share=0.6, max_time_limit_s=3600.0),
        ),
        ts=T0,
    )
    # lab/prior and robotics below it (inheriting the 1h max) both get the 2h default
    assert _failures(tree, bad) == [("lab/prior", "bad_time_limit"), ("lab/prior/robotics", "bad_time_limit")]
    own_default = BudgetSpec(path="lab/prior", share=0.6, max_time_limit_s=3600.0, default_time_limit_s=600.0)
    good = BudgetBatch(sets=(bad.sets[0], own_default), ts=T0)
    assert tree.apply(good).time_limits_s("lab/prior/robotics") == (600.0, 3600.0)
