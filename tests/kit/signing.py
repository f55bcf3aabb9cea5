"""Deterministic signing identities for tests (rule D10.proven-user; :mod:`apportion.identity`).

``identity("alice")`` is the same key pair in every run (the private key is
the SHA-256 of the name), so logs built in tests are byte-identical;
``registered(...)`` is the ops event that makes such a key valid.
Node reports are signed as a node agent signs them, decisions as the
dispatcher signs them and ops' requests on nodes (cordon, drain, uncordon) by
the ops identity :data:`OPS` (:func:`node_value`), with their keys registered
before them (:func:`with_node_keys`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from apportion import events
from apportion.domain.admission import DISPATCHER, DISPATCHER_TYPES, NODE_REQUEST_TYPES, REPORT_TYPES, node_principal
from apportion.identity.keys import BatchSigner, Identity


def identity(user: str, role: str = "user") -> Identity:
    """The test identity of ``user`` (a fixed key pair derived from the name)."""
    return Identity(user, role, Ed25519PrivateKey.from_private_bytes(hashlib.sha256(user.encode()).digest()))


def registered(ident: Identity, ts: datetime) -> events.UserKeyRegistered:
    """The ``UserKeyRegistered`` of ``ident`` at ``ts`` (deterministic id)."""
    assert ident.role in ("user", "ops"), ident.role
    return events.UserKeyRegistered(
        event_id=events.det_id("test-key", ident.user, ident.public_key),
        user=ident.user,
        public_key=ident.public_key,
        role="ops" if ident.role == "ops" else "user",  # Identity.role is a str; the event takes the two roles
        by="ops",
        ts=ts,
        producer="test",
    )


def node_identity(node_id: str) -> Identity:
    """The test identity of node ``node_id`` (principal ``node:<node_id>``)."""
    return identity(node_principal(node_id))


#: The node of the tests' reports that name none (``builders.completed`` and ``failed`` leave it out).
DEFAULT_NODE = "n0"


def dispatcher_identity() -> Identity:
    """The test identity of the dispatcher (principal ``service:dispatcher``)."""
    return identity(DISPATCHER)


def dispatcher_signer() -> BatchSigner:
    """The dispatcher's signer of the tests (:func:`dispatcher_identity`)."""
    return BatchSigner(dispatcher_identity())


#: The principal that signs the tests' ops requests on nodes (role ``ops``).
OPS = "ops"


def ops_identity() -> Identity:
    """The test identity of ops (:data:`OPS`, role ``ops``): signs cordons, drains and uncordons."""
    return identity(OPS, "ops")


def _dispatchers(e: events.Event) -> bool:
    """Is ``e`` the dispatcher's to sign: a decision or command, or its own ``JobFailed``/``JobLost``."""
    return isinstance(e, DISPATCHER_TYPES) or (
        isinstance(e, (events.JobFailed, events.JobLost)) and e.producer == "dispatcher"
    )


def _signer(e: events.Event) -> str | None:
    """The principal that signs ``e`` in the tests' logs, or ``None`` (unsigned)."""
    if _dispatchers(e):
        return DISPATCHER
    if isinstance(e, NODE_REQUEST_TYPES):
        return OPS
    if isinstance(e, REPORT_TYPES):
        return node_principal(getattr(e, "node_id", None) or DEFAULT_NODE)
    return None


def node_value(e: events.Event) -> bytes:
    """The record value of ``e`` as its writer publishes it: signed by the dispatcher's key, ops' or its node's.

    A decision or command (or the dispatcher's own ``JobFailed``/``JobLost``) is
    signed by :func:`dispatcher_identity`; a cordon, drain or uncordon by
    :func:`ops_identity`; a node report by its node's key; a
    report that names no node is reported by :data:`DEFAULT_NODE` (its
    ``node_id`` is set in the bytes); anything else is plain.
    """
    who = _signer(e)
    if who is None:
        return events.encode(e)
    if who == DISPATCHER:
        return dispatcher_signer().values([events.encode(e)])[0]
    if who == OPS:
        return ops_identity().signed_value(e)
    if getattr(e, "node_id", None) is None:
        e = e.model_copy(update={"node_id": DEFAULT_NODE})
    return identity(who).signed_value(e)


def with_node_keys(evs: Iterable[events.Event], known: set[str] | None = None) -> list[events.Event]:
    """``evs`` with the registration of each signer's key before the first event it signs (:func:`node_value`).

    Each registration's time is the earliest of that signer's events in ``evs``
    (the key is in force for all of them). ``known``: principals (node ids,
    ``service:dispatcher`` or ``ops``) registered before (skipped; updated).
    """
    evs = list(evs)
    seen = known if known is not None else set()

    def who(e: events.Event) -> str | None:
        p = _signer(e)
        return p if p is None or p in (DISPATCHER, OPS) else p[len("node:") :]

    first: dict[str, datetime] = {}
    for e in evs:
        w = who(e)
        if w is not None:
            first[w] = min(first.get(w, e.ts), e.ts)
    out: list[events.Event] = []
    for e in evs:
        w = who(e)
        if w is not None and w not in seen:
            seen.add(w)
            ident = dispatcher_identity() if w == DISPATCHER else ops_identity() if w == OPS else node_identity(w)
            out.append(registered(ident, first[w]))
        out.append(e)
    return out
