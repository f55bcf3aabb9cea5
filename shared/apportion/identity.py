"""Proven users (DESIGN section 10): Ed25519 signatures over the canonical bytes of a request.

A ``JobSubmitted``, ``JobCancelRequested``, ``JobHoldRequested`` or ``JobReleaseRequested`` names a ``user``; the
dispatcher believes that name only when the request carries a valid
signature by a key that ops registered for that user
(:class:`~apportion.events.UserKeyRegistered`, not revoked by a
:class:`~apportion.events.UserKeyRevoked`) at the request's event time.
Otherwise it refuses the request with ``JobRejected`` reason
``unauthenticated`` (:func:`apportion.domain.admission.authorize` is the rule).
Because the proof travels in the record, ``audit verify`` re-checks every
signature from the log alone (:func:`check_requests`).

Canonical bytes (what is signed; any language can reproduce them, see
``docs/producing.md``, section "Signing"):

1. the record value is one JSON object (the request as the producer writes it
   to Kafka), including ``"signer_key"``: the base64 (standard alphabet,
   padded) of the 32-byte raw Ed25519 public key;
2. remove the member ``"signature"`` (only that one; everything else,
   ``event_id`` and ``ts`` included, is signed);
3. serialise it as JSON with the members of every object sorted by key
   (Unicode code point order), no whitespace (separators ``,`` and ``:``),
   non-ASCII characters written as themselves (UTF-8) and only the escapes
   JSON requires (``\\"``, ``\\\\``, ``\\b \\f \\n \\r \\t``, ``\\u00XX`` for the other
   control characters), integers as integers and other numbers in their
   shortest round-trip form (what ``json.dumps`` in Python and
   ``JSON.stringify`` in JavaScript both write for magnitudes in [1e-4, 1e16));
4. encode as UTF-8. That is ``json.dumps(obj, sort_keys=True,
   separators=(",", ":"), ensure_ascii=False).encode()`` in Python.

``signature`` is the base64 of the 64-byte Ed25519 signature (RFC 8032) of
those bytes. The verifier parses the record value it read, drops
``signature`` and serialises again the same way, so the proof does not depend
on which fields this reader's schema knows (a request signed under schema v3
still verifies when the reader knows v4).

Replays: the event id is inside the signed bytes, so a signature copied onto
a new event id does not verify; the same event id again is a duplicate that
every reader drops (``apportion.bus.intake``).

Key files: a user's identity (user, role, private key) is one JSON file, by
default ``$XDG_CONFIG_HOME/apportion/identity.json`` (``~/.config/...``), or
``APPORTION_IDENTITY``. A development stack keeps a keyring instead: a
directory of ``<user>.json`` files named by ``APPORTION_KEYRING`` (the
environment or the stack's ``stack.env``); :func:`apportion.client.identity_for`
enrols a user there on first use with the keyring's ops identity.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from apportion import events
from apportion.bus.intake import IdLedger
from apportion.domain.admission import (
    DISPATCHER,
    JOB_REQUESTS,
    NODE_REQUEST_TYPES,
    OWNER_REQUESTS,
    REPORT_TYPES,
    RUN_REPORT_TYPES,
    Principal,
    Rejection,
    authorize,
    authorize_node_request,
    authorize_report,
    is_attributed,
    refused_node_request_event,
    refused_request_event,
)
from apportion.logrecord import log_position
from apportion.timeutil import Micros, to_us

__all__ = [
    "BatchSigner",
    "Identity",
    "KeyRegistry",
    "ReportGate",
    "ReportSigner",
    "RequestGate",
    "SIGNED_TYPES",
    "canonical_bytes",
    "check_reports",
    "check_requests",
    "identity_file",
    "keyring_dir",
    "signer_of",
]

#: Event types whose ``user`` must be proven by a signature.
SIGNED_TYPES = ("JobSubmitted", "JobCancelRequested", "JobHoldRequested", "JobReleaseRequested")

#: Ops' requests on a node: signed like a request, by a key registered with role ``ops`` (:meth:`Identity.sign`).
NODE_REQUEST_NAMES = tuple(cls.__name__ for cls in NODE_REQUEST_TYPES)

#: The JSON member that holds the signature (left out of the signed bytes).
SIGNATURE = "signature"

E = TypeVar("E", bound=events.Event)


def canonical_bytes(payload: Mapping[str, Any]) -> bytes:
    """The bytes a request's signature covers: ``payload`` without ``signature``, canonical JSON (module docstring).

    Raises:
        ValueError: ``payload`` holds a non-finite number (not JSON).
    """
    body = {k: v for k, v in payload.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, size: int) -> bytes:
    """Strict base64 of exactly ``size`` bytes. Raises ValueError otherwise."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) != size:
        raise ValueError(f"expected {size} bytes, got {len(raw)}")
    return raw


