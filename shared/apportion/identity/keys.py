"""Signing identities and their key files (D10.proven-user): the signers of requests, decisions and reports.

Key files: a user's identity (user, role, private key) is one JSON file, by
default ``$XDG_CONFIG_HOME/apportion/identity.json`` (``~/.config/...``), or
``APPORTION_IDENTITY``. A development stack keeps a keyring instead: a
directory of ``<user>.json`` files named by ``APPORTION_KEYRING`` (the
environment or the stack's ``stack.env``); :func:`apportion.client.identity_for`
enrols a user there on first use with the keyring's ops identity.

What is signed, and how a reader checks it, is :mod:`apportion.identity.canonical`.
"""

from __future__ import annotations

import binascii
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from apportion import events
from apportion.domain.admission import DISPATCHER, NODE_REQUEST_TYPES, REPORT_TYPES
from apportion.identity.canonical import (
    BATCH_DOMAIN,
    BATCH_MAX,
    SIG_MEMBER,
    SIGNATURE,
    b64,
    canonical_bytes,
    leaf_hash,
    node_hash,
    unb64,
)
from apportion.identity.registry import KeyRegistry
from apportion.privatefiles import write_private
from apportion.timeutil import Micros

__all__ = ["SIGNED_TYPES", "BatchSigner", "Identity", "ReportSigner", "identity_file", "keyring_dir", "node_key_file"]

#: Event types whose ``user`` must be proven by a signature.
SIGNED_TYPES = ("JobSubmitted", "JobCancelRequested", "JobHoldRequested", "JobReleaseRequested")

#: Ops' requests on a node: signed like a request, by a key registered with role ``ops`` (:meth:`Identity.sign`).
NODE_REQUEST_NAMES = tuple(cls.__name__ for cls in NODE_REQUEST_TYPES)

E = TypeVar("E", bound=events.Event)


class BatchSigner:
    """Signs what the dispatcher publishes: one Ed25519 signature per batch of up to :data:`BATCH_MAX` records.

    Each value gets ``signer_key`` and its ``signature`` appended (the appended form, comment above
    :data:`BATCH_DOMAIN`); a batch of one is signed as a node report is. Cost: one signature per
    batch, one SHA-256 per record and per inner node, a few bytes joined; about 45 bytes of sibling
    hashes per record and level (5 levels at most).

    Args:
        identity: the signer (principal :data:`~apportion.domain.admission.DISPATCHER`).
        max_batch: records per signature (1 signs each record on its own).
    """

    def __init__(self, identity: Identity, max_batch: int = BATCH_MAX) -> None:
        self.identity = identity
        self.max_batch = max(1, max_batch)
        self._keyed = b',"signer_key":"' + identity.public_key.encode("ascii") + b'"}'

    def check_registered(self, keys: KeyRegistry, at_us: Micros) -> None:
        """Refuse to sign for nobody: the key must prove :data:`DISPATCHER` in ``keys`` at ``at_us``.

        A dispatcher checks it after folding the log, before its first decision: an unregistered key would
        leave the readers taking its decisions as unsigned (a log without any ``service:dispatcher`` key).

        Raises:
            LookupError: ``keys`` has no registration of this key for :data:`DISPATCHER` in force at ``at_us``.
        """
        who = keys.principal(self.identity.public_key, at_us)
        if who is None or who.user != DISPATCHER:
            raise LookupError(
                f"the dispatcher's key {self.identity.public_key} is not registered for {DISPATCHER!r}: "
                f"ops must run `apportion keys register {DISPATCHER} {self.identity.public_key}`"
            )

    def values(self, values: Sequence[bytes]) -> list[bytes]:
        """The signed record values of ``values`` (each the JSON of one event, :func:`apportion.events.encode`).

        Raises:
            ValueError: a value is not a JSON object with at least one member.
        """
        out: list[bytes] = []
        step = self.max_batch
        for lo in range(0, len(values), step):
            out.extend(self._batch(values[lo : lo + step]))
        return out

    def _batch(self, values: Sequence[bytes]) -> list[bytes]:
        bodies = []
        for v in values:
            if not (v.startswith(b'{"') and v.endswith(b"}")):
                raise ValueError(f"not a JSON object of an event: {v[:40]!r}")
            bodies.append(v[:-1] + self._keyed)
        sign = self.identity.private_key.sign
        if len(bodies) == 1:
            body = bodies[0]
            return [body[:-1] + SIG_MEMBER + b64(sign(body)).encode("ascii") + b'"}']
        n = len(bodies)
        levels = [[leaf_hash(b) for b in bodies]]
        while len(levels[-1]) > 1:
            lv = levels[-1]
            up = [node_hash(lv[j], lv[j + 1]) for j in range(0, len(lv) - 1, 2)]
            if len(lv) % 2:
                up.append(lv[-1])
            levels.append(up)
        root_sig = b64(sign(BATCH_DOMAIN + b"%d:" % n + levels[-1][0])).encode("ascii")
        head = b"m."
        tail = b"." + b"%d" % n + b"." + root_sig
        out = []
        for i, body in enumerate(bodies):
            parts, j = [], i
            for lv in levels[:-1]:
                if j ^ 1 < len(lv):
                    parts.append(b64(lv[j ^ 1]).encode("ascii"))
                j //= 2
            sig = head + b"%d" % i + tail + b"".join(b"." + p for p in parts)
            out.append(body[:-1] + SIG_MEMBER + sig + b'"}')
        return out


