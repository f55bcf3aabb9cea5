"""The cyclic garbage collector in a process that holds the scheduling state (rule ``D9.scale``).

The dispatcher, the forecast commands (once the log is folded), the accounting service (its occupancy
ledger's runs) and ``bench_engine`` hold hundreds of thousands of long-lived objects (nodes, runs, pending jobs,
the leaves' lists). With Python's default
thresholds a 100,000-GPU cycle triggers some 50 collections, and a young
collection also walks every large container the cycle builds (its maps over
all nodes or pending jobs), about 15% of the cycle's CPU time.
:func:`settle_heap`, called once the state is loaded or rebuilt, collects
once, freezes what survives (:func:`gc.freeze`: the collector never walks it
again) and raises the young threshold above what a cycle keeps alive at
once, so a cycle usually runs without a collection.

Memory stays bounded. A frozen object is still freed by reference counting
when its last reference goes; only a frozen object that dies inside a
reference cycle stays until the next :func:`settle_heap` (which unfreezes
first), so the most that can stay is what was alive at the last call. The
engine's and the dispatch state's objects form no reference cycles (a
simulated run leaves none: ``tests/sim/test_properties.py``), so a frozen
run, job or node that finishes is freed at once. Objects made after the call
are collected as usual, only less often: at most ``THRESHOLDS[0]``
container objects of cyclic garbage wait for a young collection.

The simulator pauses the collector for its whole run instead
(``SimConfig.pause_gc``): its process ends with the run.
"""

from __future__ import annotations

import gc

#: ``gc.set_threshold`` for a scheduling process: a young collection after 100,000 more container objects
#: alive than at the last one (a 100,000-GPU steady cycle keeps fewer alive at its peak), a middle one every
#: 20 young ones, a full one every 100 middle ones (and, as always, only when the objects new to the oldest
#: generation are a quarter of it).
THRESHOLDS: tuple[int, int, int] = (100_000, 20, 100)


def settle_heap() -> None:
    """Collect once, freeze the survivors and set :data:`THRESHOLDS` (call after the state is loaded or rebuilt).

    A second call (a new term's rebuild) first unfreezes, so that what died in
    reference cycles since the last call is collected.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
