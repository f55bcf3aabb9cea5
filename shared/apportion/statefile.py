"""Sealed state blobs: the pieces shared by the accounting checkpoint and the dispatcher snapshot.

A service that resumes from a stored fold of the log (instead of replaying it from offset 0) stores
the state as a pickle with a JSON header. What both stores need, and what lives only here:

* :func:`class_layout` / :func:`layout_digest`: a digest of the attribute layout of every class the
  pickle may hold (slots, dataclass fields, pydantic fields) and the pydantic version, so a code
  change that would unpickle into a broken object reads as a version mismatch, not a crash;
* :func:`seal` / :func:`unseal`: pickle protocol 5 with its length and 128-bit BLAKE2b checked before
  unpickling, and an unpickler that resolves only the classes (never functions) of the state's own
  modules and a few plain standard types, so a tampered blob cannot name ``os.system``;
* :func:`check_offsets`: whether stored offsets still fit the log (partitions, retention, truncation);
* :class:`CheckpointError`: every reason a stored state cannot be used (the caller rebuilds from 0).

Pure: no Kafka, Redis or clock. The checksum guards against corruption, not against someone who can
write Redis.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import io
import json
import math
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "CheckpointError",
    "class_layout",
    "layout_digest",
    "module_classes",
    "seal",
    "unseal",
    "check_offsets",
    "field_of",
    "read_header",
    "check_header",
]


class CheckpointError(ValueError):
    """A stored state that cannot be used; the caller rebuilds from offset 0.

    Attributes:
        reason: one of ``missing``, ``corrupt``, ``format``, ``layout``,
            ``window``, ``topic_prefix``, ``partitions``,
            ``offsets_before_log_start``, ``offsets_after_log_end``.
        detail: human-readable specifics for the log.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def class_layout(cls: type) -> tuple[str, ...]:
    """The attribute names a pickled instance of ``cls`` carries (pydantic fields, dataclass fields or slots)."""
    if hasattr(cls, "model_fields"):  # pydantic models
        return tuple(sorted(cls.model_fields))
    if dataclasses.is_dataclass(cls):
        return tuple(sorted(f.name for f in dataclasses.fields(cls)))
    slots: list[str] = []
    for k in cls.__mro__:
        s = k.__dict__.get("__slots__", ())
        slots += [s] if isinstance(s, str) else list(s)
    return tuple(sorted(slots))


def module_classes(modules: Iterable[Any]) -> list[type]:
    """Every class defined in ``modules`` (module objects), sorted by module and name."""
    out = []
    for mod in modules:
        for _, c in inspect.getmembers(mod, inspect.isclass):
            if c.__module__ == mod.__name__:
                out.append(c)
    return sorted(out, key=lambda c: (c.__module__, c.__qualname__))


def layout_digest(classes: Iterable[type], extra: Iterable[Any] = ()) -> str:
    """Digest (16 hex digits) of the layout of ``classes``, ``extra`` values and the pydantic version."""
    import pydantic

    desc = repr([(c.__module__, c.__qualname__, class_layout(c)) for c in classes] + list(extra) + [pydantic.VERSION])
    return hashlib.blake2b(desc.encode(), digest_size=8).hexdigest()


_SAFE_BUILTINS = frozenset(
    {
        "set",
        "frozenset",
        "dict",
        "list",
        "tuple",
        "int",
        "float",
        "str",
        "bytes",
        "bool",
        "complex",
        "object",
        "slice",
        "range",
        "bytearray",
    }
)
_SAFE_GLOBALS = frozenset(
    {
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
        ("datetime", "date"),
        ("uuid", "UUID"),
        ("uuid", "SafeUUID"),
        ("copyreg", "_reconstructor"),
        ("collections", "OrderedDict"),
    }
)


class _Unpickler(pickle.Unpickler):
    """Resolve only classes of ``modules`` (never functions) and a few plain standard types."""

    def __init__(self, data: bytes, modules: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data))
        self._modules = modules

    def find_class(self, module: str, name: str) -> Any:
        if (module == "builtins" and name in _SAFE_BUILTINS) or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module in self._modules:
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a checkpoint")


def seal(obj: Any) -> tuple[bytes, dict[str, Any]]:
    """``(pickle bytes, header fields)``: the header fields are ``state_bytes`` and ``state_blake2b``."""
    data = pickle.dumps(obj, protocol=5)
    return data, {"state_bytes": len(data), "state_blake2b": hashlib.blake2b(data, digest_size=16).hexdigest()}


