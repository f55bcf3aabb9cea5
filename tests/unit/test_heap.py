"""The collector's settings for a scheduling process (rule D9.scale): freeze, thresholds, bounded memory."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from apportion.heap import THRESHOLDS, settle_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture(autouse=True)
def _restore_collector() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_settle_freezes_what_is_alive_and_sets_the_thresholds():
    kept = [_Node() for _ in range(10)]
    settle_heap()
    assert gc.get_threshold() == (100_000, 20, 100) == THRESHOLDS
    assert gc.get_freeze_count() >= len(kept)
    oldest = {id(o) for o in gc.get_objects(generation=2)}  # frozen objects are in none of the three
    assert not any(id(k) in oldest for k in kept)


def test_a_frozen_object_without_a_cycle_is_freed_when_its_last_reference_goes():
    node = _Node()
    gone = weakref.ref(node)
    settle_heap()
    del node
    assert gone() is None


def test_a_frozen_cycle_that_dies_waits_for_the_next_settle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    settle_heap()
    del a, b
    gc.collect()
    assert gone() is not None  # frozen: no collection walks it
    settle_heap()  # unfreezes first
    assert gone() is None


def test_a_cycle_made_after_settle_is_collected_as_usual():
    settle_heap()
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