class _Verifier:
    """An Ed25519 public key that verifies with libsodium (PyNaCl).

    Keys are made and signatures written with ``cryptography``; readers verify with libsodium, which costs
    about half of OpenSSL's verification here (48 against 96 µs of CPU per signature on the 2-core machine)
    and is strict (it refuses non-canonical signatures and small-order keys and points as well). It releases
    the GIL while it verifies (cffi), which :class:`SignerPrefetch` relies on.
    """

    __slots__ = ("_key",)

    def __init__(self, raw: bytes) -> None:
        self._key = VerifyKey(raw)

    def verify(self, signature: bytes, data: bytes) -> None:
        """Return if ``signature`` signs ``data``; raise :class:`InvalidSignature` otherwise."""
        try:
            self._key.verify(data, signature)
        except BadSignatureError:
            raise InvalidSignature() from None


_PUBLIC: dict[str, _Verifier] = {}


def _public(text: str) -> _Verifier:
    key = _PUBLIC.get(text)
    if key is None:
        key = _Verifier(_unb64(text, 32))
        if len(_PUBLIC) > 10_000:
            _PUBLIC.clear()
        _PUBLIC[text] = key
    return key


def signer_of(raw: bytes | str | None, *, appended: bool = False) -> str | None:
    """The ``signer_key`` of a record value whose signature verifies, else ``None``.

    Stateless and pure (no registry): whether the key belongs to the request's
    user is :meth:`KeyRegistry.principal`'s question.

    Args:
        raw: the record value as read from Kafka.
        appended: first try the *appended form* that node agents
            (:meth:`Identity.signed_value`) and the dispatcher
            (:class:`BatchSigner`) write (:func:`_appended_signer`: no JSON
            parsing), then the canonical form. Requests are checked in the
            canonical form only (their producers write members in any order).

    Returns:
        The base64 public key that signed ``raw``; ``None`` when unsigned, not
        JSON, a malformed key or signature, or a signature that does not verify
        (altered bytes, a copied signature).
    """
    if raw is None:
        return None
    if appended:
        key = _appended_signer(raw.encode() if isinstance(raw, str) else raw)
        if key is not None:
            return key
    try:
        obj = json.loads(raw)
        if not isinstance(obj, dict):
            return None
        key, sig = obj.get("signer_key"), obj.get(SIGNATURE)
        if not isinstance(key, str) or not isinstance(sig, str):
            return None
        _public(key).verify(_unb64(sig, 64), canonical_bytes(obj))
    except (ValueError, TypeError, binascii.Error, InvalidSignature, RecursionError):
        return None
    return key


# --------------------------------------------------------------------------- the appended form and batches
#
# A value in the appended form is ``body[:-1] + ',"signature":"' + S + '"}'``: ``body`` is a JSON object holding
# ``"signer_key":"<base64 key>"`` and no ``signature``, and S signs exactly ``body`` (the value with its last
# member removed), so a reader checks it on the bytes it read, without parsing or re-serialising. S is either
#
# * the base64 Ed25519 signature of ``body`` (a node agent's report made on its own; its body is the
#   canonical form, so the canonical check accepts it too), or
# * ``m.<i>.<n>.<sig>.<h>...`` (the dispatcher's batches and a node agent's groups of reports of one node,
#   :class:`BatchSigner`, :meth:`ReportSigner.values`): record ``i`` of a batch of
#   ``n``; ``sig`` signs ``BATCH_DOMAIN + "<n>:" + root`` once for the batch, where ``root`` is the root of a
#   binary hash tree over the batch's bodies (leaf ``SHA-256(0x00 || body)``, inner node
#   ``SHA-256(0x01 || left || right)``, an odd last node moved up unchanged, RFC 6962's domain separation);
#   the ``h`` are the base64 sibling hashes from the leaf up. A reader verifies ``sig`` once per batch
#   (:data:`_ROOTS` remembers the roots verified) and hashes each record's path up to the first hash it already
#   knows proven (:data:`_GOOD`): the batch's other records mostly cost one SHA-256.

#: The member that ends a value in the appended form, before the signature string.
_SIG_MEMBER = b',"' + SIGNATURE.encode() + b'":"'

