"""The broker's and Redis's own connection limits, applied by the servers of the session stack (``infra/kafka``'s
``server.properties``, ``infra/redis/start.sh``), from plain sockets that never sign in: the defence behind the node
agent's connect filter (``docs/security.md``), with no filter in the way.

What each server holds is read from its own descriptors (``/proc/<pid>/fd`` against ``/proc/<pid>/net/tcp``): a
connection the server has not accepted holds none of them. Every wait is bounded.
"""

from __future__ import annotations

import ipaddress
import os
import re
import select
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DEADLINE_S = 30.0


def _stack_dir() -> Path:
    """The data directory of the session's native stack (``<datadir>/kafka/secrets`` is in the environment)."""
    secrets = os.environ.get("APPORTION_KAFKA_SECRETS_DIR")
    if not secrets or not (Path(secrets).parents[1] / "kafka" / "kafka.pid").is_file():
        pytest.fail("the session stack is not the native one of infra/ (its pid files are needed)", pytrace=False)
    return Path(secrets).parents[1]


def _setting(props: str, key: str) -> str:
    found = re.findall(rf"^{re.escape(key)}=(.*)$", props, re.MULTILINE)
    assert found, f"{key} in server.properties"
    return found[-1].strip()  # later lines win, as in Kafka's reading


def _ip(hex_addr: str) -> str:
    """An address of ``/proc/net/tcp`` or ``tcp6`` (32-bit words, each little-endian) as text, an IPv4-mapped one
    (a Java server's dual-stack socket) as its IPv4 address: ``0100007F`` -> ``127.0.0.1``."""
    raw = bytes.fromhex(hex_addr)
    ip = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


def held(pid: int, port: int, peer: str | None = None) -> int:
    """Established connections to ``port`` (from ``peer`` when given) that process ``pid`` holds a descriptor of."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    n = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            if state != "01" or inode not in inodes or int(local.split(":")[1], 16) != port:
                continue
            if peer is None or _ip(remote.split(":")[0]) == peer:
                n += 1
    return n


def until(what: str, done: Callable[[], bool]) -> None:
    end = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)  # poll interval, bounded by the deadline


@contextmanager
def connections(port: int, n: int, source: str = "127.0.0.1") -> Iterator[list[socket.socket]]:
    """``n`` TCP connections to ``127.0.0.1:port`` from ``source`` that send nothing, closed on exit."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind((source, 0))
            s.settimeout(5.0)
            s.connect(("127.0.0.1", port))
        yield socks
    finally:
        for s in socks:
            s.close()


def closed_by_peer(socks: list[socket.socket]) -> list[socket.socket]:
    """The sockets the server closed: readable, and a peek gives end of file or a reset (``poll``: more than
    1,024 descriptors)."""
    poller = select.poll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    out = []
    for fd, _ in poller.poll(0):
        try:
            if by_fd[fd].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                out.append(by_fd[fd])
        except ConnectionResetError:
            out.append(by_fd[fd])
        except BlockingIOError:
            continue
    return out


def produce_one(bootstrap: str, topic: str) -> int:
    """Produce a record as the session's client and return its offset (the broker serves clients)."""
    from kafka import KafkaProducer

    from apportion.bus.security import kafka_auth

    producer = KafkaProducer(bootstrap_servers=bootstrap, **kafka_auth())
    try:
        return producer.send(topic, b"still serving").get(timeout=DEADLINE_S).offset
    finally:
        producer.close()


def test_the_controllers_listener_accepts_no_more_than_its_limit_and_the_broker_serves_on(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    """ATTACK (the control plane's descriptors, with no connect filter): 16 more plain connections than the KRaft
    controller's listener allows (``listener.name.controller.max.connections``). The broker serves exactly its
    limit there, counting its own connections to its controller, and holds one more (the connection its acceptor
    took and waits with for a free slot); the rest wait unaccepted, holding none of its descriptors;
    it stays up and a client produces. Without the limit it accepted every one (20,000 ran it out of
    descriptors)."""
    datadir = _stack_dir()
    props = (datadir / "kafka" / "server.properties").read_text()
    limit = int(_setting(props, "listener.name.controller.max.connections"))
    found = re.search(r"CONTROLLER://127\.0\.0\.1:(\d+)", _setting(props, "listeners"))
    assert found is not None
    controller = int(found.group(1))
    pid = int((datadir / "kafka" / "kafka.pid").read_text())
    topic = kafka_topic_factory("limits")
    own = held(pid, controller)
    assert own < limit, "the node's own connections to its controller hold a few of the listener's slots"
    with connections(controller, limit + 16):  # the unaccepted ones (16 and the node's own) fit the backlog of 50
        # the limit, and the one connection its acceptor took and holds while it waits for a free slot
        until(f"the controller's listener to hold {limit} + 1", lambda: held(pid, controller) >= limit + 1)
        assert produce_one(kafka_bootstrap, topic) == 0
        assert held(pid, controller) == limit + 1
    assert Path(f"/proc/{pid}").exists()
    assert produce_one(kafka_bootstrap, topic) == 1


def test_a_client_machine_past_its_connections_is_closed_at_once_and_loopback_is_not(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    """ATTACK (one machine taking the broker's connections): 8 more plain connections from one address
    (``127.0.0.2``, standing for a node or a login machine) than ``max.connections.per.ip``: the broker accepts
    its limit and closes each one past it at once; the stack's own clients on ``127.0.0.1`` (its override)
    produce meanwhile."""
    datadir = _stack_dir()
    props = (datadir / "kafka" / "server.properties").read_text()
    per_ip = int(_setting(props, "max.connections.per.ip"))
    assert "127.0.0.1:" in _setting(props, "max.connections.per.ip.overrides")
    port = int(kafka_bootstrap.rsplit(":", 1)[1])
    pid = int((datadir / "kafka" / "kafka.pid").read_text())
    topic = kafka_topic_factory("limits")
    with connections(port, per_ip + 8, source="127.0.0.2") as socks:
        until("the broker to close 8 connections", lambda: len(closed_by_peer(socks)) >= 8)
        assert produce_one(kafka_bootstrap, topic) == 0
        assert len(closed_by_peer(socks)) == 8
        assert held(pid, port, peer="127.0.0.2") == per_ip


def test_redis_holds_at_most_maxclients_and_serves_again_once_they_go(redis_url: str) -> None:
    """ATTACK (Redis's connection slots, counted before a client signs in): more plain connections than
    ``maxclients`` (1024, ``infra/redis/start.sh``): Redis holds 1024 clients in all, closes each one past them at
    once, stays up, and answers a client once they are gone. ``timeout`` is 300 s."""
    import redis

    from apportion.bus.security import redis_auth

    datadir = _stack_dir()
    pid = int((datadir / "redis" / "redis.pid").read_text())
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    client = redis.Redis.from_url(redis_url, **redis_auth(redis_url))
    try:
        assert client.config_get("maxclients") == {"maxclients": "1024"}
        assert client.config_get("timeout") == {"timeout": "300"}
        with connections(port, 1024 + 8) as socks:
            until("Redis to close the connections past its limit", lambda: held(pid, port) == 1024)
            assert len(closed_by_peer(socks)) >= 8
            assert held(pid, port) == 1024
        assert Path(f"/proc/{pid}").exists()
        until("Redis to answer again", lambda: _pings(client))
    finally:
        client.close()


def _pings(client: object) -> bool:
    import redis

    try:
        return bool(client.ping())  # type: ignore[attr-defined]
    except redis.ConnectionError:
        return False
