"""Redis read models: what the services keep for the CLI and the audit.

One place names the keys and their JSON shapes, so writers (accounting,
dispatcher) and readers (CLI ``share``/``queue``/``nodes``, ``audit verify``)
cannot drift apart. Every value is a JSON object; hashes are keyed by path,
job id or node id. Writers replace a whole hash in one MULTI/EXEC
transaction so a reader never sees half a snapshot.

=======================  =====  ========================================================
key                      type   field -> value
=======================  =====  ========================================================
``apportion:rm:usage``   hash   ``meta`` -> {at, window_s, capacity_gpus, capacity_gpu_s,
                                offsets, snapshot_id}
``apportion:rm:budgets`` hash   path -> {path, share, abs_share, occupancy_gpu_s,
                                unallocated_gpu_s, entitlement_gpu_s, ratio, rank}
``apportion:rm:jobs``    hash   job_id -> {job_id, budget, user, state, allocated,
                                gpus_per_replica, replicas, min_runtime_s, submitted_at,
                                attempt, reason, nodes, started_at}
``apportion:rm:nodes``   hash   node_id -> {node_id, state, gpu_count, gpu_model,
                                free_gpus, last_heartbeat, running}
=======================  =====  ========================================================

Not a read model but kept beside it: ``apportion:ckpt:accounting``
(:func:`checkpoint_key`), a hash ``header`` -> JSON, ``state`` -> bytes
holding the accounting service's checkpoint (format in
:mod:`services.accounting.checkpoint`). The accounting service writes it in
the same MULTI/EXEC as ``apportion:rm:usage``/``apportion:rm:budgets``.

Keys carry the topic namespace prefix (``APPORTION_TOPIC_PREFIX``) in
front, so namespaces sharing one Redis do not mix. Ratios that are infinite are stored as the string ``"Infinity"`` (JSON has
no inf). Nothing connects at import time: pass a ``redis.Redis`` client in.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

#: A read model that lags the log it folds by more than this many records is shown with a notice (``share``).
STALE_AFTER_RECORDS = 100


def _key(name: str) -> str:
    # the topic namespace (APPORTION_TOPIC_PREFIX) also namespaces the read models
    from apportion.settings import topic_prefix

    return f"{topic_prefix()}apportion:rm:{name}"


def usage_key() -> str:
    """Key of the usage meta hash (with the namespace prefix)."""
    return _key("usage")


def checkpoint_key() -> str:
    """Key of the accounting checkpoint hash (``header``, ``state``; with the namespace prefix)."""
    from apportion.settings import topic_prefix

    return f"{topic_prefix()}apportion:ckpt:accounting"


def budgets_key() -> str:
    """Key of the per-budget hash."""
    return _key("budgets")


def jobs_key() -> str:
    """Key of the per-job hash."""
    return _key("jobs")


def nodes_key() -> str:
    """Key of the per-node hash."""
    return _key("nodes")


def _default(o: Any) -> Any:
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def dumps(value: Mapping[str, Any]) -> str:
    """JSON for a read-model value; +inf becomes ``"Infinity"``."""
    clean = {k: ("Infinity" if isinstance(v, float) and math.isinf(v) else v) for k, v in value.items()}
    return json.dumps(clean, sort_keys=True, default=_default)


def loads(raw: str | bytes) -> dict[str, Any]:
    """Inverse of :func:`dumps` (``"Infinity"`` back to float inf for ratio fields)."""
    d = json.loads(raw)
    for k in ("ratio",):
        if d.get(k) == "Infinity":
            d[k] = math.inf
    return d


def replace_hash(r: Any, key: str, rows: Mapping[str, Mapping[str, Any]]) -> None:
    """Atomically replace hash ``key`` with ``rows`` (field -> JSON object)."""
    pipe = r.pipeline(transaction=True)
    pipe.delete(key)
    if rows:
        pipe.hset(key, mapping={f: dumps(v) for f, v in rows.items()})
    pipe.execute()


def read_hash(r: Any, key: str) -> dict[str, dict[str, Any]]:
    """All fields of hash ``key`` decoded; ``{}`` when missing."""
    raw = r.hgetall(key)
    out = {}
    for f, v in raw.items():
        name = f.decode() if isinstance(f, bytes) else f
        out[name] = loads(v)
    return dict(sorted(out.items()))


def lag_records(folded: Mapping[str, Any], ends: Mapping[str, int]) -> int:
    """Records of the log a read model has not folded yet: for each ``"topic:partition"`` of ``folded`` (the
    next offset it reads, as the usage meta's ``offsets``), the log's end offset ``ends`` minus it (never
    below 0; a partition ``ends`` lacks counts 0)."""
    return sum(max(0, ends.get(k, 0) - int(v)) for k, v in folded.items())


def stale_notice(meta: Mapping[str, Any], ends: Mapping[str, int], after: int = STALE_AFTER_RECORDS) -> str | None:
    """The notice a reader shows when the read model of ``meta`` lags the log (end offsets ``ends``) by more than
    ``after`` records, else ``None``."""
    n = lag_records(meta.get("offsets") or {}, ends)
    if n <= after:
        return None
    return f"stale: the read model (as of {meta.get('at', '?')}) is {n} records behind the log; is its service running?"
