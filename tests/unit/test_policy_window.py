"""The policy's de-duplication is bounded by the window W, by the dispatcher's rule (apportion.domain.seen).

Window 1 h in every test, so the hours below are easy to check: an event is older than the window when its
time is before the newest budget event folded minus 1 h.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

from apportion.domain.budgets import Budget
from apportion.domain.dispatch import DispatchState
from apportion.domain.dispatch import evolve as dispatch_evolve
from apportion.domain.seen import FORGET_MIN, forget_older, older_than_window, sweep_due
from apportion.events import Event
from apportion.timeutil import s_to_us
from services.policy.logic import PolicyState, evolve
from tests.kit.builders import budget_set, h
from tests.kit.narrowing import narrow

HOUR_US = s_to_us(3600)


def fold(state: PolicyState, *evs: Event) -> PolicyState:
    for e in evs:
        state = evolve(state, e)
    return state


def test_the_window_rule_at_its_boundary() -> None:
    assert older_than_window(h(1) - 1, h(2), HOUR_US) is True
    assert older_than_window(h(1), h(2), HOUR_US) is False  # exactly W before the newest: still folded
    assert older_than_window(0, None, HOUR_US) is False  # nothing folded yet
    assert forget_older({"a": h(1) - 1, "b": h(1), "c": h(2)}, h(2), HOUR_US) == {"b": h(1), "c": h(2)}
    assert (sweep_due(2 * FORGET_MIN, 0), sweep_due(2 * FORGET_MIN + 1, 0)) == (False, True)
    assert (sweep_due(2 * 5000, 5000), sweep_due(2 * 5000 + 1, 5000)) == (False, True)


def test_a_budget_event_older_than_the_window_is_not_folded_as_the_dispatcher_does() -> None:
    lab, a, late_b = (
        budget_set("lab", 1.0, at=h(0)),
        budget_set("lab/a", 0.5, at=h(2)),
        budget_set("lab/b", 0.5, at=h(0)),
    )
    state = fold(PolicyState(window_us=HOUR_US), lab, a, late_b)
    assert "lab/a" in state.tree and "lab/b" not in state.tree
    assert (state.clock_us, set(state.seen)) == (h(2), {lab.event_id, a.event_id})
    assert state.log == (lab, a)
    disp = DispatchState(window_s=3600)
    for e in (lab, a):
        dispatch_evolve(disp, e)
    assert disp.is_stale(late_b) is True  # the same event is refused by the dispatcher's fold too


def test_ids_older_than_the_window_are_forgotten_once_seen_has_doubled() -> None:
    old = {uuid.uuid4(): h(0) for _ in range(2 * FORGET_MIN)}
    new = budget_set("lab", 1.0, at=h(2))
    swept = evolve(PolicyState(window_us=HOUR_US, seen=old, clock_us=h(0)), new)
    assert (dict(swept.seen), swept.kept) == ({new.event_id: h(2)}, 1)
    # one fewer: 2 * FORGET_MIN ids after the new one is not past the doubling, nothing is swept
    fewer = dict(list(old.items())[1:])
    kept = evolve(PolicyState(window_us=HOUR_US, seen=fewer, clock_us=h(0)), new)
    assert (len(kept.seen), kept.kept) == (2 * FORGET_MIN, 0)


def test_a_redelivered_change_whose_id_was_forgotten_does_not_change_the_tree_again() -> None:
    first, second = budget_set("lab", 1.0, at=h(0)), budget_set("lab/a", 0.5, at=h(0))
    moved = budget_set("lab/a", 0.7, at=h(2))
    filler = {uuid.uuid4(): h(0) for _ in range(2 * FORGET_MIN)}  # so the next event sweeps
    state = fold(PolicyState(window_us=HOUR_US), first, second)
    state = evolve(replace(state, seen={**state.seen, **filler}), moved)
    assert second.event_id not in state.seen  # forgotten: older than the window
    again = evolve(state, second)  # a redelivery (faust from older committed offsets)
    assert narrow(Budget, again.tree.get("lab/a")).share == 0.7
    assert again.log == state.log
