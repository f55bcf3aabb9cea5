"""Canonical bytes and signature verification (D10.proven-user): pure, no I/O, no key registry.

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
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import sys
from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

__all__ = ["BATCH_DOMAIN", "BATCH_MAX", "SIGNATURE", "SIG_MEMBER", "b64", "canonical_bytes", "leaf_hash"]
__all__ += ["node_hash", "signer_of", "unb64"]

#: The JSON member that holds the signature (left out of the signed bytes).
SIGNATURE = "signature"


def canonical_bytes(payload: Mapping[str, Any]) -> bytes:
    """The bytes a request's signature covers: ``payload`` without ``signature``, canonical JSON (module docstring).

    Raises:
        ValueError: ``payload`` holds a non-finite number (not JSON).
    """
    body = {k: v for k, v in payload.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str, size: int) -> bytes:
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
        key = _Verifier(unb64(text, 32))
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
        _public(key).verify(unb64(sig, 64), canonical_bytes(obj))
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
SIG_MEMBER = b',"' + SIGNATURE.encode() + b'":"'

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


def leaf_hash(body: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + body).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _appended_signer(raw: bytes) -> str | None:
    """The key that signed ``raw`` in the appended form (single or batch), else ``None`` (not that form, or bad)."""
    if not raw.endswith(b'"}'):
        return None
    pos = raw.rfind(SIG_MEMBER)
    if pos < 0:
        return None
    sig = raw[pos + len(SIG_MEMBER) : -2]
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
            public.verify(unb64(sig.decode("ascii"), 64), body)
            return key
        h = leaf_hash(body)
        if _GOOD.get(h) == key:  # a record of a batch already proven (its leaf was on a verified path)
            return key
        _, i_text, n_text, root_sig, *path = sig.split(b".")
        i, n = int(i_text), int(n_text)
        if not 0 <= i < n <= _BATCH_LIMIT:
            return None
        m, steps, seen = n, iter(path), [h]
        while m > 1:
            if i ^ 1 < m:
                sib = unb64(next(steps).decode("ascii"), 32)
                h = node_hash(h, sib) if i % 2 == 0 else node_hash(sib, h)
                seen += (sib, h)
                if _GOOD.get(h) == key:  # joins a subtree already proven: the rest of the path is known
                    break
            i, m = i // 2, (m + 1) // 2
        else:
            if next(steps, None) is not None:
                return None
            if _ROOTS.get(root_sig) != (key, n, h):
                public.verify(unb64(root_sig.decode("ascii"), 64), BATCH_DOMAIN + b"%d:" % n + h)
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
