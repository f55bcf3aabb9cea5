"""``bus.service.open_in_thread``: a client made in a worker thread for a task cancelled meanwhile is closed once
made, not dropped with its network thread running (the dispatcher's term start, cancelled by a caller's timeout)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from apportion.bus.service import open_in_thread


class Client:
    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


async def test_a_client_made_after_its_task_was_cancelled_is_closed() -> None:
    client, started, go = Client(), threading.Event(), threading.Event()

    def make() -> Client:
        started.set()
        assert go.wait(10)
        return client

    task = asyncio.create_task(open_in_thread(make))
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not client.closed.is_set()  # still being made
    go.set()
    assert await asyncio.to_thread(client.closed.wait, 10)


async def test_a_client_made_for_a_task_that_waits_is_returned_open() -> None:
    client = Client()
    assert await open_in_thread(lambda: client) is client
    assert not client.closed.is_set()


async def test_a_make_that_fails_raises_to_its_task() -> None:
    def fail() -> Client:
        raise TimeoutError("no broker")

    with pytest.raises(TimeoutError, match="no broker"):
        await open_in_thread(fail)