@dataclass(frozen=True)
class Identity:
    """A principal's signing identity: ``user``, ``role`` and the Ed25519 private key.

    Attributes:
        user: the name requests are signed as.
        role: ``"user"`` or ``"ops"`` (what ops register the public key with).
        private_key: the key; never logged, stored only in the user's own file (mode 0600).
    """

    user: str
    role: str
    private_key: Ed25519PrivateKey = field(repr=False)

    @classmethod
    def generate(cls, user: str, role: str = "user") -> Identity:
        """A fresh key pair for ``user``."""
        return cls(user, role, Ed25519PrivateKey.generate())

    @cached_property
    def public_key(self) -> str:
        """Base64 of the 32-byte raw public key (what ``UserKeyRegistered.public_key`` holds)."""
        raw = self.private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return b64(raw)

    def sign(self, event: E) -> E:
        """``event`` with ``signer_key`` and ``signature`` set (a copy; ``event`` must be a signed type).

        The signature covers the canonical bytes of :func:`apportion.events.encode`
        of the copy with ``signer_key`` set, which is what the verifier rebuilds
        from the published record value.

        Raises:
            TypeError: ``event`` is not a ``JobSubmitted``/``JobCancelRequested`` or an ops request on a node
                (:data:`NODE_REQUEST_NAMES`).
        """
        if event.type not in SIGNED_TYPES + NODE_REQUEST_NAMES:
            kinds = ", ".join(SIGNED_TYPES + NODE_REQUEST_NAMES)
            raise TypeError(f"{event.type} is not a signed request type ({kinds})")
        keyed = event.model_copy(update={"signer_key": self.public_key, SIGNATURE: None})
        payload = keyed.model_dump(mode="json")  # the values json.loads(events.encode(keyed)) reads, without the JSON
        sig = self.private_key.sign(canonical_bytes(payload))
        return keyed.model_copy(update={SIGNATURE: b64(sig)})

    def signed_value(self, event: events.Event) -> bytes:
        """The record value of ``event`` signed by this key: what a node agent publishes for a report.

        For any event type (its model need not declare the fields): the JSON of
        :func:`apportion.events.encode` with ``signer_key`` added, in canonical
        form (:func:`canonical_bytes`), and ``signature`` appended as its last
        member. Readers ignore both fields; :func:`signer_of` checks them. One
        Ed25519 signature per call (deterministic: the same event signs to the
        same bytes, so a report published again is a duplicate, not a reused id).
        """
        payload = json.loads(events.encode(event))
        payload["signer_key"] = self.public_key
        payload.pop(SIGNATURE, None)
        body = canonical_bytes(payload)
        sig = b64(self.private_key.sign(body))
        return body[:-1] + b',"' + SIGNATURE.encode() + b'":"' + sig.encode("ascii") + b'"}'

    def to_json(self) -> dict[str, str]:
        """The identity file's content (holds the private key: keep it private)."""
        seed = self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return {"user": self.user, "role": self.role, "public_key": self.public_key, "private_key": b64(seed)}

    def save(self, path: Path) -> Path:
        """Write the identity file at ``path`` with mode 0600 (its directory 0700); returns ``path``.

        Raises:
            FileExistsError: ``path`` exists (a key is never overwritten silently).
        """
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(path, (json.dumps(self.to_json(), indent=2) + "\n").encode(), exclusive=True)
        return path

    @classmethod
    def load(cls, path: Path) -> Identity:
        """Read an identity file.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not an identity (missing fields, a bad key).
        """
        doc = json.loads(path.read_text())
        try:
            key = Ed25519PrivateKey.from_private_bytes(unb64(doc["private_key"], 32))
            ident = cls(str(doc["user"]), str(doc.get("role", "user")), key)
        except (KeyError, TypeError, binascii.Error) as exc:
            raise ValueError(f"{path} is not an apportion identity file: {exc}") from None
        if doc.get("public_key") not in (None, ident.public_key):
            raise ValueError(f"{path}: public_key does not match private_key")
        return ident


