"""Deterministic signing identities for tests (DESIGN section 10; :mod:`apportion.identity`).

``identity("alice")`` is the same key pair in every run (the private key is
the SHA-256 of the name), so logs built in tests are byte-identical;
``registered(...)`` is the ops event that makes such a key valid.
"""

from __future__ import annotations

import hashlib
from datetime import datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from apportion import events
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
