"""``I_c`` of apportion.sim.conservation, case by case: free GPUs a waiting job that fits could use, capped by
what the fitting jobs ask for; gangs need k distinct eligible nodes; a model constraint narrows the nodes."""

from __future__ import annotations

import pytest

from apportion.domain.engine.inputs import PendingJob
from apportion.sim.conservation import idle_fitting_gpus, shapes_of

CASES = [
    # (id, free: node -> (model, free GPUs), demand: (g, k, model) -> GPUs asked, expected)
    ("nothing free", {}, {(1, 1, None): 1}, 0),
    ("nothing waits", {"n0": (None, 8)}, {}, 0),
    ("a 1-GPU job next to 8 free idles 1, not 8", {"n0": (None, 8)}, {(1, 1, None): 1}, 1),
    ("three 1-GPU jobs, 2 + 3 free on two nodes: 3", {"n0": (None, 2), "n1": (None, 3)}, {(1, 1, None): 3}, 3),
    ("an 8-GPU job does not fit 4 + 4", {"n0": (None, 4), "n1": (None, 4)}, {(8, 1, None): 8}, 0),
    ("a 2x4 gang fits 4 + 4 on two nodes", {"n0": (None, 4), "n1": (None, 4)}, {(4, 2, None): 8}, 8),
    ("a 2x4 gang does not fit 8 + 3 (one node)", {"n0": (None, 8), "n1": (None, 3)}, {(4, 2, None): 8}, 0),
    ("the model must match", {"n0": ("B", 8)}, {(1, 1, "A"): 1}, 0),
    ("no model: any node", {"n0": ("B", 8)}, {(2, 1, None): 2}, 2),
    # 2 GPUs (any model) fit n0 and n1; 1 GPU of model A fits n0 only: union {n0, n1} offers 5, the jobs ask 5
    ("union of eligible nodes", {"n0": ("A", 2), "n1": ("B", 3)}, {(2, 1, None): 2, (1, 1, "A"): 3}, 5),
    # the jobs ask 2 + 3 = 5 but only n0 (2 free) is eligible for the A jobs and the 4-GPU job fits nowhere
    ("free GPUs cap it", {"n0": ("A", 2), "n1": ("B", 1)}, {(1, 1, "A"): 3, (4, 1, None): 4}, 2),
]


@pytest.mark.parametrize(("free", "demand", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_idle_fitting_gpus(free, demand, expected):
    assert idle_fitting_gpus(free, demand) == expected


def test_shapes_of_sums_gpus_per_shape_and_class():
    def pj(job_id: str, g: int, k: int, min_rt: float, model: str | None = None) -> PendingJob:
        return PendingJob(job_id, 1, "lab/a", "u", g, k, min_rt, 0, 0, gpu_model=model)

    jobs = [pj("a", 1, 1, 60), pj("b", 1, 1, 60), pj("c", 4, 2, 60, "A"), pj("d", 2, 1, 0)]
    assert shapes_of(jobs) == ({(1, 1, None): 2, (4, 2, "A"): 8}, {(2, 1, None): 2})


def test_one_apart_finds_a_single_insertion_or_removal_and_nothing_else():
    from apportion.sim.conservation import _one_apart

    def pj(job_id: str) -> PendingJob:
        return PendingJob(job_id, 1, "lab/a", "u", 1, 1, 60, 0, 0)

    a, b, c, d, x = (pj(i) for i in "abcdx")
    assert _one_apart([a, b, c], [a, x, b, c]) == (x, 1)
    assert _one_apart([a, b, c], [a, c]) == (b, -1)
    assert _one_apart([a, b, c], [a, b, c, d]) == (d, 1)
    assert _one_apart([a, b, c], [b, c]) == (a, -1)
    assert _one_apart([a, b, c], [x, b, c, d]) is None  # a changed and d joined: two changes
    assert _one_apart([a, b], [a, b]) is None and _one_apart([a], [a, b, c]) is None
