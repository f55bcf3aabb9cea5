"""The dashboard leaves loopback over TLS only (rule D10.transport; ``services.web.app.server_tls``)."""

from __future__ import annotations

import pytest

from services.web.app import server_tls
from services.web.config import WebSettings


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_may_stay_http(host: str) -> None:
    assert server_tls(WebSettings(web_host=host)) == {}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "dashboard.lab.example"])
def test_beyond_loopback_without_a_certificate_the_dashboard_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match=f"binds {host}, beyond loopback, over TLS only"):
        server_tls(WebSettings(web_host=host))


def test_with_a_certificate_and_its_key_it_serves_https_anywhere() -> None:
    tls = server_tls(WebSettings(web_host="0.0.0.0", web_tls_cert="/tls/server.pem", web_tls_key="/tls/server.key"))
    assert tls == {"ssl_certfile": "/tls/server.pem", "ssl_keyfile": "/tls/server.key"}


def test_a_certificate_without_its_key_is_an_error() -> None:
    with pytest.raises(ValueError, match="give both --tls-cert and --tls-key"):
        server_tls(WebSettings(web_host="127.0.0.1", web_tls_cert="/tls/server.pem"))
