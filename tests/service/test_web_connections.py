"""The dashboard's server holds a bounded number of connections, each idle for a bounded time (rule
D10.loopback; ``docs/security.md``, "The dashboard"): a local account, or a job whose agent leaves the port
open, that opens connections and sends nothing, or dribbles a request, cannot take the server's file
descriptors. The real uvicorn server of :func:`services.web.app.server_config` on a free loopback port, the
pages on fake sources."""

from __future__ import annotations

import asyncio
import http.client
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from services.web import app as web_app
from services.web.config import WebSettings
from tests.service.test_web_pages import FakeSources

IDLE_S = 0.5  # the idle bound under test (the shipped one, web_app.WEB_IDLE_S, is 5 s)
MAX = 8  # the connection bound under test (shipped: web_app.WEB_MAX_CONNECTIONS)


@dataclass(frozen=True)
class Served:
    port: int
    server: Any  # the uvicorn.Server: its server_state holds the connections it has made

    def connections(self) -> int:
        return len(self.server.server_state.connections)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """The dashboard served as ``serve`` serves it, in a thread of its own."""
    import threading

    import uvicorn

    monkeypatch.setattr(web_app, "WEB_IDLE_S", IDLE_S)
    monkeypatch.setattr(web_app, "WEB_MAX_CONNECTIONS", MAX)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = WebSettings(web_port=port)
    srv = uvicorn.Server(web_app.server_config(web_app.create_app(settings, FakeSources()), settings))
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "the dashboard did not start"
        time.sleep(0.02)
    try:
        yield Served(port, srv)
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def server(served: Served) -> int:
    """The port of :func:`served`."""
    return served.port


def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``s`` (end of stream or reset) within ``seconds``, reading what it sends."""
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def get(port: int, path: str = "/") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_bound(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as idle:
        assert closed_within(idle, IDLE_S + 3), "an idle connection was held past the bound"
    assert get(server) == 200


def test_a_request_dribbled_a_byte_at_a_time_is_closed_after_the_idle_bound(server: int) -> None:
    """Slowloris: the request's headers never end; each byte comes before the bound, the whole never does."""
    with socket.create_connection(("127.0.0.1", server)) as slow:
        slow.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        start = time.monotonic()
        closed = False
        while time.monotonic() - start < IDLE_S + 3:
            try:
                slow.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if closed_within(slow, IDLE_S / 5):
                closed = True
                break
        assert closed, "a request whose headers never end held its connection past the bound"


def test_a_connection_beyond_the_bound_is_closed_at_once_and_the_page_answers_once_they_go(served: Served) -> None:
    server = served.port
    held = [socket.create_connection(("127.0.0.1", server)) for _ in range(MAX)]
    try:
        deadline = time.monotonic() + 5
        while served.connections() < MAX:  # the server has made each of them
            assert time.monotonic() < deadline, f"the server made {served.connections()} of {MAX} connections"
            time.sleep(0.01)  # poll interval, bounded by the deadline
        with socket.create_connection(("127.0.0.1", server)) as extra:
            assert closed_within(extra, 1.0), "a connection beyond the bound was kept"
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while get(server) != 200:  # the slots free as the server sees the closes
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_page_is_still_served_on_a_kept_alive_connection_within_the_bound(server: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=5)
    try:
        for _ in range(3):
            conn.request("GET", "/nodes")
            r = conn.getresponse()
            r.read()
            assert r.status == 200
    finally:
        conn.close()
