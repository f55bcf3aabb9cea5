"""Why a job is still pending, from the cycle that did not place it (``run_cycle(..., explain=True)``).

One exact cycle per reason kind (``apportion.domain.engine.reasons``), with
the reason worked out by hand. Tree ``lab`` with ``a`` and ``b`` at 0.5 each,
window capacity 1,000 GPU-s (so r = O / 500 for a leaf), ``NOW`` = T0 + 10 h.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from apportion import events as ev
from apportion.domain.engine import (
    BudgetAhead,
    BudgetUnknown,
    NoFreeGpus,
    NoNodeShape,
    ProtectedUntil,
    ReservedBy,
    reason_dict,
)
from apportion.timeutil import from_us, s_to_us
from tests.kit.builders import T0, h
from tests.kit.goodput_world import NOW, World, cycle, explained


def test_a_gang_larger_than_the_ready_nodes_of_its_shape_is_no_node_shape() -> None:
    w = World().node("n0", 8).node("n1", 8).node("small", 4)
    w.cluster.apply(ev.NodeCordoned(node_id="n1", ts=from_us(T0)))
    w.job("g", "lab/a", gpus=8, replicas=2)
    reason = explained(w)["g"]
    # n0 and n1 have 8 GPUs, only n0 is ready; "small" has too few
    assert reason == NoNodeShape(gpus_per_replica=8, replicas=2, gpu_model=None, ready=1, total=2)
    assert reason.text() == (
        "no_node_shape: needs 2 node(s) with 8 GPU(s); the cluster has 1 ready node(s) of this shape "
        "(2 in all, the rest cordoned, draining, drained or lost)"
    )


def test_a_model_nobody_has_is_no_node_shape_with_the_model_named() -> None:
    w = World().node("n0", 8, model="A100").job("m", "lab/a", gpus=1, model="H100")
    reason = explained(w)["m"]
    assert reason == NoNodeShape(1, 1, "H100", 0, 0)
    assert reason.text() == (
        "no_node_shape: needs 1 node(s) with 1 GPU(s) of model H100; the cluster has 0 ready node(s) of this shape"
    )


def test_a_job_of_a_budget_that_is_not_a_leaf_is_budget_unknown() -> None:
    w = World().node("n0", 1).run("r1", "lab/b", {"n0": (0,)})
    w.job("x", "lab", gpus=1).job("gone", "lab/c", gpus=1).job("a1", "lab/a", gpus=1)
    reasons = explained(w)
    assert reasons["x"] == BudgetUnknown("lab") and reasons["gone"] == BudgetUnknown("lab/c")
    assert reasons["x"].text() == "budget_unknown: lab is not a leaf budget of the tree (removed, or given children)"
    assert set(reasons) == {"x", "gone", "a1"}


def test_a_job_that_fits_only_on_reserved_nodes_is_reserved_by_the_holder() -> None:
    #   n0: r1 (lab/b, 4 GPUs) protected until 10.5 h; n1: r2 (lab/b, 2 of 4 GPUs) protected until 10.75 h.
    #   big (lab/a, 4 GPUs, queued at 8 h: waited 2 h >= reservation_after 1 h) has no victim: it reserves the
    #   node with the most GPUs available, n1 (2 free). small (2 GPUs, 1 h minimum runtime) would fit n1's two
    #   free GPUs, but its protection would end at 11 h, after big's earliest fit (10.75 h): no backfill.
    #   Capacity 1,000,000 GPU-s: r_b = 400,000 / 250,000 = 1.6 > r_a = 0 + delta, and with big's charge
    #   (4 x 3,600 GPU-s) r_a is 0.0288 <= r_b: lab/b's runs are big's victims once expired.
    w = World(capacity=1e6).node("n0", 4).node("n1", 4)
    w.run("r1", "lab/b", {"n0": (0, 1, 2, 3)}, started=h(9.5))
    w.run("r2", "lab/b", {"n1": (0, 1)}, started=h(9.75))
    w.job("big", "lab/a", gpus=4, submitted=h(1), queued=h(8)).job("small", "lab/a", gpus=2, submitted=h(2))
    w.occupancy = {"lab/b": 400_000.0, "lab": 400_000.0}
    res = cycle(w)
    assert res.reservation == ("big", ("n1",)) and res.events == []
    assert res.reasons["small"] == ReservedBy(holder="big", nodes=("n1",))
    assert res.reasons["small"].text() == (
        "reserved_by: the free GPUs it fits are reserved for big on n1 "
        "(the highest-ranked allocated job waiting past reservation_after)"
    )
    # the holder itself is blocked by the protected runs, the first of which ends at 10.5 h
    assert res.reasons["big"] == ProtectedUntil(until_us=h(10.5), job_id="r1", budget="lab/b")


def test_an_unallocated_job_with_no_idle_gpu_is_no_free_gpus() -> None:
    w = World().node("n0", 4).run("r1", "lab/b", {"n0": (0, 1, 2, 3)}, started=h(9.5))
    w.job("u", "lab/a", gpus=1, min_runtime_s=0.0)
    reason = explained(w)["u"]
    assert reason == NoFreeGpus(1, 1, None, free_nodes=0, allocated=False, preemption=True)
    assert reason.text() == (
        "no_free_gpus: needs 1 node(s) with 1 GPU(s) free, 0 node(s) have them now; "
        "unallocated jobs run only on idle GPUs"
    )


def test_an_allocated_job_facing_only_its_own_budget_or_no_preemption_is_no_free_gpus() -> None:
    w = World().node("n0", 4).run("own", "lab/a", {"n0": (0, 1, 2, 3)}, started=h(0))  # expired, same leaf
    w.job("a2", "lab/a", gpus=2)
    assert explained(w)["a2"] == NoFreeGpus(2, 1, None, 0, True, True)
    assert (
        explained(w)["a2"].text().endswith("no run there may be preempted for it (its own budget's, or too few GPUs)")
    )
    off = explained(w, preemption=False)["a2"]
    assert off == NoFreeGpus(2, 1, None, 0, True, False) and off.text().endswith("; preemption is off")


def test_an_allocated_job_not_behind_by_delta_is_budget_ahead() -> None:
    #   r1 (lab/b) holds n0 and is past its protection (started at 0 h, 1 h minimum runtime).
    #   capacity 100,000 GPU-s: r(lab/a) = 30,000 / 50,000 = 0.6, r(lab/b) = 31,000 / 50,000 = 0.62 < 0.6 + 0.05:
    #   lab/b is not behind by delta.
    w = World(capacity=100_000.0).node("n0", 4).run("r1", "lab/b", {"n0": (0, 1, 2, 3)}, started=h(0))
    w.occupancy = {"lab": 61_000.0, "lab/a": 30_000.0, "lab/b": 31_000.0}
    w.job("a1", "lab/a", gpus=4, min_runtime_s=60.0)
    reason = explained(w)["a1"]
    assert reason == BudgetAhead(
        budget="lab/a",
        budget_rank=0,
        ratio=0.6,
        holder="lab/b",
        lca="lab",
        holder_ratio=0.62,
        preemptor_ratio=0.6,
        delta=0.05,
        rule="not_behind",
    )
    assert reason.text() == (
        "budget_ahead: lab/a (budget rank 0, r 0.600) may not preempt the runs there (not_behind): "
        "the closest, lab/b, has r 0.620 at lab against 0.600 + delta 0.05"
    )
    # lab/b at 34,000 (r 0.68) is behind by delta, and a1's charge 4 * 60 GPU-s leaves lab/a at 0.6048 <= 0.68:
    # the same cycle preempts r1 and places a1, and no reason is left
    w.occupancy = {"lab": 64_000.0, "lab/a": 30_000.0, "lab/b": 34_000.0}
    res = cycle(w)
    assert [e.job_id for e in res.events if isinstance(e, ev.JobPlaced)] == ["a1"] and res.reasons == {}
    # with a window of 1,000 GPU-s the same occupancy shares are behind by delta too (0.68 >= 0.65), but the
    # charge would lift lab/a to (300 + 240) / 500 = 1.08 > 0.68: the after-move test refuses
    w.capacity, w.occupancy = 1000.0, {"lab": 640.0, "lab/a": 300.0, "lab/b": 340.0}
    assert explained(w)["a1"] == BudgetAhead("lab/a", 0, 0.6, "lab/b", "lab", 0.68, 0.6, 0.05, "after_move_inversion")


def test_an_allocated_job_facing_protected_runs_is_protected_until_the_first_ends() -> None:
    w = World().node("n0", 2).node("n1", 2)
    w.run("late", "lab/b", {"n0": (0, 1)}, started=h(9.75))  # protected until 10.75 h
    w.run("early", "lab/b", {"n1": (0, 1)}, started=h(9.5))  # protected until 10.5 h
    w.job("a1", "lab/a", gpus=2)
    w.occupancy = {"lab/b": 400.0, "lab": 400.0}  # r_b = 0.8 > r_a = 0 + delta: lab/b's runs are victims once expired
    reason = explained(w)["a1"]
    assert reason == ProtectedUntil(until_us=h(10.5), job_id="early", budget="lab/b")
    assert reason.text() == (
        "protected_until: the runs it could preempt are protected; the first protection ends "
        "2024-01-01 10:30:00 UTC (early of lab/b)"
    )
    assert reason_dict(reason) == {
        "kind": "protected_until",
        "text": reason.text(),
        "until": from_us(h(10.5)).isoformat(),
        "job_id": "early",
        "budget": "lab/b",
    }


def test_the_reasons_of_one_cycle_name_only_the_jobs_it_left_pending() -> None:
    w = World().node("n0", 2).job("fits", "lab/a", gpus=2).job("waits", "lab/b", gpus=2, submitted=h(2))
    res = cycle(w)
    assert [e.job_id for e in res.events if isinstance(e, ev.JobPlaced)] == ["fits"]
    assert res.reasons == {"waits": NoFreeGpus(2, 1, None, 0, True, True)}


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.lists(st.sampled_from([2, 4, 8]), min_size=1, max_size=4),
    runs=st.lists(
        st.tuples(st.sampled_from(["lab/a", "lab/b"]), st.booleans(), st.floats(0, 9.9), st.integers(1, 4)),
        max_size=6,
    ),
    jobs=st.lists(
        st.tuples(st.sampled_from(["lab/a", "lab/b", "lab"]), st.integers(1, 8), st.integers(1, 2), st.booleans()),
        min_size=1,
        max_size=8,
    ),
    queued=st.floats(7.0, 10.0),
    occ=st.tuples(st.floats(0, 900), st.floats(0, 900)),
)
def test_every_job_a_cycle_leaves_pending_gets_one_reason_and_asking_changes_no_decision(
    nodes: list[int],
    runs: list[tuple[str, bool, float, int]],
    jobs: list[tuple[str, int, int, bool]],
    queued: float,
    occ: tuple[float, float],
) -> None:
    w = World()
    free = {}
    for i, gpus in enumerate(nodes):
        w.node(f"n{i}", gpus)
        free[f"n{i}"] = list(range(gpus))
    for r, (budget, allocated, started, gpus) in enumerate(runs):
        nid = next((n for n, f in free.items() if len(f) >= gpus), None)
        if nid is not None:
            got, free[nid] = tuple(free[nid][:gpus]), free[nid][gpus:]
            w.run(f"r{r}", budget, {nid: got}, allocated=allocated, started=h(started))
    for j, (budget, gpus, replicas, allocated) in enumerate(jobs):
        w.job(f"j{j}", budget, gpus, replicas, min_runtime_s=3600.0 if allocated else 0.0, queued=h(queued))
    w.occupancy = {"lab": occ[0] + occ[1], "lab/a": occ[0], "lab/b": occ[1]}
    res = cycle(w)
    assert cycle(w, explain=False).events == res.events
    placed = {e.job_id for e in res.events if isinstance(e, ev.JobPlaced)}
    assert set(res.reasons) == {f"j{j}" for j in range(len(jobs))} - placed
    # asked for some jobs only: theirs, each the same as when every job is asked about
    only = {f"j{j}" for j in range(0, len(jobs), 2)}
    some = w.cycle(explain=True, explain_only=only)
    assert some.events == res.events
    assert some.reasons == {j: r for j, r in res.reasons.items() if j in only}
    for reason in res.reasons.values():
        assert reason.text().startswith(reason.kind + ": ")
        assert reason_dict(reason)["kind"] == reason.kind


def test_patience_names_the_work_the_cheapest_plan_would_throw_away_and_when_the_wait_ends():
    # lab/a at its share (r = 1); the only victim u: 8 GPUs, unallocated, 10 h of work since its start
    from apportion.domain.engine import Patience

    w = World().node("n0", 8).run("u", "lab/b", {"n0": tuple(range(8))}, allocated=False)
    w.occupancy = {"lab/a": 500.0, "lab": 500.0}
    w.job("j", "lab/a", gpus=1, queued=NOW - s_to_us(1800))
    got = explained(w)["j"]
    assert got == Patience(8 * 36000.0, 1, 1800.0, NOW - s_to_us(1800) + s_to_us(7200))
    assert got.text().startswith("patience: its budget has its share")


def test_protected_runs_of_a_budget_that_is_not_behind_are_not_a_wait_but_a_budget_ahead() -> None:
    # the trial's case: every GPU is held by protected runs of lab/b, which is *less* used than lab/a (r_b = 0.2,
    # r_a = 1.6): they would not be preempted for a1 once expired either, so naming their protection end would
    # promise a start that is not coming
    w = World().node("n0", 2).run("p", "lab/b", {"n0": (0, 1)}, started=h(9.5))
    w.job("a1", "lab/a", gpus=2)
    w.occupancy = {"lab/a": 800.0, "lab/b": 100.0, "lab": 900.0}
    reason = explained(w)["a1"]
    assert isinstance(reason, BudgetAhead)
    assert (reason.budget, reason.holder, reason.rule) == ("lab/a", "lab/b", "not_behind")
