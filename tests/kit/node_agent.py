"""The node agent's surroundings in service tests: ``Sink``, the agent's publisher keeping what it publishes
(``of(cls)``: those of one type), and ``until``, an awaited condition polled on the event loop that fails the test
after ``WAIT_S`` seconds (a bounded wait)."""

from __future__ import annotations

import asyncio

WAIT_S = 20.0


class Sink:
    def __init__(self) -> None:
        self.events: list = []

    async def __call__(self, ev) -> None:
        self.events.append(ev)

    def of(self, cls):
        return [e for e in self.events if isinstance(e, cls)]


async def until(pred, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT_S
    while not pred():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
