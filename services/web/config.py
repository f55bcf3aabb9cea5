"""Web dashboard settings (env prefix ``APPORTION_``; flags of ``python -m services.web`` override)."""

from __future__ import annotations

from pydantic import Field

from apportion.bus.service import ServiceSettings


class WebSettings(ServiceSettings):
    """Settings of the read-only web dashboard.

    Attributes:
        web_host: interface the HTTP server binds to (127.0.0.1 by default, rule D10.loopback). Anything
            but loopback is served over TLS only (``web_tls_cert``/``web_tls_key``; refused without them).
        web_tls_cert, web_tls_key: the server certificate (chain, PEM) and its key; HTTPS when given.
        web_port: HTTP port (0 picks a free one; the log says which).
        simulate_json: ``apportion simulate --json`` files the ``/simulate`` page renders (only these:
            the dashboard never opens a path a request names).
        log_cache_s: wall seconds a read of the log (job timelines, share history) is reused for.
    """

    web_host: str = "127.0.0.1"
    web_port: int = 8080
    web_tls_cert: str = ""
    web_tls_key: str = ""
    simulate_json: list[str] = Field(default_factory=list)
    log_cache_s: float = 2.0
