#!/usr/bin/env python3
"""Wait until a Kafka broker answers a Metadata request, watching its process.

Standard library only, so ``start.sh`` needs no virtualenv.  Sends a
Metadata v1 request (supported by every broker from 0.10 through 4.x) and
counts the process ready when the response lists at least one broker and a
controller.  With ``--sasl MECHANISM`` (a SASL listener, which answers
nothing before authentication) it sends a SaslHandshake v1 instead and counts
the broker ready when it accepts the mechanism: a KRaft broker opens its
client listeners only once it is registered and unfenced.  With ``--tls
CAFILE`` (a SASL_SSL listener) the connection is TLS, the broker's certificate
verified against CAFILE and HOST.  Exits 0 when ready, 1 when the process
died, 2 on timeout.

    wait_ready.py HOST PORT --pid PID --timeout SECONDS [--sasl SCRAM-SHA-512 [--tls CAFILE]]
"""

from __future__ import annotations

import argparse
import socket
import ssl
import struct
import sys
import time

METADATA_API_KEY = 3
METADATA_VERSION = 1
SASL_HANDSHAKE_API_KEY = 17
SASL_HANDSHAKE_VERSION = 1


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != b"Z"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed mid-response")
        buf += chunk
    return bytes(buf)


def metadata_brokers(host: str, port: int, timeout: float = 2.0) -> tuple[int, int]:
    """Return (broker count, controller id) from a Metadata v1 call."""
    client_id = b"apportion-wait-ready"
    body = struct.pack(">hhih", METADATA_API_KEY, METADATA_VERSION, 1, len(client_id))
    body += client_id + struct.pack(">i", -1)  # null topic array: all topics
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        resp = _recv_exact(sock, size)
    pos = 4  # correlation id
    (n_brokers,) = struct.unpack_from(">i", resp, pos)
    pos += 4
    for _ in range(n_brokers):
        pos += 4  # node id
        (hlen,) = struct.unpack_from(">h", resp, pos)
        pos += 2 + hlen + 4  # host, port
        (rlen,) = struct.unpack_from(">h", resp, pos)
        pos += 2 + max(rlen, 0)  # rack (nullable)
    (controller,) = struct.unpack_from(">i", resp, pos)
    return n_brokers, controller


def sasl_accepts(host: str, port: int, mechanism: str, timeout: float = 2.0, cafile: str = "") -> bool:
    """True when a SaslHandshake v1 for ``mechanism`` is answered with error code 0 (over TLS with ``cafile``)."""
    client_id = b"apportion-wait-ready"
    mech = mechanism.encode()
    body = struct.pack(">hhih", SASL_HANDSHAKE_API_KEY, SASL_HANDSHAKE_VERSION, 1, len(client_id))
    body += client_id + struct.pack(">h", len(mech)) + mech
    with socket.create_connection((host, port), timeout=timeout) as raw:
        sock = ssl.create_default_context(cafile=cafile).wrap_socket(raw, server_hostname=host) if cafile else raw
        sock.sendall(struct.pack(">i", len(body)) + body)
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        resp = _recv_exact(sock, size)
    (error_code,) = struct.unpack_from(">h", resp, 4)  # after the correlation id
    return error_code == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--sasl", default="", help="probe a SASL listener with a handshake for this mechanism")
    ap.add_argument("--tls", default="", metavar="CAFILE", help="the listener is TLS: verify it with this CA")
    args = ap.parse_args(argv)

    deadline = time.monotonic() + args.timeout
    last_error = "no attempt yet"
    while time.monotonic() < deadline:
        if not _alive(args.pid):
            print(f"wait_ready: process {args.pid} exited before the broker answered", file=sys.stderr)
            return 1
        try:
            if args.sasl:
                if sasl_accepts(args.host, args.port, args.sasl, cafile=args.tls):
                    return 0
                last_error = f"SASL handshake: {args.sasl} not enabled"
            else:
                brokers, controller = metadata_brokers(args.host, args.port)
                if brokers >= 1 and controller >= 0:
                    return 0
                last_error = f"metadata: {brokers} brokers, controller {controller}"
        except (OSError, struct.error, ConnectionError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        time.sleep(0.1)  # poll interval, bounded by the deadline above
    print(
        f"wait_ready: no answer from {args.host}:{args.port} within {args.timeout:.0f}s ({last_error})", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
