"""The accounting read model in Redis (keys and shapes: :mod:`apportion.readmodel`).

``apportion:rm:budgets`` holds one field per budget path and
``apportion:rm:usage`` field ``meta`` holds the snapshot time, window,
capacity and the Kafka offsets processed. Both are replaced in one MULTI/EXEC
transaction, so the CLI never sees budgets of one snapshot with the meta of
another. When given, the service's checkpoint
(:mod:`services.accounting.checkpoint`, key
:func:`apportion.readmodel.checkpoint_key`) is replaced in the same
transaction, so the state a restart resumes from and the offsets it covers
are written together or not at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from apportion import readmodel


class ReadModelStore:
    """Write (and wipe) the accounting read model.

    Args:
        redis: a ``redis.Redis`` client (or a fake with ``pipeline``/``delete``).
    """

    def __init__(self, redis: Any) -> None:
        self.redis = redis

    def write(
        self,
        meta: Mapping[str, Any],
        budgets: Mapping[str, Mapping[str, Any]],
        checkpoint: Mapping[str, bytes] | None = None,
    ) -> None:
        """Replace the budgets hash, the usage meta and (if given) the checkpoint atomically.

        Args:
            meta, budgets: the read model (:func:`services.accounting.logic.read_model`).
            checkpoint: the checkpoint hash fields
                (:func:`services.accounting.checkpoint.encode`); ``None``
                leaves the stored checkpoint as it is.
        """
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(readmodel.budgets_key())
        if budgets:
            pipe.hset(readmodel.budgets_key(), mapping={p: readmodel.dumps(v) for p, v in budgets.items()})
        pipe.hset(readmodel.usage_key(), mapping={"meta": readmodel.dumps(meta)})
        if checkpoint is not None:
            pipe.delete(readmodel.checkpoint_key())
            pipe.hset(readmodel.checkpoint_key(), mapping=dict(checkpoint))
        pipe.execute()

    def wipe(self) -> None:
        """Delete the accounting keys, checkpoint included (``--rebuild``)."""
        self.redis.delete(readmodel.budgets_key(), readmodel.usage_key(), readmodel.checkpoint_key())

    def read_checkpoint(self) -> dict[Any, Any]:
        """The stored checkpoint hash fields (``{}`` when there is none)."""
        return self.redis.hgetall(readmodel.checkpoint_key())

    def read(self) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
        """``(meta, budgets)`` as stored (``meta`` None when absent)."""
        raw = self.redis.hget(readmodel.usage_key(), "meta")
        return (readmodel.loads(raw) if raw else None), readmodel.read_hash(self.redis, readmodel.budgets_key())
