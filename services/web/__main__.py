"""``python -m services.web``: the read-only web dashboard (budget tree, queue, jobs, nodes, simulations).

Examples::

    python -m services.web --port 8080
    python -m services.web --port 8080 --simulate-json week44.json
    python -m services.web --host 0.0.0.0 --port 8443 --tls-cert server.pem --tls-key server.key
                                                           # reachable from other hosts: TLS, and auth in front

Reads Redis (the read models) and Kafka (the log) as the CLI does (``APPORTION_*`` variables, else the
local stack's ``stack.env``); writes nothing. Every flag has an ``APPORTION_<NAME>`` environment variable
(``APPORTION_WEB_PORT``, ``APPORTION_WEB_HOST``, ``APPORTION_WEB_TLS_CERT``, ``APPORTION_WEB_TLS_KEY``);
flags win. Any address but loopback is served over TLS only: without a certificate and key it does not start.
"""

from __future__ import annotations

import argparse

from apportion.bus.service import add_common_flags, flag_overrides
from services.web.config import WebSettings


def parse_args(argv: list[str] | None = None) -> dict:
    """Command-line flags -> settings overrides (only the flags given)."""
    ap = argparse.ArgumentParser(
        prog="python -m services.web",
        description="apportion web dashboard (read-only): budget tree with share, occupancy and r; "
        "occupancy share against share per budget; the queue with pending reasons; job timelines; "
        "nodes; simulate --json comparisons.",
    )
    ap.add_argument("--port", dest="web_port", type=int, help="HTTP port (0: a free one)")
    ap.add_argument("--host", dest="web_host", help="interface to bind (not loopback: TLS only)")
    ap.add_argument("--tls-cert", dest="web_tls_cert", help="server certificate chain (PEM): serve HTTPS")
    ap.add_argument("--tls-key", dest="web_tls_key", help="the certificate's private key (PEM)")
    ap.add_argument(
        "--simulate-json",
        dest="simulate_json",
        action="append",
        help="an `apportion simulate --json` file for the /simulate page (repeatable)",
    )
    add_common_flags(ap, WebSettings)
    return flag_overrides(ap, argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point: settings from flags and environment, then serve until SIGTERM/SIGINT."""
    from services.web.app import serve

    serve(WebSettings(**parse_args(argv)))


if __name__ == "__main__":
    main()
