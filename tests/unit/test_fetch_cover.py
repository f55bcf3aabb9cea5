"""The identity ends that fetch responses prove (:class:`apportion.bus.consumer.FetchCover`, rule D10.proven-user).

Each case feeds responses as a broker answers them, ``(topic, partition, error code, last stable offset, has
records)`` in the response's order, and asks for the end that covers the records returned so far of one
partition. ``None`` means nothing proves it: the reader then asks the broker (a round trip), as it always did.
"""

from __future__ import annotations

from collections import namedtuple

import pytest

from apportion.bus.consumer import FetchCover

TP = namedtuple("TP", "topic partition")
KEYS = TP("apportion.budgets", 0)
SUB = ("apportion.submissions", 1)
JOBS = ("apportion.jobs", 0)


def keys(lso: int, error: int = 0) -> tuple[str, int, int, int, bool]:
    return (KEYS.topic, KEYS.partition, error, lso, False)


def data(tp: tuple[str, int]) -> tuple[str, int, int, int, bool]:
    return (*tp, 0, 9, True)


def empty(tp: tuple[str, int]) -> tuple[str, int, int, int, bool]:
    return (*tp, 0, 9, False)


CASES = [
    # (id, [(node, answers), ...], partitions asked, expected ends)
    (
        "the key partition answered after the submission's in the same response: its end",
        [(1, [data(SUB), keys(7)])],
        [SUB],
        {KEYS: 7},
    ),
    # read before the submission's partition: a key acknowledged just before the submission may be missing
    (
        "the key partition answered before the submission's in the same response: nothing proven",
        [(1, [keys(7), data(SUB)])],
        [SUB],
        None,
    ),
    (
        "a later response of the same broker answered the key partition: its end",
        [(1, [keys(3), data(SUB)]), (1, [keys(8)])],
        [SUB],
        {KEYS: 8},
    ),
    (
        "the key partition left out of the response (records of it buffered): nothing proven",
        [(1, [keys(3)]), (1, [data(SUB)])],
        [SUB],
        None,
    ),
    ("the key partition answered with an error: nothing proven", [(1, [data(SUB), keys(7, error=6)])], [SUB], None),
    ("no last stable offset in the answer: nothing proven", [(1, [data(SUB), keys(-1)])], [SUB], None),
    (
        "responses of two brokers (their order unknown): nothing proven",
        [(1, [data(JOBS), keys(5)]), (2, [data(SUB)])],
        [SUB],
        None,
    ),
    ("a partition no response carried records of: nothing proven", [(1, [empty(SUB), keys(5)])], [SUB], None),
    # the newest response with records of a partition counts: its records returned may be older, never newer
    (
        "a newer response with records of the partition but the key partition before it, none later: nothing proven",
        [(1, [data(SUB), keys(4)]), (1, [keys(6), data(SUB)])],
        [SUB],
        None,
    ),
    (
        "two partitions: the larger end of those each needs",
        [(1, [data(JOBS), keys(4)]), (1, [data(SUB), keys(6)])],
        [JOBS, SUB],
        {KEYS: 6},
    ),
]


@pytest.mark.parametrize(("responses", "asked", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fetch_cover_proves_the_key_end_only_from_a_response_read_after_the_records(
    responses: list[tuple[int, list[tuple[str, int, int, int, bool]]]],
    asked: list[tuple[str, int]],
    expected: dict[TP, int] | None,
) -> None:
    cover = FetchCover([KEYS])
    for node, answers in responses:
        cover.saw(node, answers)
    ends = cover.bounds(asked)
    assert ends == (None if expected is None else {(k.topic, k.partition): v for k, v in expected.items()})


def test_a_response_that_cannot_be_read_still_delivers_and_nothing_is_proven_after_it() -> None:
    # the hook into kafka-python's fetcher: a response without the fields it reads is handed on unchanged
    # (its records are returned), and from then on every read-ahead asks the broker
    from types import SimpleNamespace

    from apportion.bus.consumer import _watch_fetches

    handled: list[object] = []
    moved: list[TP] = []
    subs = SimpleNamespace(move_partition_to_end=moved.append)
    fetcher = SimpleNamespace(_handle_fetch_response=lambda *a: handled.append(a[3]), _subscriptions=subs)
    cover = FetchCover([KEYS])
    assert _watch_fetches(SimpleNamespace(_fetcher=fetcher), cover, [KEYS])
    assert moved == [KEYS]  # the key partition goes last at once

    def partition(tp: tuple[str, int], lso: int, records: bytes) -> SimpleNamespace:
        return SimpleNamespace(partition_index=tp[1], error_code=0, last_stable_offset=lso, records=records)

    good = SimpleNamespace(
        responses=[
            SimpleNamespace(topic=SUB[0], partitions=[partition(SUB, 9, b"r")]),
            SimpleNamespace(topic=KEYS.topic, partitions=[partition((KEYS.topic, 0), 7, b"")]),
        ]
    )
    fetcher._handle_fetch_response(1, {}, 0.0, good)
    assert cover.bounds([SUB]) == {(KEYS.topic, KEYS.partition): 7}
    subs.move_partition_to_end(TP(*SUB))  # a drained partition goes last, the key partition after it
    assert moved[-2:] == [TP(*SUB), KEYS]
    odd = SimpleNamespace(responses=[SimpleNamespace(topic=SUB[0])])  # no partitions: cannot be read
    fetcher._handle_fetch_response(1, {}, 0.0, odd)
    assert handled == [good, odd]
    assert cover.bounds([SUB]) is None
