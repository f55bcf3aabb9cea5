"""A job may not take a closed port of the control plane on loopback while its server is down (rule
D10.node-boundary; ``docs/security.md``, "Node boundary"): the connect filter refuses a job a bind of those
ports as it refuses a connect. Without it, a job that waits for a restart (``apportion stack restart web``, a
Redis or broker restart) and binds the port first keeps the server from starting (``EADDRINUSE``) and answers
its clients itself: over plain HTTP on loopback the dashboard's users get the job's page.

The real agent (:class:`tests.service.test_node_agent_boundary.Node`), alice's job, a closed port with nothing
listening on it (its server between a stop and a start) and a free port that is not closed.
"""

from __future__ import annotations

import json
import socket

from apportion.events import JobCompleted
from tests.kit.node_boundary import ALICE, job_accounts, shared_dir, write_script
from tests.service.test_node_agent_boundary import Node

__all__ = ["job_accounts", "shared_dir"]  # fixtures used by name

#: A job that binds (and listens on) each ``host port`` of its arguments and writes ``bind.json``:
#: ``"<host> <port>"`` -> ``ok`` or the errno.
BIND_JOB = r"""
import errno, json, socket, sys

def outcome(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            s.bind((host, port))
            s.listen(1)
            return "ok"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc))

ports = [int(p) for p in sys.argv[1:]]
hosts = ["127.0.0.1", "127.1.2.3", "0.0.0.0", "::1", "::"]
json.dump({f"{h} {p}": outcome(h, p) for h in hosts for p in ports}, open("bind.json", "w"))
"""

LOOPBACK_BINDS = ("127.0.0.1", "127.1.2.3", "0.0.0.0", "::1", "::")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_job_cannot_bind_a_closed_port_on_loopback_while_its_server_is_down(
    job_accounts, shared_dir, monkeypatch
):
    shut, free = _free_port(), _free_port()
    node = Node(shared_dir, monkeypatch, sandbox_closed_ports=[shut])
    await node.agent.start(heartbeats=False, poll_progress=False)
    try:
        script = write_script(shared_dir, "bind_job.py", BIND_JOB)
        await node.agent.on_event(node.start("j-bind", ALICE, ("python3", str(script), str(shut), str(free))))
        assert isinstance(await node.ended("j-bind"), JobCompleted)
        got = json.loads((node.ckpt / "j-bind" / "bind.json").read_text())
    finally:
        await node.close()
    with socket.create_server(("127.0.0.1", shut)):
        pass  # the server's side of the node still binds it
    assert got == {
        **{f"{h} {shut}": "EPERM" for h in LOOPBACK_BINDS},
        **{f"{h} {free}": "ok" for h in LOOPBACK_BINDS},
    }
