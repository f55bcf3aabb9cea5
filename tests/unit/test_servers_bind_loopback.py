"""Every server apportion starts binds 127.0.0.1 by default (rule D10.loopback; docs/security.md, "Servers").

The dashboard's default is tested in tests/service/test_web_pages.py; this covers every service's Prometheus
endpoint: the settings' default, and the socket the endpoint actually listens on (read from the kernel's table).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from apportion.bus.service import ServiceSettings, start_metrics
from services.accounting.config import AccountingSettings
from services.dispatcher.config import DispatcherSettings
from services.node_agent.config import NodeAgentSettings
from services.policy.config import PolicySettings
from services.web.config import WebSettings


@pytest.mark.parametrize(
    "settings",
    [ServiceSettings, DispatcherSettings, AccountingSettings, PolicySettings, NodeAgentSettings, WebSettings],
)
def test_every_services_metrics_endpoint_defaults_to_loopback(settings, monkeypatch) -> None:
    monkeypatch.delenv("APPORTION_METRICS_HOST", raising=False)
    assert settings().metrics_host == "127.0.0.1"


def _listening(port: int) -> list[str]:
    """Local IPv4 addresses (dotted) of the sockets listening on ``port`` (``/proc/net/tcp``, state 0A)."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host, hexport = local.split(":")
        if state == "0A" and int(hexport, 16) == port:
            out.append(socket.inet_ntoa(bytes.fromhex(host)[::-1]))
    return out


def test_the_metrics_endpoint_listens_on_loopback_only() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, stop = start_metrics(port)
    try:
        assert _listening(port) == ["127.0.0.1"]
    finally:
        stop()
    _, stop = start_metrics(port, "0.0.0.0")  # what a container sets on purpose: the check sees the difference
    try:
        assert _listening(port) == ["0.0.0.0"]
    finally:
        stop()


def test_faust_web_server_is_off_by_default_and_binds_loopback_when_enabled() -> None:
    """faust's own web server listens on every interface unless told otherwise: the policy service's app leaves it
    off, and one given a port binds 127.0.0.1."""
    from apportion.bus.faust_app import make_app

    off = make_app("bind-test-off", "127.0.0.1:1")
    on = make_app("bind-test-on", "127.0.0.1:1", web_port=6066)
    assert (off.conf.web_enabled, on.conf.web_enabled, on.conf.web_port) == (False, True, 6066)
    assert on.conf.web_bind == "127.0.0.1"
