"""Dispatcher snapshot: the folded state with the offsets it covers, so a restart reads only the log's tail.

Pure (no Kafka, Redis or wall clock), built on :mod:`apportion.statefile` like the accounting
checkpoint (:mod:`services.accounting.checkpoint`). :func:`encode` turns a :class:`Snapshot` into the
fields of the Redis hash :func:`snapshot_key`; :func:`decode` turns them back or raises
:class:`~apportion.statefile.CheckpointError`, and the service then rebuilds from offset 0.

Format (``FORMAT`` = 1)::

    header  UTF-8 JSON {format, layout, window_s, topic_prefix, offsets, clock_us,
            fencing_token, jobs, state_bytes, state_blake2b}
    state   pickle (protocol 5) of {"state": DispatchState, "ledger": IdLedger}

* ``offsets`` (``"topic:partition"`` -> next offset folded, every partition the dispatcher reads:
  :attr:`DispatcherService.inputs`) are where the restart resumes; the state holds every record
  below them and the leader's own decisions up to the moment of the snapshot (published and flushed
  before it is written, so the log has them; they come back in the tail as duplicates: the pickled
  id ledger keeps their ids without the process-local payload digests, so they read as duplicates in
  the process that restores it, never as reused ids).
* ``fencing_token``: the writer's token. A write never replaces a snapshot of a higher token (a
  deposed leader that resumes cannot roll the state back; :func:`newer_than_stored`).
* ``layout``: digest of the attribute layout of every class of the state's modules, so a code change
  reads as a version mismatch. Bump ``FORMAT`` when the fold's *rules* change without a layout change.

Size: the state is bounded by the window (``DispatchState.seen`` and ``finished`` forget what is older
than W; the id ledger the ids of the last W to 2 W of event time, at most ``IdLedger.capacity``). Measured in ``bench/bench_restart.py``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from apportion import statefile
from apportion.bus.intake import IdLedger
from apportion.domain.dispatch import DispatchState
from apportion.statefile import CheckpointError, field_of, layout_digest, module_classes, seal, unseal

FORMAT = 1
"""Snapshot format version; a stored snapshot of another version is not used."""

HEADER = "header"
STATE = "state"


def _state_modules() -> tuple[str, ...]:
    """Modules whose classes a snapshot may hold (the engine package with every module of it)."""
    import pkgutil

    from apportion.domain import engine

    base = (
        "apportion.domain.budgets",
        "apportion.domain.cluster",
        "apportion.domain.dispatch",
        "apportion.domain.idle",
        "apportion.domain.engine",
        "apportion.domain.occupancy",
        "apportion.domain.reconcile",
        "apportion.events",
        "apportion.bus.intake",
        "apportion.identity",  # the request gate's key registry (rule D10.proven-user)
    )
    subs = tuple(sorted(f"apportion.domain.engine.{m.name}" for m in pkgutil.iter_modules(engine.__path__)))
    return base + subs


_STATE_MODULES = _state_modules()

__all__ = ["FORMAT", "Snapshot", "snapshot_key", "encode", "decode", "read_header", "newer_than_stored", "layout"]


def snapshot_key() -> str:
    """Key of the dispatcher snapshot hash (``header``, ``state``; with the namespace prefix)."""
    from apportion.settings import topic_prefix

    return f"{topic_prefix()}apportion:ckpt:dispatcher"


@dataclass(frozen=True)
class Snapshot:
    """The dispatcher's state at a set of offsets.

    Attributes:
        state: the fold of every record below ``offsets`` and of the leader's own decisions.
        offsets: ``"topic:partition"`` -> next offset to read, every partition read.
        ledger: the reader edge's id -> payload map (reused ids are caught across a restart).
        fencing_token: the writer's fencing token.
    """

    state: DispatchState
    offsets: dict[str, int]
    ledger: IdLedger | None
    fencing_token: int
    keys: Any = None
    """The request gate's :class:`apportion.identity.KeyRegistry` (``None``: none stored)."""


@functools.cache
def layout() -> str:
    """Digest (16 hex digits) of the attribute layout of every class a snapshot pickles."""
    import importlib

    mods = [importlib.import_module(m) for m in _STATE_MODULES]
    return layout_digest(module_classes(mods), [tuple(DispatchState.__slots__)])


def encode(snap: Snapshot, *, topic_prefix: str) -> dict[str, bytes]:
    """The Redis hash fields of a snapshot: ``{"header": JSON bytes, "state": pickle bytes}``."""
    state, sealed = seal({"state": snap.state, "ledger": snap.ledger, "keys": snap.keys})
    header = {
        "format": FORMAT,
        "layout": layout(),
        "window_s": snap.state.window_us / 1e6,
        "topic_prefix": topic_prefix,
        "offsets": dict(sorted(snap.offsets.items())),
        "clock_us": snap.state.clock_us,
        "fencing_token": snap.fencing_token,
        "jobs": len(snap.state.jobs),
        **sealed,
    }
    return {HEADER: json.dumps(header, sort_keys=True).encode(), STATE: state}


def read_header(fields: Mapping[Any, Any]) -> dict[str, Any]:
    """The decoded JSON header of stored fields (:func:`apportion.statefile.read_header`)."""
    return statefile.read_header(fields, HEADER, "snapshot")


def newer_than_stored(fields: Mapping[Any, Any], token: int) -> bool:
    """True when a snapshot written with ``token`` may replace the stored one (none, unreadable, or token <= ours)."""
    try:
        stored = read_header(fields).get("fencing_token")
    except CheckpointError:
        return True
    return not isinstance(stored, int) or stored <= token


def decode(fields: Mapping[Any, Any], *, window_s: float, topic_prefix: str) -> Snapshot:
    """Decode and check stored fields (offsets not yet checked against the log: :func:`apportion.statefile.check_offsets`).

    Raises:
        CheckpointError: missing, of another format or layout, for another window or namespace, or
            corrupt (checksum, length, unpickling, types).
    """
    h = read_header(fields)
    offsets = statefile.check_header(
        h, fmt=FORMAT, layout=layout(), window_s=window_s, topic_prefix=topic_prefix, abs_tol=1e-6
    )
    token = h.get("fencing_token")
    if not isinstance(token, int):
        raise CheckpointError("corrupt", "no fencing token")
    body = unseal(field_of(fields, STATE), h, _STATE_MODULES)
    state, ledger, keys = (
        (body.get(k) for k in ("state", "ledger", "keys")) if isinstance(body, dict) else (None, None, None)
    )
    if not isinstance(state, DispatchState) or not (ledger is None or isinstance(ledger, IdLedger)):
        raise CheckpointError("corrupt", "state has unexpected types")
    if state.clock_us != h.get("clock_us"):
        raise CheckpointError("corrupt", "state disagrees with its header (clock)")
    return Snapshot(state=state, offsets=offsets, ledger=ledger, fencing_token=token, keys=keys)
