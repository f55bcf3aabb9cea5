"""``closing_kafka_clients``: every kafka-python client made inside the block is closed when it ends, those whose
constructor failed too. A consumer or admin client that cannot bootstrap (nothing answers at its address) raises
from its constructor with its network thread still running and no client to close; a test that drives the code
under test to such a failure would leave the thread to every later test of its process.

``left_running``: the clients of such a record whose network thread still runs (what the block's end closes).
A client left running after its test keeps its thread busy for the rest of the worker process (metadata
refreshes; reconnections to a broker its test stopped), and that thread draws on the global ``random`` module
(kafka-python's jitter and node shuffles): Hypothesis then reports each property test of the worker whose draw
it overlapped as a strategy that uses ``random`` (``HypothesisDeprecationWarning``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def closing_kafka_clients() -> Iterator[list[Any]]:
    """Within the block, kafka-python's consumers, producers and admin clients make their network client through
    a recorder; each recorded client is closed at the end (closing one twice is harmless; one that a thread of the
    test is still polling refuses, and is left to that thread). Yields the record."""
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
    from kafka.net.compat import KafkaNetClient

    made: list[Any] = []

    def recorded(**config: Any) -> Any:
        made.append(KafkaNetClient(**config))
        return made[-1]

    kinds = (KafkaConsumer, KafkaProducer, KafkaAdminClient)
    before = [k.DEFAULT_CONFIG["kafka_client"] for k in kinds]
    for k in kinds:
        k.DEFAULT_CONFIG["kafka_client"] = recorded
    try:
        yield made
    finally:
        for k, was in zip(kinds, before, strict=True):
            k.DEFAULT_CONFIG["kafka_client"] = was
        for client in made:
            try:
                client.close()
            except RuntimeError:  # in use by a thread the test left running ("Concurrent access to net.poll!")
                pass  # left_running names it; its own close is its owner's


def left_running(made: list[Any]) -> list[str]:
    """The names of the network threads (``kafka-io-<client_id>``) of the clients in ``made`` that still run."""
    threads = [getattr(getattr(client, "_net", None), "_io_thread", None) for client in made]
    return sorted(t.name for t in threads if t is not None and t.is_alive())