#: The member that names the signing key.
_KEY_MEMBER = b'"signer_key":"'

#: Base64 characters of a 32-byte public key.
_KEY_CHARS = 44

#: What a batch signature signs before ``"<n>:" + root`` (never the first bytes of a JSON object).
BATCH_DOMAIN = b"apportion-batch-v1:"

#: Most records one batch signature covers (path of at most log2 of it sibling hashes per record).
BATCH_MAX = 32

#: Largest batch a reader accepts (a bound on the path it hashes).
_BATCH_LIMIT = 1 << 16

#: Batch signatures verified: signature text -> (key, n, root). Cleared past :data:`_ROOTS_CAP` entries (about
#: 250 bytes each: 1 MiB; 4,096 batches cover well over the records a rebuild reads of one batch apart).
_ROOTS: dict[bytes, tuple[str, int, bytes]] = {}
_ROOTS_CAP = 4096

#: Hashes proven committed by a key's batch signature (leaves, siblings and inner nodes of verified paths) -> key.
#: A record whose leaf (or a node of its path) is here needs no more hashing: by collision resistance its bytes
#: are those the key signed. Cleared past :data:`_GOOD_CAP` entries (about 120 bytes each, the key strings
#: shared: 2 MiB). Both caches are only a shortcut (a record missed is hashed or verified again); a larger cap
#: made them most of a reader's memory growth over hours (1,000,000 hashes, about 200 MiB).
_GOOD: dict[bytes, str] = {}
_GOOD_CAP = 16_384


