"""The policy's start logs no ERROR for what a normal start meets: aiokafka's retried lookups of the group
coordinator (a fresh broker answers "not available" until it has made its offsets topic) are INFO, a WARNING
that says what to check once they last, and what aiokafka does not retry stays an ERROR."""

from __future__ import annotations

import logging

import pytest
from aiokafka import errors

from services.policy.app import GROUP_COORDINATOR_LOGGER, CoordinatorWait, coordinator_waits_at_info

LOOKUP = "Group Coordinator Request failed: %s"


def record(msg: str, err: object, at_s: float) -> logging.LogRecord:
    """A record as aiokafka's ``log.error(msg, err)`` makes it, at ``at_s`` seconds."""
    rec = logging.LogRecord(GROUP_COORDINATOR_LOGGER, logging.ERROR, __file__, 1, msg, (err,), None)
    rec.created = at_s
    return rec


def test_retried_lookups_are_info_then_a_warning_that_says_what_to_check() -> None:
    wait = CoordinatorWait()
    seen = []
    for at_s in (1000.0, 1000.1, 1029.9, 1031.0):
        rec = record(LOOKUP, errors.GroupCoordinatorNotAvailableError(), at_s)
        assert wait.filter(rec)  # kept, at its new level
        seen.append((rec.levelname, rec.getMessage()))
    waiting = (
        "INFO",
        "waiting for the group coordinator ([Error 15] GroupCoordinatorNotAvailableError): the broker may still be "
        "creating its offsets topic",
    )
    assert seen == [
        waiting,
        waiting,
        waiting,
        (
            "WARNING",
            "no group coordinator after 31 s ([Error 15] GroupCoordinatorNotAvailableError): check that the brokers "
            "are up and that the broker's offsets.topic.replication.factor is at most the number of brokers; "
            "retrying",
        ),
    ]


@pytest.mark.parametrize(
    ("msg", "err"),
    [
        pytest.param(LOOKUP, errors.GroupAuthorizationFailedError(), id="lookup failure not retried"),
        pytest.param("Heartbeat failed: %r", errors.GroupCoordinatorNotAvailableError(), id="another message"),
    ],
)
def test_what_aiokafka_does_not_retry_stays_an_error(msg: str, err: object) -> None:
    rec = record(msg, err, 1000.0)
    assert CoordinatorWait().filter(rec)
    assert (rec.levelno, rec.msg, rec.args) == (logging.ERROR, msg, (err,))


def test_the_policy_puts_it_on_aiokafkas_logger_once(caplog: pytest.LogCaptureFixture) -> None:
    """Exactly one :class:`CoordinatorWait` after the policy's start, whether or not a policy started earlier in
    this process (another test of the worker: the logger is the process's) put one there; other filters kept."""
    logger = logging.getLogger(GROUP_COORDINATOR_LOGGER)
    before = list(logger.filters)
    others = [f for f in before if not isinstance(f, CoordinatorWait)]
    try:
        for start in (others, [*others, CoordinatorWait()]):  # none there yet; one left by an earlier start
            logger.filters[:] = start
            coordinator_waits_at_info()
            coordinator_waits_at_info()
            assert [f for f in logger.filters if not isinstance(f, CoordinatorWait)] == others
            assert sum(isinstance(f, CoordinatorWait) for f in logger.filters) == 1
        with caplog.at_level(logging.INFO):
            logger.error(LOOKUP, errors.CoordinatorLoadInProgressError())
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            (
                "INFO",
                "waiting for the group coordinator ([Error 14] GroupLoadInProgressError): the broker may still be "
                "creating its offsets topic",
            )
        ]
    finally:
        logger.filters[:] = before


def test_the_catch_up_readers_close_logs_no_error_and_an_error_outside_the_close_stays_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kafka-python 3 logs at ERROR the connection its close aborts (the catch-up's reader is often still opening
    its coordinator connection) and the metadata refresh the close cancels: DEBUG inside the close (not logged at
    INFO), ERROR after."""
    from services.policy.service import CLIENT_LOGGERS, closing_quietly

    caplog.set_level(logging.INFO)
    caplog.handler.setLevel(logging.NOTSET)  # as the services' handlers: every level the loggers pass
    transport, connection, cluster = (logging.getLogger(name) for name in CLIENT_LOGGERS)
    with closing_quietly():
        transport.error("%s: Abort (%s)", "<KafkaSSLTransport [127.0.0.1:9092<-55086]>", "KafkaConnectionError")
        connection.error("%s: Connection lost: %s", "<KafkaConnection node_id=coordinator-1>", "KafkaConnectionError")
        cluster.error("Metadata refresh: failed %s", "Cancelled")
        try:
            raise AttributeError("'NoneType' object has no attribute 'recv'")
        except AttributeError:
            transport.exception("%s: Error receiving network data closing socket", "<KafkaSSLTransport [none]>")
    assert caplog.records == []
    transport.error("%s: Abort (%s)", "<KafkaSSLTransport [127.0.0.1:9092<-55090]>", "KafkaConnectionError")
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("kafka.net.transport", "ERROR", "<KafkaSSLTransport [127.0.0.1:9092<-55090]>: Abort (KafkaConnectionError)")
    ]
    assert all(not logging.getLogger(name).filters for name in CLIENT_LOGGERS)
