"""Accounting checkpoint: the folded state with the offsets it covers, in one versioned blob.

Pure (no Kafka, Redis or wall clock): :func:`encode` turns a
:class:`Checkpoint` into the two fields of the Redis hash
:func:`apportion.readmodel.checkpoint_key`, :func:`decode` turns them back
or raises :class:`CheckpointError` with a short machine-readable reason, and
:func:`check_offsets` says whether the offsets still fit the log. The
service (:mod:`services.accounting.app`) writes the hash in the same
MULTI/EXEC as the read model and, on start, falls back to a rebuild from
offset 0 on any :class:`CheckpointError`.

Format (``FORMAT`` = 3; 2 was written while a requeue did not end a refused start's run, 1 while the ledger
clamped late records)::

    header  UTF-8 JSON {format, layout, window_s, topic_prefix, offsets,
            clock_us, snapshot_at, last_key, late_events, state_bytes,
            state_blake2b}
    state   pickle (protocol 5) of {"acc": logic.Accounting,
            "last": OccupancySnapshot | None, "dirty": bool,
            "ids": apportion.bus.intake.IdLedger | None}

* ``ids`` is the reader edge's de-duplication ledger (event ids of the last
  W to 2 W, without their per-process payload digests), so a resumed service
  drops a record re-delivered after the checkpoint as the process that wrote
  it did (before, a resume started with an empty ledger and folded it again).

* ``offsets`` (``"topic:partition"`` -> next offset to read, every assigned
  partition) are the source of truth for where to resume: they are stored
  *with* the state they produced. The Kafka group offsets are committed
  right after the Redis transaction and equal them, except after a crash
  between the two writes; a start never reads the group offsets.
* ``layout`` is a digest of the attribute layout of every class the pickle
  holds (the ledger's ``__slots__``, the event models' fields, ..., and the
  pydantic version, whose pickled form the event models use), so a
  code change that would unpickle into a broken object reads as a version
  mismatch, not as a crash. Bump ``FORMAT`` when the fold *rules* change
  without a layout change (e.g. a new clamping rule): an old state would
  load but no longer equal a rebuild.
* ``state_blake2b`` (128-bit) and ``state_bytes`` are checked before
  unpickling; the unpickler only resolves *classes* of the state's modules
  (``apportion.domain.budgets``, ``apportion.domain.occupancy``,
  ``apportion.events``, ``services.accounting.logic``) and a few standard
  types (sets, datetimes, UUIDs), so a tampered blob cannot name
  ``os.system`` or any function. The checksum guards
  against corruption, not against someone who can write Redis (who could
  also rewrite the read model).
* ``last_key`` is the merge key (event µs, topic, partition, offset) of the
  newest state-changing record folded and ``late_events`` how many such
  records had an event time older than one folded before them (each takes
  effect at its own time, see :mod:`apportion.domain.occupancy`, so the state
  equals a bulk rebuild of the records below ``offsets`` either way; the
  count says only how records arrived).

Size: the state is bounded by the window W (the ledger expires older
breakpoints, ended runs and seen ids). Measured: a week of 100,000 job
events (1,000 nodes, 200 budgets) is 2.3 MB and 0.2 s to encode; 1,000,000
events about ten times that, which is why the service checkpoints at most
every ``checkpoint_interval_wall_s`` rather than on every read-model write.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from apportion import statefile
from apportion.bus.intake import IdLedger
from apportion.events import OccupancySnapshot
from apportion.statefile import CheckpointError, check_offsets, field_of, layout_digest, seal, unseal
from services.accounting import logic

__all__ = ["FORMAT", "Checkpoint", "CheckpointError", "check_offsets", "decode", "encode", "layout", "read_header"]

FORMAT = 3
"""Checkpoint format version; a stored checkpoint of another version is not used."""

HEADER = "header"
STATE = "state"

#: Merge key of a record: (event time µs, topic, partition, offset).
RecordKey = tuple[int, str, int, int]


@dataclass(frozen=True)
class Checkpoint:
    """The accounting service's state at a set of offsets.

    Attributes:
        acc: the projection (ledger, budget log, tree) folded from every
            record below ``offsets``.
        last: the last published snapshot (periodic snapshots continue its
            grid; ``None`` before any).
        dirty: folded changes not yet published in a snapshot.
        offsets: ``"topic:partition"`` -> next offset to read, for every
            partition the service reads.
        last_key: merge key of the newest state-changing record folded.
        late_events: state-changing records folded with an event time older
            than one folded before them (folded at their own time all the same).
        ids: the reader edge's id ledger (:class:`apportion.bus.intake.IdLedger`); ``None``: not kept.
    """

    acc: logic.Accounting
    last: OccupancySnapshot | None
    dirty: bool
    offsets: dict[str, int]
    last_key: RecordKey | None = None
    late_events: int = 0
    ids: IdLedger | None = None


@functools.cache
def layout() -> str:
    """Digest (16 hex digits) of the attribute layout of every class a checkpoint pickles."""
    from apportion import events
    from apportion.domain import budgets, occupancy, user_usage
    from apportion.identity import registry

    classes: list[type] = [
        occupancy.OccupancyLedger,
        occupancy._Series,
        occupancy._Run,
        occupancy._Node,
        user_usage.UserUsageFold,
        budgets.BudgetTree,
        budgets.Budget,
        events.BudgetSet,
        events.BudgetRemoved,
        events.BudgetBatch,
        events.BudgetSpec,
        events.BudgetRejected,
        events.BudgetFailure,
        events.OccupancySnapshot,
        events.BudgetUsage,
        registry.KeyRegistry,  # the node keys (rule D10.authentication)
        registry._Grant,
        registry._Revocation,
        IdLedger,  # the reader edge's de-duplication ids
    ]
    acc_attrs = tuple(sorted(vars(logic.Accounting(1.0))))
    # the event models' pickled form is pydantic's: an upgrade of it reads as a layout change
    return layout_digest(classes, [acc_attrs])


_STATE_MODULES = frozenset(
    {
        "apportion.bus.intake",
        "apportion.domain.budgets",
        "apportion.domain.occupancy",
        "apportion.domain.user_usage",
        "apportion.events",
        "apportion.identity.registry",
        "services.accounting.logic",
    }
)


def encode(ckpt: Checkpoint, *, topic_prefix: str) -> dict[str, bytes]:
    """The Redis hash fields of a checkpoint.

    Args:
        ckpt: the state to store.
        topic_prefix: the topic namespace the offsets refer to.

    Returns:
        ``{"header": JSON bytes, "state": pickle bytes}``.
    """
    state, sealed = seal({"acc": ckpt.acc, "last": ckpt.last, "dirty": ckpt.dirty, "ids": ckpt.ids})
    header = {
        "format": FORMAT,
        "layout": layout(),
        "window_s": ckpt.acc.window_s,
        "topic_prefix": topic_prefix,
        "offsets": dict(sorted(ckpt.offsets.items())),
        "clock_us": ckpt.acc.clock_us,
        "snapshot_at": ckpt.last.at.isoformat() if ckpt.last is not None else None,
        "last_key": list(ckpt.last_key) if ckpt.last_key is not None else None,
        "late_events": ckpt.late_events,
        **sealed,
    }
    return {HEADER: json.dumps(header, sort_keys=True).encode(), STATE: state}


def read_header(fields: Mapping[Any, Any]) -> dict[str, Any]:
    """The decoded JSON header of stored fields (:func:`apportion.statefile.read_header`)."""
    return statefile.read_header(fields, HEADER, "checkpoint")


def decode(fields: Mapping[Any, Any], *, window_s: float, topic_prefix: str) -> Checkpoint:
    """Decode and check stored fields.

    Args:
        fields: the Redis hash (``hgetall``); keys ``bytes`` or ``str``.
        window_s: the window W the service runs with (seconds).
        topic_prefix: the topic namespace the service reads.

    Returns:
        The checkpoint (offsets not yet checked against the log: see :func:`check_offsets`).

    Raises:
        CheckpointError: missing, of another format or layout, for another
            window or namespace, or corrupt (checksum, length, unpickling,
            types).
    """
    h = read_header(fields)
    offsets = statefile.check_header(
        h, fmt=FORMAT, layout=layout(), window_s=window_s, topic_prefix=topic_prefix, abs_tol=1e-9
    )
    body = unseal(field_of(fields, STATE), h, _STATE_MODULES)
    keys = ("acc", "last", "dirty", "ids")
    acc, last, dirty, ids = (body.get(k) for k in keys) if isinstance(body, dict) else (None,) * 4
    if (
        not isinstance(acc, logic.Accounting)
        or not (last is None or isinstance(last, OccupancySnapshot))
        or not isinstance(dirty, bool)
        or not (ids is None or isinstance(ids, IdLedger))
    ):
        raise CheckpointError("corrupt", "state has unexpected types")
    if acc.window_s != window_s or acc.clock_us != h.get("clock_us"):
        raise CheckpointError("corrupt", "state disagrees with its header (window or clock)")
    key = h.get("last_key")
    last_key: Any = tuple(key) if isinstance(key, list) and len(key) == 4 else None
    late = h.get("late_events", 0)
    return Checkpoint(
        acc=acc,
        last=last,
        dirty=dirty,
        offsets=offsets,
        last_key=last_key,
        late_events=late if isinstance(late, int) else 0,
        ids=ids,
    )
