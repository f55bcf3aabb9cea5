"""Where the dashboard's numbers come from: the read models in Redis and the log in Kafka, read-only.

Each read calls the function the CLI prints with ``--json`` (so a page and the command cannot disagree):

=================  ===============================================  ==========================
page               function                                         CLI
=================  ===============================================  ==========================
budget tree        :func:`apportion.cli.main.share_data`            ``apportion share``
queue              :func:`apportion.cli.main.queue_rows`            ``apportion queue``
nodes              :func:`apportion.cli.main.node_rows`             ``apportion nodes``
job timeline       :func:`apportion.audit.explain.explain`          ``apportion audit explain``
share history      ``OccupancySnapshot`` events of ``apportion.usage``  (no command)
=================  ===============================================  ==========================

Log reads (a job's timeline needs the whole log, as ``audit explain`` does) are reused for
``cache_s`` wall seconds so a page and its plot read the log once.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from apportion.settings import Connection, topic_name


class Unavailable(RuntimeError):
    """Redis or Kafka could not be read (the message says which and where)."""


class Sources:
    """The stack's Redis and Kafka, read the CLI's way.

    Args:
        conn: resolved addresses.
        cache_s: wall seconds a log read is reused for.
        redis_client: a ``redis.Redis`` to use (default: one for ``conn.redis_url``).
    """

    def __init__(self, conn: Connection, cache_s: float = 2.0, redis_client: Any = None) -> None:
        import redis

        self.conn = conn
        self.cache_s = cache_s
        from apportion.bus.security import redis_auth

        self.redis = redis_client or redis.Redis.from_url(
            conn.redis_url, socket_connect_timeout=3, **redis_auth(conn.redis_url)
        )
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Any]] = {}
        self._reading: dict[str, threading.Lock] = {}

    def _cli(self, fn: Any, *args: Any) -> Any:
        """Call a CLI data function; its exit (Kafka unreachable, namespace missing) or a Redis error -> Unavailable."""
        import click
        import redis

        try:
            return fn(*args)
        except click.exceptions.Exit as exc:
            raise Unavailable(f"Kafka at {self.conn.bootstrap} cannot be read (exit {exc.exit_code})") from None
        except redis.RedisError as exc:
            raise Unavailable(f"Redis at {self.conn.redis_url} cannot be read: {exc}") from None

    def share(self) -> dict[str, Any]:
        """``apportion share --json``: ``{"meta", "budgets"}``."""
        from apportion.cli.main import share_data

        return self._cli(share_data, self.redis)

    def queue(self) -> list[dict[str, Any]]:
        """``apportion queue --json``: live jobs, running first, pending by position."""
        from apportion.cli.main import queue_rows

        return self._cli(lambda: queue_rows(self.redis))

    def nodes(self) -> list[dict[str, Any]]:
        """``apportion nodes --json``."""
        from apportion.cli.main import node_rows

        return self._cli(node_rows, self.redis, self.conn.bootstrap)

    def _cached(self, key: str, read: Any) -> Any:
        """``read()``, reused for ``cache_s``; one read of ``key`` at a time: requests that come while it runs wait
        for it and take its value, so a burst of page loads (or a job on the machine opening many at once) reads
        the log once, not once each."""
        with self._lock:
            reading = self._reading.setdefault(key, threading.Lock())
        with reading:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None and time.monotonic() - hit[0] < self.cache_s:
                    return hit[1]
            try:
                value = read()
            except Exception as exc:
                if type(exc).__module__.startswith("kafka"):
                    raise Unavailable(f"Kafka at {self.conn.bootstrap} cannot be read: {exc}") from None
                raise
            with self._lock:
                self._cache[key] = (time.monotonic(), value)
            return value

    def log(self) -> list[Any]:
        """The whole log in log order (:func:`apportion.audit.source.load_log`, as ``audit explain`` reads it)."""
        from apportion.audit.source import load_log

        return self._cached("log", lambda: load_log(bootstrap=self.conn.bootstrap))

    def explain(self, job_id: str) -> Any:
        """``apportion audit explain JOB --json``'s :class:`~apportion.audit.explain.Explanation`.

        The dispatcher configuration is the log's ``DispatcherConfigured`` record (defaults without one),
        as the command uses when given no override flags.
        """
        from apportion.audit.config import config_from_log
        from apportion.audit.explain import explain
        from apportion.domain.dispatch import DispatchConfig

        recs = self.log()
        cfg = config_from_log(recs) or DispatchConfig()
        return explain(recs, job_id, cfg, producer=cfg.producer)

    def history(self) -> list[dict[str, Any]]:
        """``apportion history --json``'s rows: every job the log's submissions and job events tell, folded."""
        from apportion.cli.history import fold_jobs

        return [j.to_dict() for j in fold_jobs(r.event for r in self.log() if r.event is not None).values()]

    def snapshots(self) -> list[Any]:
        """Every ``OccupancySnapshot`` of ``apportion.usage``, in log order."""
        from apportion.bus.reader import read_log
        from apportion.events import OccupancySnapshot
        from apportion.topics import USAGE

        recs = self._cached("usage", lambda: read_log(self.conn.bootstrap, [topic_name(USAGE)]))
        return [rec.event for rec in recs if isinstance(rec.event, OccupancySnapshot)]

    def close(self) -> None:
        """Close the Redis connection."""
        self.redis.close()


def load_simulations(paths: list[str]) -> list[dict[str, Any]]:
    """The ``simulate --json`` documents given at start: ``{"name", "doc"}`` or ``{"name", "error"}`` each."""
    out: list[dict[str, Any]] = []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
            if not isinstance(doc, dict) or not isinstance(doc.get("policies"), list):
                raise ValueError("not the output of `apportion simulate --json` (no 'policies' list)")
            out.append({"name": Path(p).name, "doc": doc})
        except (OSError, ValueError) as exc:
            out.append({"name": Path(p).name, "error": str(exc)})
    return out