def _leaf(body: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + body).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _appended_signer(raw: bytes) -> str | None:
    """The key that signed ``raw`` in the appended form (single or batch), else ``None`` (not that form, or bad)."""
    if not raw.endswith(b'"}'):
        return None
    pos = raw.rfind(_SIG_MEMBER)
    if pos < 0:
        return None
    sig = raw[pos + len(_SIG_MEMBER) : -2]
    body = raw[:pos] + b"}"
    k = body.rfind(_KEY_MEMBER)
    if k < 0:
        return None
    k += len(_KEY_MEMBER)
    if body[k + _KEY_CHARS : k + _KEY_CHARS + 1] != b'"':
        return None
    try:
        key = sys.intern(body[k : k + _KEY_CHARS].decode("ascii"))  # one string per key in the caches below
        public = _public(key)
        if not sig.startswith(b"m."):
            public.verify(_unb64(sig.decode("ascii"), 64), body)
            return key
        h = _leaf(body)
        if _GOOD.get(h) == key:  # a record of a batch already proven (its leaf was on a verified path)
            return key
        _, i_text, n_text, root_sig, *path = sig.split(b".")
        i, n = int(i_text), int(n_text)
        if not 0 <= i < n <= _BATCH_LIMIT:
            return None
        m, steps, seen = n, iter(path), [h]
        while m > 1:
            if i ^ 1 < m:
                sib = _unb64(next(steps).decode("ascii"), 32)
                h = _node(h, sib) if i % 2 == 0 else _node(sib, h)
                seen += (sib, h)
                if _GOOD.get(h) == key:  # joins a subtree already proven: the rest of the path is known
                    break
            i, m = i // 2, (m + 1) // 2
        else:
            if next(steps, None) is not None:
                return None
            if _ROOTS.get(root_sig) != (key, n, h):
                public.verify(_unb64(root_sig.decode("ascii"), 64), BATCH_DOMAIN + b"%d:" % n + h)
                if len(_ROOTS) >= _ROOTS_CAP:
                    _ROOTS.clear()
                _ROOTS[root_sig] = (key, n, h)
        if len(_GOOD) >= _GOOD_CAP:
            _GOOD.clear()
        for x in seen:  # every hash on a proven path is committed by the key's signature
            _GOOD[x] = key
    except (ValueError, TypeError, binascii.Error, InvalidSignature, StopIteration, UnicodeDecodeError):
        return None
    return key


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
            return [body[:-1] + _SIG_MEMBER + _b64(sign(body)).encode("ascii") + b'"}']
        n = len(bodies)
        levels = [[_leaf(b) for b in bodies]]
        while len(levels[-1]) > 1:
            lv = levels[-1]
            up = [_node(lv[j], lv[j + 1]) for j in range(0, len(lv) - 1, 2)]
            if len(lv) % 2:
                up.append(lv[-1])
            levels.append(up)
        root_sig = _b64(sign(BATCH_DOMAIN + b"%d:" % n + levels[-1][0])).encode("ascii")
        head = b"m."
        tail = b"." + b"%d" % n + b"." + root_sig
        out = []
        for i, body in enumerate(bodies):
            parts, j = [], i
            for lv in levels[:-1]:
                if j ^ 1 < len(lv):
                    parts.append(_b64(lv[j ^ 1]).encode("ascii"))
                j //= 2
            sig = head + b"%d" % i + tail + b"".join(b"." + p for p in parts)
            out.append(body[:-1] + _SIG_MEMBER + sig + b'"}')
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
        return _b64(raw)

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
        return keyed.model_copy(update={SIGNATURE: _b64(sig)})

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
        sig = _b64(self.private_key.sign(body))
        return body[:-1] + b',"' + SIGNATURE.encode() + b'":"' + sig.encode("ascii") + b'"}'

    def to_json(self) -> dict[str, str]:
        """The identity file's content (holds the private key: keep it private)."""
        seed = self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return {"user": self.user, "role": self.role, "public_key": self.public_key, "private_key": _b64(seed)}

    def save(self, path: Path) -> Path:
        """Write the identity file at ``path`` with mode 0600 (its directory 0700); returns ``path``.

        Raises:
            FileExistsError: ``path`` exists (a key is never overwritten silently).
        """
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")
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
            key = Ed25519PrivateKey.from_private_bytes(_unb64(doc["private_key"], 32))
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
    """Signs what a node agent publishes: each report with the key of the node it names (DESIGN section 10).

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


# --------------------------------------------------------------------------- the registry (pure)


#: Runs whose placement a :class:`KeyRegistry` remembers (about 150 bytes each).
PLACEMENTS_KEPT = 1_000_000


@dataclass(slots=True)
class _Grant:
    user: str
    role: str
    from_us: Micros


@dataclass(frozen=True, slots=True)
class _Revocation:
    ts_us: Micros
    position: int | None  # where it is in the log (its record's broker timestamp, ms: log_position); None: unknown


class KeyRegistry:
    """Which key proves which principal when: a fold of ``UserKeyRegistered``/``UserKeyRevoked`` (pure).

    A key proves ``user`` for a signed event of event time t when a
    registration of (user, key) with ``ts <= t`` has been folded (wherever it
    is in the log: registrations precede use, and only ops write them) and no
    revocation of (user, key) made at or after that registration is *earlier
    in the log* than the signed record, whatever the event's ``ts`` says (a
    signer chooses its ``ts``: a stolen key must not sign a backdated event).
    "Earlier in the log" (:meth:`principal`, the one rule of the reader edge
    and the audit) is:

    * both places known (:func:`log_position`: the broker's append time, ms):
      the revocation's is strictly before the signed record's. A record of the
      same millisecond as the revocation stands: the broker's clock does not
      order them, a live reader that read the record first took it, and so
      must a rebuild that reads both in one batch (the cost: a stolen key
      signs for at most one millisecond after its revocation is appended);
    * the signed record's place unknown (``position=None``: a producer's
      ``CreateTime``, or a caller without a record): every revocation folded
      so far counts (it was read before the record is checked);
    * the revocation's place unknown (folded without a record, or restored from
      a snapshot of a reader older than the places): it counts for every record
      checked after it was folded, as in the second case.

    A revocation with ``ts <= t`` revokes too (the signer claims a time after
    it). So a rebuild that reads revocations later in the log than a record
    in the same batch judges the record as the live reader did, and a key's
    rotation voids nothing it signed before.
    Folding an event twice changes nothing (a revocation folded again keeps
    the earliest place it was folded with).

    It also remembers which nodes hold which run (:meth:`place`, fed by the
    reader edge with every ``JobPlaced`` it authenticated), so that a node's
    key proves reports of its own runs only (:meth:`placement`). The oldest
    of more than :data:`PLACEMENTS_KEPT` runs are forgotten (a report of a
    forgotten run is then checked against its node's key only).
    """

    def __init__(self) -> None:
        self._grants: dict[str, list[_Grant]] = {}
        self._revoked: dict[tuple[str, str], list[_Revocation]] = {}
        self._placed: dict[tuple[str, int], tuple[str, ...]] = {}
        self._users: set[str] = set()

    def knows(self, user: str) -> bool:
        """Has a key ever been registered for ``user`` (e.g. ``service:dispatcher``)?"""
        return user in self._users

    def place(self, ev: events.JobPlaced) -> None:
        """Remember the nodes of run (``job_id``, ``attempt``), in replica order (first placement wins)."""
        placed = self._placed
        key = (ev.job_id, ev.attempt)
        if key not in placed:
            placed[key] = tuple(p.node_id for p in ev.placements)
            if len(placed) > PLACEMENTS_KEPT:
                del placed[next(iter(placed))]

    def placement(self, ev: events.Event) -> tuple[str, ...] | None:
        """The nodes of the run a report names (replica order), or ``None`` (not a run report, or no placement known)."""
        if not isinstance(ev, RUN_REPORT_TYPES):
            return None
        return self._placed.get((ev.job_id, ev.attempt))

    def apply(self, ev: events.Event, position: int | None = None) -> bool:
        """Fold one event; True when it is an identity event.

        Args:
            ev: any event (others are ignored).
            position: the record's place in the log (:func:`log_position`); ``None``: unknown.
        """
        if not isinstance(ev, (events.UserKeyRegistered, events.UserKeyRevoked)):
            return False
        if isinstance(ev, events.UserKeyRegistered):
            self._grants.setdefault(ev.public_key, []).append(_Grant(ev.user, ev.role, to_us(ev.ts)))
            self._users.add(ev.user)
        else:
            revs = self._revoked.setdefault((ev.public_key, ev.user), [])
            new = _Revocation(to_us(ev.ts), position)
            for i, r in enumerate(revs):
                if r.ts_us == new.ts_us:  # the same revocation folded again: keep the earliest known place
                    if r.position is None or (position is not None and position < r.position):
                        revs[i] = new
                    break
            else:
                revs.append(new)
        return True

    def __len__(self) -> int:
        return sum(len(g) for g in self._grants.values())

    def principal(self, public_key: str | None, at_us: Micros, position: int | None = None) -> Principal | None:
        """The principal ``public_key`` proves for a signed event, or ``None`` (unknown, not yet, revoked).

        Args:
            public_key: the base64 key that signed (:func:`signer_of`), or ``None``.
            at_us: the signed event's event time (µs).
            position: the signed record's place in the log (:func:`log_position`);
                ``None``: unknown, every revocation folded so far is earlier.

        When one key was registered for several principals, the latest
        registration in force wins.
        """
        if public_key is None:
            return None
        best: _Grant | None = None
        for g in self._grants.get(public_key, ()):
            if g.from_us > at_us:
                continue
            if self._revoked_for(public_key, g, at_us, position):
                continue
            if best is None or g.from_us >= best.from_us:
                best = g
        return Principal(best.user, best.role) if best is not None else None

    def _revoked_for(self, key: str, g: _Grant, at_us: Micros, position: int | None) -> bool:
        for r in self._revoked.get((key, g.user), ()):
            if r.ts_us < g.from_us:
                continue  # revoked before this registration (the key was registered again)
            if r.ts_us <= at_us or position is None or r.position is None or r.position < position:
                return True
        return False


class ReportGate:
    """The reader edge's check of who wrote what (DESIGN section 10); folds the identity events it sees.

    Used by the dispatcher's and the accounting's :class:`~apportion.bus.intake.Intake`
    (:meth:`~apportion.bus.intake.Intake.authenticate`), the standby's token floor
    (:func:`services.dispatcher.lease.highest_token_in_log`) and :func:`check_reports`
    in ``audit verify``, all with each record's :func:`log_position`. The rule is
    :func:`apportion.domain.admission.authorize_report`: decisions and
    commands signed by the dispatcher's key, node reports by their node's,
    of runs placed on that node.

    Args:
        keys: the registry to fold into and check with, or a callable
            returning it (a service whose state, registry included, is
            replaced on restore). Default: a new one.
        folds: the event types the reader folds (``None``: all). An event of another type is let through
            unchecked, since the fold ignores it anyway: the accounting, which folds no heartbeat or start,
            verifies about one node signature per run (its completion) instead of every report.
    """

    def __init__(
        self,
        keys: KeyRegistry | Callable[[], KeyRegistry] | None = None,
        folds: tuple[type, ...] | None = None,
    ):
        reg = keys if keys is not None else KeyRegistry()
        self._keys = reg if callable(reg) and not isinstance(reg, KeyRegistry) else (lambda: reg)
        self.folds = folds

    @property
    def keys(self) -> KeyRegistry:
        """The registry in force."""
        return self._keys()

    @keys.setter
    def keys(self, registry: KeyRegistry) -> None:
        self._keys = lambda: registry

    def observe(self, ev: events.Event, position: int | None = None) -> bool:
        """Fold an identity event at its record's ``position`` (:func:`log_position`); True when ``ev`` was one."""
        return self.keys.apply(ev, position)

    def emitted(self, ev: events.Event) -> None:
        """Note an event this reader wrote itself and will not read back (the dispatcher's echoes): its placements."""
        if isinstance(ev, events.JobPlaced):
            self.keys.place(ev)

    def checks(self, ev: events.Event) -> bool:
        """Does :meth:`report_refusal` check the signature of ``ev`` (attributed, of a type the reader folds)?"""
        return is_attributed(ev) and (self.folds is None or isinstance(ev, self.folds))

    def report_refusal(self, raw: bytes | str | None, ev: events.Event, position: int | None = None) -> str | None:
        """Why ``ev`` (read as ``raw``) must be ignored (``unauthenticated...: ...``), or ``None``.

        Check in log order of each partition: a ``JobPlaced`` that passes is
        remembered (:meth:`KeyRegistry.place`) for the reports of its run that
        follow. An event that needs no signature (:func:`~apportion.domain.admission.is_attributed`),
        or is of a type the reader does not fold: ``None`` without a signature check.
        """
        if not self.checks(ev):
            return None
        keys = self.keys
        signer = keys.principal(signer_of(raw, appended=True), to_us(ev.ts), position)
        why = authorize_report(ev, signer, keys.placement(ev), dispatcher_keyed=keys.knows(DISPATCHER))
        if why is None and isinstance(ev, events.JobPlaced):
            keys.place(ev)
        return why


class RequestGate(ReportGate):
    """The dispatcher's intake check of requests (DESIGN section 10): who may act in whose name.

    Folds the identity events it sees; for a ``JobSubmitted`` or a
    ``JobCancelRequested`` returns the ``JobRejected`` the dispatcher
    publishes instead of deciding on the request (``unauthenticated`` or
    ``not_owner``), for an ops request on a node not signed by ops its
    ``NodeRequestRefused`` (``unauthenticated``), or ``None`` to let it
    through. As a :class:`ReportGate` (the same registry) it is the
    dispatcher's intake check of node reports; it lets the ops requests on
    nodes through there (they get a verdict here, not a dead letter).

    Args:
        producer: the dispatcher's producer name (written on refusals).
    """

    def __init__(self, producer: str = "dispatcher") -> None:
        super().__init__(None)
        self.producer = producer
        self.refused = 0

    def report_refusal(self, raw: bytes | str | None, ev: events.Event, position: int | None = None) -> str | None:
        """:meth:`ReportGate.report_refusal`, but ``None`` for an ops request on a node (:meth:`refusal` answers it)."""
        if isinstance(ev, NODE_REQUEST_TYPES):
            return None
        return super().report_refusal(raw, ev, position)

    def refusal(
        self,
        raw: bytes | None,
        ev: events.Event,
        jobs: Mapping[str, Any],
        now_us: Micros,
        *,
        rebuild: bool = False,
        position: int | None = None,
    ) -> Any:
        """The ``JobRejected`` (or ``NodeRequestRefused``) refusing ``ev``, or ``None`` (allowed, or not a request).

        Args:
            raw: the record value ``ev`` was decoded from (the signature is checked on it).
            ev: the decoded event; identity events are folded here.
            jobs: the dispatcher's jobs by id (``spec.user``, ``spec.budget``): a cancel's owner.
            now_us: event time of the refusal.
            rebuild: an ops request on a node checked by a rebuild, whose registry holds revocations later in
                the log than the request: they count by event time only (an operator's rotated key must not
                undo the drains it signed; a live refusal is in the log as its verdict).
            position: the request's record's place in the log (:func:`log_position`), so that the keys are
                those as of it, as the audit judges it (:func:`check_requests`); ``None``: every revocation
                folded so far counts.
        """
        if self.keys.apply(ev):
            return None
        from apportion.timeutil import from_us

        if isinstance(ev, NODE_REQUEST_TYPES):
            # position 0 (before any record): the revocations folded with a place count by event time only
            # the appended form too: the dispatcher's own cordon (of a node refusing starts) is signed as a decision
            signer = self.keys.principal(signer_of(raw, appended=True), to_us(ev.ts), 0 if rebuild else position)
            refused = authorize_node_request(ev, signer)
            if refused is None:
                return None
            self.refused += 1
            return refused_node_request_event(ev, refused, ts=from_us(now_us), producer=self.producer)
        if not isinstance(ev, JOB_REQUESTS):
            return None
        rejection = self.check(raw, ev, jobs, position)
        if rejection is None:
            return None
        self.refused += 1
        if isinstance(ev, events.JobSubmitted):
            budget = ev.budget
        else:
            rec = jobs.get(ev.job_id)
            budget = rec.spec.budget if rec is not None else ""
        return refused_request_event(ev, rejection, budget=budget, ts=from_us(now_us), producer=self.producer)

    def check(
        self,
        raw: bytes | None,
        ev: events.JobSubmitted | events.JobCancelRequested | events.JobHoldRequested | events.JobReleaseRequested,
        jobs: Mapping[str, Any],
        position: int | None = None,
    ) -> Rejection | None:
        """:func:`~apportion.domain.admission.authorize` of ``ev`` with the signer of ``raw`` at ``ev.ts``.

        ``position``: its record's place in the log (:func:`log_position`; ``None``: unknown).
        """
        signer = self.keys.principal(signer_of(raw), to_us(ev.ts), position)
        owner = None
        if isinstance(ev, OWNER_REQUESTS):
            rec = jobs.get(ev.job_id)
            owner = rec.spec.user if rec is not None else None
        return authorize(ev, signer, owner)


# --------------------------------------------------------------------------- audit


@dataclass(frozen=True, slots=True)
class RequestFinding:
    """A request the dispatcher acted on that the log does not prove.

    Attributes:
        index: position of its record in the sequence given to :func:`check_requests`.
        job_id: the job it names.
        detail: what is wrong (a signature that does not verify, an unknown key, not the owner).
    """

    index: int
    job_id: str
    detail: str


def check_requests(records: Iterable[Any]) -> tuple[list[RequestFinding], int]:
    """Re-check, from the log alone, every request the dispatcher accepted (``audit verify``).

    A request is *accepted* when the log holds no ``JobRejected`` refusing it
    (id ``det_id("JobRejected", job_id, request id)``) and, for a cancel, a
    ``JobCancelled`` of its job, for a hold or release the ``JobHeld`` or ``JobReleased`` answering it
    (``request_id``). Each accepted request must carry a valid
    signature (:func:`signer_of` of its stored bytes) by a key registered for
    its user at its event time, and an accepted cancel, hold or release of another user's job
    must be signed by ops (:func:`~apportion.domain.admission.authorize`).
    Refused requests are not findings: refusing a forgery is the stack working.
    Nor is a request the reader edge dead-lettered as ``event_id reused``
    (:class:`apportion.bus.intake.IdLedger`: an earlier record of its
    partition carried its id with another payload): the dispatcher never acted
    on it. Across partitions the order the dispatcher read them in is not in
    the log, so a reuse there is still checked.

    A key revoked earlier in the log (the revocation's record timestamp
    before the request's: :class:`KeyRegistry`) proves nothing, whatever the
    request's ``ts`` says (a backdated request).

    Logs of a stack without identity (no ``UserKeyRegistered`` at all, e.g. a
    simulator log) are not checked: ``(findings=[], checked=0)``.

    Args:
        records: log records (``event``, ``raw``) in log order.

    Returns:
        ``(findings, checked)``: what is wrong, and how many signed requests were re-checked.
    """
    recs = list(records)
    reg = KeyRegistry()
    refused: set[Any] = set()
    cancelled: set[str] = set()
    answered: set[Any] = set()  # requests a JobHeld or JobReleased carried out
    owner: dict[str, str] = {}
    for r in recs:
        ev = r.event
        if ev is None:
            continue
        reg.apply(ev, log_position(r))
        if isinstance(ev, events.JobRejected):
            refused.add(ev.event_id)
        elif isinstance(ev, events.JobCancelled):
            cancelled.add(ev.job_id)  # a job array's cancel ends with the JobCancelled of the array id
        elif isinstance(ev, (events.JobHeld, events.JobReleased)) and ev.request_id is not None:
            answered.add(ev.request_id)
    if not len(reg):
        return [], 0
    reused: set[int] = set()
    ledgers: dict[tuple[str, int], IdLedger] = {}
    for i in sorted(range(len(recs)), key=lambda i: (recs[i].topic, recs[i].partition, recs[i].offset)):
        ev = recs[i].event
        if isinstance(ev, JOB_REQUESTS):
            try:
                ledgers.setdefault((recs[i].topic, recs[i].partition), IdLedger()).check(ev)
            except events.DecodeError:
                reused.add(i)
    findings: list[RequestFinding] = []
    checked = 0
    for i, r in enumerate(recs):
        ev = r.event
        if not isinstance(ev, JOB_REQUESTS) or i in reused:
            continue
        if events.det_id("JobRejected", ev.job_id, ev.event_id) in refused:
            continue
        if isinstance(ev, events.JobSubmitted):
            for job_id in {ev.job_id, *ev.job_ids}:  # one signed record covers every element of an array
                owner.setdefault(job_id, ev.user)
        elif isinstance(ev, events.JobCancelRequested) and ev.job_id not in cancelled:
            continue  # a cancel that changed nothing proves nothing
        elif not isinstance(ev, (events.JobSubmitted, events.JobCancelRequested)) and ev.event_id not in answered:
            continue  # nor does a hold or release
        checked += 1
        key = signer_of(r.raw)
        if key is None:
            why = "unsigned" if ev.signature is None else "its signature does not verify (altered or forged bytes)"
            findings.append(RequestFinding(i, ev.job_id, f"{ev.type} of user {ev.user!r} accepted, but {why}"))
            continue
        rejection = authorize(ev, reg.principal(key, to_us(ev.ts), log_position(r)), owner.get(ev.job_id))
        if rejection is not None:
            findings.append(
                RequestFinding(i, ev.job_id, f"{ev.type} accepted, but {rejection.reason.value}: {rejection.message}")
            )
    return findings, checked


@dataclass(frozen=True, slots=True)
class ReportCheck:
    """``audit verify``'s look at the node reports of a log (:func:`check_reports`).

    Attributes:
        ignored: indices of the events the services must have ignored (``unauthenticated``,
            ``unauthenticated_node``); the audit's rebuilds leave them out, as the services did.
        findings: ignored events that no service dead-lettered (one did not ignore them).
        checked: decisions, commands and node reports whose signature was checked.
    """

    ignored: frozenset[int]
    findings: list[RequestFinding]
    checked: int


def check_reports(records: Sequence[Any]) -> ReportCheck:
    """Re-check, from the log alone, the signature of every decision, command and node report (``audit verify``).

    The rule is the services' (:class:`ReportGate`,
    :func:`~apportion.domain.admission.authorize_report`) with the log's
    positions for revocations (:class:`KeyRegistry`), checked in each
    partition's offset order (as the services read it: a run's placement
    precedes its reports). An event that fails it must have been ignored by
    the dispatcher and the accounting, which dead-letter it (id
    ``det_id("DeadLetter", topic, partition, offset)``); one without such a
    dead letter is a finding. An ops request on a node that fails it
    (:func:`~apportion.domain.admission.authorize_node_request`) must have
    the dispatcher's ``NodeRequestRefused`` instead (the accounting's dead
    letter does not say the dispatcher did not fold it); one without is a
    finding: the dispatcher accepted it. Logs without any ``UserKeyRegistered`` (a
    simulator's) are not checked.

    Args:
        records: log records (``event``, ``raw``, ``topic``, ``partition``, ``offset``, ``timestamp_ms``).
    """
    gate = ReportGate()
    letters: set[Any] = set()
    verdicts: set[Any] = set()  # ids of the ops requests on nodes the dispatcher refused
    for r in records:
        ev = r.event
        if ev is None:
            continue
        gate.observe(ev, log_position(r))
        if isinstance(ev, events.DeadLetter):
            letters.add(ev.event_id)
        elif isinstance(ev, events.NodeRequestRefused):
            verdicts.add(ev.refused_event_id)
    if not len(gate.keys):
        return ReportCheck(frozenset(), [], 0)
    ignored: set[int] = set()
    findings: list[RequestFinding] = []
    checked = 0
    for i in sorted(range(len(records)), key=lambda i: (records[i].topic, records[i].partition, records[i].offset)):
        r = records[i]
        ev = r.event
        if ev is None or not is_attributed(ev):
            continue
        checked += 1
        why = gate.report_refusal(r.raw, ev, log_position(r))
        if why is None:
            continue
        ignored.add(i)
        if isinstance(ev, NODE_REQUEST_TYPES):
            if ev.event_id not in verdicts:
                findings.append(RequestFinding(i, ev.node_id, f"{why}, and the dispatcher did not refuse it"))
        elif events.dead_letter_id(r.topic, r.partition, r.offset) not in letters:
            subject = getattr(ev, "job_id", None) or getattr(ev, "node_id", None) or ev.type
            findings.append(RequestFinding(i, str(subject), f"{why}, and no service dead-lettered it"))
    return ReportCheck(frozenset(ignored), findings, checked)
