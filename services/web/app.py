"""Web dashboard wiring: the :class:`~services.web.service.Dashboard` pages on Starlette, served by uvicorn.

Read-only (every route is a GET); the pages and what each shows: :mod:`services.web.service`. The dashboard
has nothing of its own to catch up: it is ready whenever Kafka and Redis answer (probed at each ``/ready``),
and while one is down its pages answer 503 (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
from typing import Any

from services.web.config import WebSettings
from services.web.service import Dashboard
from services.web.store import Sources

log = logging.getLogger("apportion.web")

#: Seconds a client may take to send a whole request (its headers) after it connects, or after the answer to its
#: last one (keep-alive), before its connection is closed.
WEB_IDLE_S = 5.0

#: Most connections the dashboard holds at once; one more is closed at once, unanswered.
WEB_MAX_CONNECTIONS = 64


def create_app(settings: WebSettings, sources: Sources | None = None) -> Any:
    """The Starlette application (:meth:`~services.web.service.Dashboard.pages`) reading ``sources`` (default: the
    settings' stack); ``app.state`` holds ``sources`` and ``readiness``."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.routing import Route

    from apportion.bus.resilience import readiness_for
    from apportion.bus.security import kafka_auth

    src = sources or Sources(settings.connection(), settings.log_cache_s)
    conn = getattr(src, "conn", None)  # sources without a connection (tests): nothing to probe
    readiness = readiness_for(conn.bootstrap, conn.redis_url) if conn is not None else readiness_for()
    readiness.set(True)
    principal = kafka_auth().get("sasl_plain_username", "")  # shown in the header: `web` under `stack up`
    dashboard = Dashboard(settings, src, readiness, principal)
    app = Starlette(
        routes=[Route(path, page) for path, page in dashboard.pages()],
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(settings))],
    )
    app.state.sources = src
    app.state.readiness = readiness
    return app


def server_tls(settings: WebSettings) -> dict[str, Any]:
    """uvicorn's TLS settings for the dashboard (rule D10.transport): HTTPS with the certificate and
    key given; loopback may stay HTTP; any other address without them is refused.

    Raises:
        ValueError: ``web_host`` is not loopback and no certificate and key are given, or only one of them.
    """
    if bool(settings.web_tls_cert) != bool(settings.web_tls_key):
        raise ValueError("give both --tls-cert and --tls-key (APPORTION_WEB_TLS_CERT, APPORTION_WEB_TLS_KEY)")
    if settings.web_tls_cert:
        return {"ssl_certfile": settings.web_tls_cert, "ssl_keyfile": settings.web_tls_key}
    if not _loopback(settings.web_host):
        raise ValueError(
            f"the dashboard binds {settings.web_host}, beyond loopback, over TLS only: give --tls-cert and "
            "--tls-key (APPORTION_WEB_TLS_CERT, APPORTION_WEB_TLS_KEY), or bind 127.0.0.1"
        )
    return {}


def allowed_hosts(settings: WebSettings) -> list[str]:
    """The ``Host`` names the dashboard answers (rule D10.loopback); any other gets 400 and no page.

    Over plain HTTP (loopback) only the loopback names and the bound host: a web page that a browser on the
    machine opens could otherwise point a name of its own at 127.0.0.1 (DNS rebinding) and read every page as
    its own origin. Over HTTPS any name: the certificate binds the name the browser asked for.
    """
    if settings.web_tls_cert:
        return ["*"]
    return sorted({"127.0.0.1", "localhost", settings.web_host})


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to anything
        return False


def serve(settings: WebSettings) -> None:
    """Run the dashboard with uvicorn until SIGTERM/SIGINT (JSON logs like every service)."""
    import uvicorn

    from apportion.bus.service import setup_logging

    setup_logging("web", settings.log_level, settings.log_json)
    tls = server_tls(settings)  # refused before anything connects
    app = create_app(settings)
    log.info(
        "dashboard on %s://%s:%d/ (Kafka %s, Redis %s)",
        "https" if tls else "http",
        settings.web_host,
        settings.web_port,
        app.state.sources.conn.bootstrap,
        app.state.sources.conn.redis_url,
    )
    # pages answer 503 while a source is down; say so once at start, with a line per try, and never exit
    threading.Thread(target=_wait_logged, args=(app.state.readiness,), name="wait-sources", daemon=True).start()
    try:
        uvicorn.Server(server_config(app, settings)).run()
    finally:
        app.state.sources.close()


def server_config(app: Any, settings: WebSettings) -> Any:
    """uvicorn's configuration of the dashboard: its address, TLS (:func:`server_tls`), no access log, and the
    bounded connections of :func:`bounded_protocol`."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=settings.web_host,
        port=settings.web_port,
        log_config=None,
        access_log=False,
        http=bounded_protocol(),
        timeout_keep_alive=max(1, round(WEB_IDLE_S)),
        **server_tls(settings),
    )


def bounded_protocol() -> type:
    """uvicorn's HTTP/1.1 protocol with a bound on the connections held and on how long each may go without a
    whole request (rule D10.loopback: every account of the machine reaches the dashboard on loopback).

    A connection beyond :data:`WEB_MAX_CONNECTIONS` is closed as it is made, unanswered; one that has not sent
    the headers of a request :data:`WEB_IDLE_S` after it connected, or after its last answer, is closed (a
    client that sends nothing, or dribbles a request that never ends). Without this a local process holds as
    many idle connections as the server has file descriptors, and the dashboard answers nobody else.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Bounded(H11Protocol):
        admitted = False
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= WEB_MAX_CONNECTIONS:
                transport.close()
                return
            self.admitted = True
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if not self.admitted:
                return
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.admitted:
                super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(WEB_IDLE_S, self._idle)

        def _idle(self) -> None:
            self.deadline = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request whose headers came is being answered
            self.timeout_keep_alive_handler()

    return Bounded


def _wait_logged(readiness: Any) -> None:
    """Log ``waiting for Kafka/Redis at ...`` with backoff until both answer (a thread beside the server)."""
    import asyncio

    from apportion.bus.resilience import wait_reachable

    if asyncio.run(wait_reachable(readiness, asyncio.Event())):
        readiness.set(True)