def identity_file() -> Path:
    """The user's identity file: ``APPORTION_IDENTITY``, else ``$XDG_CONFIG_HOME/apportion/identity.json``."""
    if os.environ.get("APPORTION_IDENTITY"):
        return Path(os.environ["APPORTION_IDENTITY"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "apportion" / "identity.json"


def keyring_dir() -> Path | None:
    """The development keyring (``APPORTION_KEYRING`` from the environment, else the stack.env), or ``None``."""
    from apportion.settings import stack_env

    path = os.environ.get("APPORTION_KEYRING") or stack_env().get("APPORTION_KEYRING")
    return Path(path) if path else None


class ReportSigner:
    """Signs what a node agent publishes: each report with the key of the node it names (D10.proven-user).

    Args:
        identities: node id -> that node's identity (principal ``node:<node_id>``).
    """

    def __init__(self, identities: Mapping[str, Identity]) -> None:
        self.identities = dict(identities)
        self._batchers: dict[str, BatchSigner] = {}

    def values(self, evs: Sequence[events.Event]) -> list[bytes]:
        """The record values of ``evs``, in order: each node's reports among them signed together.

        One Ed25519 signature per node and per :data:`BATCH_MAX` of its reports (the appended batch form of
        :class:`BatchSigner`, which every reader checks with :func:`signer_of` and ``audit verify`` re-checks
        record by record); what :meth:`value` leaves unsigned stays unsigned.
        """
        out = [b""] * len(evs)
        mine: dict[str, list[int]] = {}
        for i, ev in enumerate(evs):
            nid = getattr(ev, "node_id", None) or ""
            if nid in self.identities and isinstance(ev, REPORT_TYPES):
                mine.setdefault(nid, []).append(i)
            else:
                out[i] = events.encode(ev)
        for nid, idx in mine.items():
            batcher = self._batchers.get(nid)
            if batcher is None:
                batcher = self._batchers[nid] = BatchSigner(self.identities[nid])
            for i, v in zip(idx, batcher.values([events.encode(evs[i]) for i in idx]), strict=True):
                out[i] = v
        return out

    def value(self, event: events.Event) -> bytes:
        """The record value to publish: signed by the node's key for a report of a node it holds, else plain.

        A report of a node the agent holds no key for (a ``WorkloadRefused``
        ``unknown_node`` answering a command for an id of its claimed prefix
        that it does not host) goes out unsigned: the readers ignore it, as
        they must, since no agent holds that node. A signed one is in the appended form, its body the JSON of
        :func:`apportion.events.encode` with ``signer_key`` added (a group of one of :meth:`values`: no
        canonical re-serialisation).
        """
        return self.values([event])[0]


def node_key_file(key_dir: Path, node_id: str) -> Path:
    """The key file of ``node_id`` in a node key directory: ``<key_dir>/<node_id>.json``."""
    return key_dir / f"{node_id}.json"