def unseal(data: Any, header: Mapping[str, Any], modules: Iterable[str]) -> Any:
    """The object of :func:`seal`'s bytes, after checking them against ``header``.

    Args:
        data: the pickle bytes (``bytes``-like), or ``None`` when missing.
        header: holds ``state_bytes`` and ``state_blake2b`` as :func:`seal` made them.
        modules: names of the modules whose classes the state may hold.

    Raises:
        CheckpointError: ``corrupt`` (missing, length or checksum mismatch, does not unpickle).
    """
    if data is None:
        raise CheckpointError("corrupt", "header without state")
    data = bytes(data) if not isinstance(data, bytes) else data
    if len(data) != header.get("state_bytes") or hashlib.blake2b(data, digest_size=16).hexdigest() != header.get(
        "state_blake2b"
    ):
        raise CheckpointError("corrupt", f"state checksum mismatch ({len(data)} bytes)")
    try:
        return _Unpickler(data, frozenset(modules)).load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a corrupt checkpoint, never a crash
        raise CheckpointError("corrupt", f"state does not unpickle ({type(exc).__name__}: {exc})") from None


def check_offsets(offsets: Mapping[str, int], begin: Mapping[str, int], end: Mapping[str, int]) -> None:
    """Check that stored offsets can resume on the log as it is now.

    Args:
        offsets: the stored ``"topic:partition"`` -> next offset.
        begin: each assigned partition's log start offset now.
        end: each assigned partition's end offset now.

    Raises:
        CheckpointError: ``partitions`` (a partition read now is missing from
            the stored offsets, or they name one not read now),
            ``offsets_before_log_start`` (records after them were deleted),
            ``offsets_after_log_end`` (the topic was recreated or truncated).
    """
    if set(offsets) != set(begin):
        missing, extra = sorted(set(begin) - set(offsets)), sorted(set(offsets) - set(begin))
        raise CheckpointError("partitions", f"missing {missing}, unknown {extra}")
    for p in sorted(offsets):
        if offsets[p] < begin[p]:
            raise CheckpointError("offsets_before_log_start", f"{p}: checkpoint {offsets[p]} < log start {begin[p]}")
        if offsets[p] > end[p]:
            raise CheckpointError("offsets_after_log_end", f"{p}: checkpoint {offsets[p]} > log end {end[p]}")


def field_of(fields: Mapping[Any, Any], name: str) -> Any:
    """``fields[name]`` with keys ``str`` or ``bytes`` (a Redis ``hgetall``); ``None`` when absent."""
    v = fields.get(name)
    return fields.get(name.encode()) if v is None else v


def read_header(fields: Mapping[Any, Any], name: str = "header", what: str = "checkpoint") -> dict[str, Any]:
    """The decoded JSON header ``fields[name]`` (keys may be ``bytes`` or ``str``).

    Raises:
        CheckpointError: ``missing`` (no header: "no <what> stored") or ``corrupt`` (not a JSON object).
    """
    raw = field_of(fields, name)
    if raw is None:
        raise CheckpointError("missing", f"no {what} stored")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError("corrupt", f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError("corrupt", "header is not a JSON object")
    return header


def check_header(
    h: Mapping[str, Any], *, fmt: int, layout: str, window_s: float, topic_prefix: str, abs_tol: float = 1e-9
) -> dict[str, int]:
    """Check a header's ``format``, ``layout``, ``window_s``, ``topic_prefix`` and ``offsets``; return the offsets.

    Raises:
        CheckpointError: ``format``, ``layout``, ``window``, ``topic_prefix``, or ``corrupt`` (offsets not a
            map of ``"topic:partition"`` -> offset >= 0).
    """
    if h.get("format") != fmt:
        raise CheckpointError("format", f"stored format {h.get('format')!r}, this code reads {fmt}")
    if h.get("layout") != layout:
        raise CheckpointError("layout", f"stored class layout {h.get('layout')!r}, this code has {layout}")
    w = h.get("window_s")
    if not isinstance(w, (int, float)) or not math.isclose(w, window_s, rel_tol=0, abs_tol=abs_tol):
        raise CheckpointError("window", f"stored for W={w!r} s, running with W={window_s} s")
    if h.get("topic_prefix") != topic_prefix:
        raise CheckpointError("topic_prefix", f"stored for {h.get('topic_prefix')!r}, reading {topic_prefix!r}")
    offsets = h.get("offsets")
    if not isinstance(offsets, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in offsets.items()
    ):
        raise CheckpointError("corrupt", "offsets are not a map of partition -> offset")
    return dict(offsets)
