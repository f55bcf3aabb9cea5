"""The broker's request times read by ``bench/bench_live.py --broker-times`` from Kafka's request log."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_live import BROKER_TIMES, broker_path, broker_path_table, broker_times, broker_times_table


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


def path_line(api: str, client: str, end_ms: int, total: float, *, version: int = 9, **extra: Any) -> str:
    """A request-log line of ``client``'s ``api`` request that ended ``end_ms`` after 03:51:10.000."""
    request: dict[str, Any] = {"transactionalId": extra.get("transactional_id")} if api == "PRODUCE" else {}
    response: dict[str, Any] = {}
    if api == "FETCH":
        topic = extra.get("topic", "ns.apportion.submissions")
        response = {"responses": [{"topic": topic, "partitions": [{"recordsSizeInBytes": extra.get("size", 692)}]}]}
    d = {
        "requestHeader": {"requestApiVersion": version, "requestApiKeyName": api, "clientId": client},
        "request": request,
        "response": response,
        "totalTimeMs": total,
    }
    return f"[2026-12-07 03:51:{10 + end_ms // 1000:02d},{end_ms % 1000:03d}] DEBUG Completed request:{json.dumps(d)} (kafka.request.logger)"


def test_a_submissions_way_is_split_at_the_dispatchers_requests_in_order() -> None:
    # ms on the broker's clock; every request starts at its end minus its total
    lines = [
        path_line("FETCH", "dispatcher-reader", 5, 1.0, topic="ns.apportion.jobs"),  # before the ack, not a submission
        path_line("PRODUCE", "bench-latency", 10, 2.0),  # the ack at 10
        path_line("LIST_OFFSETS", "dispatcher-ends", 11, 0.5),  # before the fetch that returns it: skipped
        path_line("FETCH", "dispatcher-reader", 14, 3.0),  # arrives at 11, 1 ms after the ack
        path_line("FETCH", "accounting-reader", 15, 1.0),  # another reader's
        path_line("ADD_PARTITIONS_TO_TXN", "dispatcher", 18, 1.5, version=3),  # arrives at 16.5, 2.5 after the fetch
        path_line("LIST_OFFSETS", "dispatcher-ends", 19, 4.0),  # arrives at 15, 1 ms after the fetch ended
        path_line("ADD_PARTITIONS_TO_TXN", "AddPartitionsManager", 26, 0.5, version=4),  # the leader's check
        path_line("PRODUCE", "dispatcher", 28, 4.0, transactional_id="d-0"),  # arrives at 24
        path_line("END_TXN", "dispatcher", 31, 1.0),  # arrives at 30
        path_line("WRITE_TXN_MARKERS", "broker-1-txn-marker-sender", 35, 2.0),
    ]
    assert broker_path(lines) == {
        "ack -> the dispatcher's fetch arrives (< 0: it waited there)": (1, 1.0),
        "  fetch at the broker": (1, 3.0),
        "-> key end offsets asked (LIST_OFFSETS, own connection)": (1, 1.0),
        "  LIST_OFFSETS at the broker": (1, 4.0),
        "fetch -> ADD_PARTITIONS_TO_TXN arrives (decide, sign, send)": (1, 2.5),
        "  ADD_PARTITIONS_TO_TXN at the broker": (1, 1.5),
        "-> transactional PRODUCE arrives": (1, 6.0),
        "  PRODUCE at the broker": (1, 4.0),
        "-> END_TXN arrives": (1, 2.0),
        "  (LIST_OFFSETS answered -> END_TXN arrives)": (1, 11.0),
        "  END_TXN at the broker": (1, 1.0),
        "-> commit markers written (WRITE_TXN_MARKERS)": (1, 4.0),
        "ack -> commit markers written": (1, 25.0),
    }


def test_a_fetch_that_waited_at_the_broker_starts_before_the_ack_and_a_way_cut_short_is_left_out() -> None:
    lines = [
        path_line("PRODUCE", "bench-latency", 10, 2.0),  # the ack at 10
        path_line("FETCH", "dispatcher-reader", 11, 400.0),  # waited at the broker from -389
        path_line("LIST_OFFSETS", "dispatcher-ends", 13, 1.0),
        path_line("ADD_PARTITIONS_TO_TXN", "dispatcher", 15, 1.0, version=3),
        path_line("PRODUCE", "dispatcher", 17, 1.0, transactional_id="d-0"),
        path_line("END_TXN", "dispatcher", 19, 1.0),
        path_line("WRITE_TXN_MARKERS", "broker-1-txn-marker-sender", 20, 1.0),
        path_line("PRODUCE", "bench-latency", 30, 1.0),  # a second submission: never read in this log
    ]
    path = broker_path(lines)
    assert path["ack -> the dispatcher's fetch arrives (< 0: it waited there)"] == (1, -399.0)
    assert path["ack -> commit markers written"] == (1, 10.0)
    table = broker_path_table(path).splitlines()
    assert len(table) == 1 + len(path) and table[-1].split()[-2:] == ["1", "10.0"]
