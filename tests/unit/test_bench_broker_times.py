"""The broker's request times read by ``bench/bench_live.py --broker-times`` from Kafka's request log."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_live import BROKER_TIMES, broker_times, broker_times_table


def request_line(
    api: str, total: float, *, version: int = 9, transactional_id: str | None = None, **times: float
) -> str:
    """One line of the broker's request log as Kafka 4 writes it (the fields the reader uses, and some it skips)."""
    request: dict[str, Any] = {"transactionalId": transactional_id} if api == "PRODUCE" else {}
    d = {
        "isForwarded": False,
        "requestHeader": {"requestApiKey": 0, "requestApiVersion": version, "requestApiKeyName": api},
        "request": request,
        "totalTimeMs": total,
        "requestQueueTimeMs": times.get("queue", 0.0),
        "localTimeMs": times.get("local", 0.0),
        "remoteTimeMs": times.get("remote", 0.0),
        "responseQueueTimeMs": times.get("respq", 0.0),
        "sendTimeMs": times.get("send", 0.0),
        "securityProtocol": "SASL_SSL",
    }
    return f"[2026-12-07 03:51:10,362] DEBUG Completed request:{json.dumps(d)} (kafka.request.logger)"


def test_each_kind_gets_the_median_of_each_time_and_its_count() -> None:
    lines = [
        request_line("PRODUCE", 3.0, transactional_id="dispatcher-0", local=1.0, remote=2.0, respq=0.5),
        request_line("PRODUCE", 1.0, transactional_id="dispatcher-0", local=0.5, remote=0.0),
        request_line("PRODUCE", 2.0, transactional_id="dispatcher-0", local=0.75, remote=1.0),
        request_line("PRODUCE", 4.0, local=3.0),  # no transaction: a kind of its own
        request_line("ADD_PARTITIONS_TO_TXN", 0.8, version=3, local=0.4),
        request_line("ADD_PARTITIONS_TO_TXN", 0.6, version=4, local=0.3),  # the leader's check, KIP-890
        "[2026-12-07 03:51:10,400] INFO [Broker id=1] something else (kafka.server.ReplicaManager)",
    ]
    times = broker_times(lines)
    assert times["PRODUCE transactional"] == {
        "n": 3,
        "total": 2.0,
        "queue": 0.0,
        "local": 0.75,
        "remote": 1.0,
        "respq": 0.0,  # the median of 0.5, 0 and 0
        "send": 0.0,
    }
    assert times["PRODUCE"]["n"] == 1 and times["PRODUCE"]["local"] == 3.0
    assert times["ADD_PARTITIONS_TO_TXN"]["total"] == 0.8
    assert times["ADD_PARTITIONS_TO_TXN verify"]["total"] == 0.6
    assert set(times) == {"PRODUCE", "PRODUCE transactional", "ADD_PARTITIONS_TO_TXN", "ADD_PARTITIONS_TO_TXN verify"}


def test_a_log_without_request_lines_gives_no_kinds_and_a_table_of_only_its_header() -> None:
    assert broker_times(["[2026-12-07 03:51:10,400] INFO started (kafka.server.KafkaRaftServer)"]) == {}
    table = broker_times_table({})
    assert table.splitlines() == [table] and all(name in table for name in BROKER_TIMES)


def test_the_table_lists_the_kinds_in_the_order_a_decision_meets_them_and_leaves_out_fetches() -> None:
    lines = [
        request_line("END_TXN", 0.9),
        request_line("FETCH", 500.0, remote=499.0),
        request_line("PRODUCE", 2.8, transactional_id="dispatcher-0"),
        request_line("ADD_PARTITIONS_TO_TXN", 0.8, version=3),
    ]
    rows = [line.split()[0] for line in broker_times_table(broker_times(lines)).splitlines()[1:]]
    assert rows == ["ADD_PARTITIONS_TO_TXN", "PRODUCE", "END_TXN"]
