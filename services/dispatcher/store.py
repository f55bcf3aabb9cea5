"""The dispatcher's Redis: the jobs and nodes read models, and the snapshot of its state.

* :func:`write_read_model` - ``apportion:rm:jobs`` and ``apportion:rm:nodes`` replaced whole (what
  ``apportion queue`` / ``nodes`` read), and the queue metrics;
* :func:`load_snapshot` - the stored snapshot (:mod:`services.dispatcher.snapshot`) if it fits the log as
  it is now, else ``None`` (rebuild from offset 0);
* :func:`write_snapshot` - store the state, never over a snapshot of a higher fencing token.

The lease and the fencing token counter are :mod:`services.dispatcher.lease`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from apportion.bus.memory import trim
from services.dispatcher import logic
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.lease import LeadershipLost

log = logging.getLogger("apportion.dispatcher")


def write_read_model(r: Any, svc: Any, metrics: dict) -> None:
    """Replace the jobs and nodes read models with ``svc``'s state now; update the queue metrics."""
    from apportion import readmodel

    jobs, nodes = logic.read_model(svc.state, svc.now_us(), svc.cfg)
    readmodel.replace_hash(r, readmodel.jobs_key(), jobs)
    readmodel.replace_hash(r, readmodel.nodes_key(), nodes)
    metrics["queue"].update(jobs, nodes, svc.state.tree.paths())


def load_snapshot(r: Any, settings: DispatcherSettings, begin: dict[str, int], end: dict[str, int]) -> Any:
    """The stored snapshot if it fits the log (``begin``/``end``: offsets per ``"topic:partition"`` now).

    Returns ``None`` (and logs why) when snapshots are off, none is stored, it does not fit, or Redis cannot
    be read: the log is the state, the caller rebuilds from it.
    """
    from apportion.settings import topic_prefix
    from apportion.statefile import CheckpointError, check_offsets
    from services.dispatcher import snapshot as snapmod

    if settings.snapshot_every_wall_s <= 0:
        return None
    try:
        fields = r.hgetall(snapmod.snapshot_key())
        snap = snapmod.decode(fields, window_s=settings.window_s, topic_prefix=topic_prefix())
        check_offsets(snap.offsets, begin, end)
    except CheckpointError as exc:
        (log.info if exc.reason == "missing" else log.warning)("no usable snapshot (%s): rebuilding from 0", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - Redis down: the log is the state, rebuild from it
        log.warning("cannot read the snapshot (%s): rebuilding from offset 0", exc)
        return None
    return snap


def restore_snapshot(r: Any, settings: DispatcherSettings, svc: Any, consumer: Any, lease: Any) -> Any:
    """Resume ``svc`` from the stored snapshot when it fits the log (:func:`load_snapshot`), and seek
    ``consumer`` to the snapshot's offsets; the snapshot, or ``None`` (rebuild from offset 0). Blocking.

    Raises:
        services.dispatcher.lease.LeadershipLost: a newer leader stored it (its token is above ``lease``'s).
    """
    snap = load_snapshot(r, settings, *consumer.offsets_at_start())
    if snap is None:
        return None
    lease.observe(snap.fencing_token)
    if snap.fencing_token > lease.token:  # a newer leader stored it: we are deposed
        raise LeadershipLost()
    svc.restore(snap)
    consumer.seek(snap.offsets)
    return snap


def write_snapshot(r: Any, svc: Any) -> None:
    """Store ``svc``'s state (its decisions flushed first by the caller); a failure is logged, never raised."""
    import redis as redis_lib

    from apportion.settings import topic_prefix
    from services.dispatcher import snapshot as snapmod

    t0 = time.perf_counter()
    key = snapmod.snapshot_key()
    try:
        fields = snapmod.encode(svc.snapshot(), topic_prefix=topic_prefix())
        size = len(fields["state"])
        with r.pipeline() as pipe:
            pipe.watch(key)
            if not snapmod.newer_than_stored(pipe.hgetall(key), svc.token):
                log.warning("not writing the snapshot: a newer leader's is stored")
                return
            pipe.multi()
            pipe.delete(key)
            pipe.hset(key, mapping=fields)
            pipe.execute()
        del fields
        trim()  # the snapshot's buffers were the largest allocations: give their pages back
    except redis_lib.WatchError:
        log.warning("snapshot not written: written concurrently by another instance")
        return
    except Exception as exc:  # noqa: BLE001 - a snapshot is an optimisation: never stop deciding for it
        log.warning("snapshot not written (%s)", exc)
        return
    log.info(
        "snapshot written: %d bytes, %d jobs, in %.2f s",
        size,
        len(svc.state.jobs),
        time.perf_counter() - t0,
    )
