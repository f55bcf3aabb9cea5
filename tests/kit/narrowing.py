"""Narrowing for tests: a value the test claims is of one kind, checked, and typed as that kind for mypy."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def narrow(kind: type[T], value: object) -> T:
    """``value``, which the test claims is a ``kind`` (a class).

    Raises:
        AssertionError: naming ``value`` when it is not a ``kind`` (the test fails there, as it would have
            on the first attribute the other kind lacks).
    """
    assert isinstance(value, kind), value
    return value


def narrow_each(kind: type[T], values: Iterable[object]) -> list[T]:
    """``values`` as a list, each of which the test claims is a ``kind``.

    Raises:
        AssertionError: naming the first value that is not a ``kind``.
    """
    return [narrow(kind, v) for v in values]
