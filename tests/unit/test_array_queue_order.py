"""The queue's positions of a job array's elements against the order they start in (found on a local stack:
`submit --array 0-19%4`, then `apportion queue`): the elements past the throttle start lowest index first, as
their pending reason says, but the queue numbers them in the order of their ids as text, so `sweep_10` stands
at position 0 while `sweep_4` is the next to start. Rule D3.scheduling-cycle: the position is the order the
cycle walks."""

from __future__ import annotations

from apportion import events as ev
from apportion.domain.dispatch import DispatchState, Tick, step
from services.dispatcher.logic import read_model
from tests.kit.builders import T0, completed, m
from tests.unit.test_job_arrays import CFG, TREE, array_sub, reg


def test_the_next_element_to_start_stands_first_in_the_queue() -> None:
    state = DispatchState(TREE)
    step(state, reg(), T0, CFG)
    step(state, array_sub("s", "0-11%2"), T0, CFG)
    step(state, Tick(T0), T0, CFG)  # s_0 and s_1 start
    rows, _ = read_model(state, T0, CFG)
    first = min((r for r in rows.values() if r["state"] == "pending"), key=lambda r: r["position"])
    step(state, completed("s_0", at=m(10), node="n0"), m(10), CFG)
    started = [e.job_id for e in step(state, Tick(m(10)), m(10), CFG) if isinstance(e, ev.JobPlaced)]
    assert started == ["s_2"]
    assert first["job_id"] == "s_2"


def positions(state: DispatchState, at: int) -> list[str]:
    rows, _ = read_model(state, at, CFG)
    pending = [r for r in rows.values() if r["position"] is not None]
    return [r["job_id"] for r in sorted(pending, key=lambda r: r["position"])]


def test_the_held_back_elements_follow_lowest_index_first() -> None:
    state = DispatchState(TREE)
    step(state, reg(), T0, CFG)
    step(state, array_sub("s", "0-11%2"), T0, CFG)
    step(state, Tick(T0), T0, CFG)
    assert positions(state, T0) == [f"s_{i}" for i in range(2, 12)]


def test_the_elements_a_cycle_sees_keep_the_walks_order_ahead_of_the_held_back_ones() -> None:
    """No node: the limit lets s_9 and s_10 in, which the cycle walks as the engine orders them (s_10 first,
    ids as text at the same submission time); the eight held back follow, lowest index first."""
    state = DispatchState(TREE)
    step(state, array_sub("s", "9-20%2"), T0, CFG)
    assert sorted(j.job_id for jobs in state.pending_now(T0).values() for j in jobs) == ["s_10", "s_9"]
    assert positions(state, T0) == ["s_10", "s_9", *(f"s_{i}" for i in range(11, 21))]


def test_an_array_without_a_limit_keeps_the_engines_order() -> None:
    state = DispatchState(TREE)
    step(state, array_sub("s", "8-11"), T0, CFG)
    assert positions(state, T0) == ["s_10", "s_11", "s_8", "s_9"]
