"""Offset maps key a partition as ``"topic:partition"``: :func:`apportion.bus.consumer.tp_key` writes the key,
:func:`apportion.bus.reader.tp_of_key` reads it back."""

from __future__ import annotations

import pytest
from kafka import TopicPartition

from apportion.bus.consumer import tp_key
from apportion.bus.reader import tp_of_key
from apportion.cli import common


@pytest.mark.parametrize("tp", [TopicPartition("apportion.jobs", 0), TopicPartition("ns-1.apportion.nodes", 11)])
def test_a_key_reads_back_as_the_partition_it_was_made_of(tp: TopicPartition) -> None:
    assert tp_of_key(tp_key(tp)) == (tp.topic, tp.partition)


@pytest.mark.parametrize("key", ["apportion.jobs", "apportion.jobs:", ":3", "apportion.jobs:x", "apportion.jobs:-1"])
def test_a_key_that_names_no_partition_is_refused_by_name(key: str) -> None:
    with pytest.raises(ValueError, match="not a topic:partition key"):
        tp_of_key(key)


def test_the_clis_end_offsets_ask_for_the_partitions_the_keys_name(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[list[TopicPartition]] = []

    class Client:
        def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
            asked.append(tps)
            return {tps[0]: 900}

    monkeypatch.setattr(common, "_ask", lambda _bootstrap, fn: fn(Client()))
    got = common.end_offsets("unused:1", ["apportion.jobs:0", "apportion.budgets:2"])
    assert asked == [[TopicPartition("apportion.jobs", 0), TopicPartition("apportion.budgets", 2)]]
    assert got == {"apportion.jobs:0": 900, "apportion.budgets:2": 0}
