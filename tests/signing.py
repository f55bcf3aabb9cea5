"""Deterministic signing identities for tests (DESIGN section 10; :mod:`apportion.identity`).

``identity("alice")`` is the same key pair in every run (the private key is
the SHA-256 of the name), so logs built in tests are byte-identical;
``registered(...)`` is the ops event that makes such a key valid.
Node reports are signed as a node agent signs them (:func:`node_value`), with
their nodes' keys registered before them (:func:`with_node_keys`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from apportion import events
from apportion.domain.admission import is_node_report, node_principal
from apportion.identity import Identity


def identity(user: str, role: str = "user") -> Identity:
    """The test identity of ``user`` (a fixed key pair derived from the name)."""
    return Identity(user, role, Ed25519PrivateKey.from_private_bytes(hashlib.sha256(user.encode()).digest()))


def registered(ident: Identity, ts: datetime) -> events.UserKeyRegistered:
    """The ``UserKeyRegistered`` of ``ident`` at ``ts`` (deterministic id)."""
    return events.UserKeyRegistered(
        event_id=events.det_id("test-key", ident.user, ident.public_key),
        user=ident.user,
        public_key=ident.public_key,
        role=ident.role,  # type: ignore[arg-type]
        by="ops",
        ts=ts,
        producer="test",
    )


def node_identity(node_id: str) -> Identity:
    """The test identity of node ``node_id`` (principal ``node:<node_id>``)."""
    return identity(node_principal(node_id))


#: The node of the tests' reports that name none (``builders.completed`` and ``failed`` leave it out).
DEFAULT_NODE = "n0"


def node_value(e: events.Event) -> bytes:
    """The record value of ``e`` as a node agent publishes it: a node report signed by its node's key, else plain.

    A report that names no node is reported by :data:`DEFAULT_NODE` (its ``node_id`` is set in the bytes).
    """
    if not is_node_report(e):
        return events.encode(e)
    node = getattr(e, "node_id", None)
    if node is None:
        node = DEFAULT_NODE
        e = e.model_copy(update={"node_id": node})
    return node_identity(node).signed_value(e)


def with_node_keys(evs: Iterable[events.Event], known: set[str] | None = None) -> list[events.Event]:
    """``evs`` with the registration of each reporting node's key before its first report.

    Each registration's time is the earliest of that node's reports in ``evs``
    (the key is in force for all of them). ``known``: nodes registered
    before (skipped; updated).
    """
    evs = list(evs)
    seen = known if known is not None else set()
    first: dict[str, datetime] = {}
    for e in evs:
        if is_node_report(e):
            node = getattr(e, "node_id", None) or DEFAULT_NODE
            first[node] = min(first.get(node, e.ts), e.ts)
    out: list[events.Event] = []
    for e in evs:
        if is_node_report(e):
            node = getattr(e, "node_id", None) or DEFAULT_NODE
            if node not in seen:
                seen.add(node)
                out.append(registered(node_identity(node), first[node]))
        out.append(e)
    return out
