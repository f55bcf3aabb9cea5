"""The scheduling engine (design D3), one module per role; the entry point is :func:`run_cycle`.

=====================  ==========================================================================
module                 role
=====================  ==========================================================================
``cycle``              :func:`run_cycle`: one cycle on a :class:`CycleSnapshot`
``inputs``             :class:`EngineConfig`, :class:`PendingJob`, :func:`pending_order`
``placement``          free capacity, best fit, spare models (:class:`FreeIndex`, :class:`CycleFree`)
``victims``            victim cost order and candidate indices (:func:`order_key`, :class:`VictimIndex`)
``search``             the least-cost preemption search (:func:`plan_preemption`)
``reservation``        reservation nodes and the holder's earliest fit (:func:`earliest_fit_us`)
``emit``               the events a cycle emits (:func:`preempt_events`, :func:`start_events`, ...)
``reasons``            why a job is still pending after a cycle (:func:`explain_pending`, on request)
``caches``             what the engine keeps across cycles for a caller (:class:`EngineCaches`; speed only)
``shapes``             shape codes (:class:`ShapeTable`, owned by a :class:`CycleMemo`) and bulk skips (speed only)
=====================  ==========================================================================

The rules the engine applies live in :mod:`apportion.domain.preemption`
(candidate rule, backfill rule, provisional charge) and
:mod:`apportion.domain.cluster` (protection window, work lost); they are
re-exported here for the callers that import them from the engine.
"""

from __future__ import annotations

from apportion.domain.engine.caches import EngineCaches
from apportion.domain.engine.cycle import CycleResult, CycleSnapshot, run_cycle
from apportion.domain.engine.emit import (
    emit_placed,
    pending_start_events,
    preempt_events,
    protection_cap_us,
    start_events,
    stop_event,
)
from apportion.domain.engine.inputs import (
    CHECKPOINT_WAIT_S,
    PATIENCE_S,
    POLICY_VERSION,
    EngineConfig,
    PendingJob,
    allocated_count,
    pending_order,
)
from apportion.domain.engine.placement import CycleFree, FreeIndex, spare_models
from apportion.domain.engine.reasons import (
    BudgetAhead,
    BudgetUnknown,
    CheckpointSoon,
    CycleLeft,
    NoFreeGpus,
    NoNodeShape,
    Patience,
    PendingReason,
    ProtectedUntil,
    ReservedBy,
    explain_pending,
    reason_dict,
)
from apportion.domain.engine.reservation import earliest_fit_us, reservation_nodes
from apportion.domain.engine.search import PreemptionRequest, plan_preemption
from apportion.domain.engine.shapes import (
    CycleMemo,
    ShapeTable,
    blocked_run,
    memo_codes,
    segment_floor,
    shape_floor,
)
from apportion.domain.engine.victims import CycleVictims, VictimIndex, order_key, order_lost_gpu_s
from apportion.domain.preemption import (
    RULE_EXPIRED_BEHIND,
    RULE_UNALLOCATED,
    ShareView,
    VictimVerdict,
    backfill_rule,
    branch_rule,
    charge_of,
    victim_rule,
)

__all__ = [
    "BudgetAhead",
    "BudgetUnknown",
    "NoFreeGpus",
    "NoNodeShape",
    "Patience",
    "CheckpointSoon",
    "CycleLeft",
    "PendingReason",
    "ProtectedUntil",
    "ReservedBy",
    "explain_pending",
    "reason_dict",
    "CHECKPOINT_WAIT_S",
    "PATIENCE_S",
    "POLICY_VERSION",
    "RULE_EXPIRED_BEHIND",
    "RULE_UNALLOCATED",
    "CycleFree",
    "CycleMemo",
    "EngineCaches",
    "CycleResult",
    "CycleSnapshot",
    "CycleVictims",
    "EngineConfig",
    "FreeIndex",
    "PendingJob",
    "ShapeTable",
    "ShareView",
    "VictimIndex",
    "VictimVerdict",
    "allocated_count",
    "backfill_rule",
    "blocked_run",
    "branch_rule",
    "charge_of",
    "earliest_fit_us",
    "protection_cap_us",
    "emit_placed",
    "memo_codes",
    "order_key",
    "order_lost_gpu_s",
    "pending_order",
    "PreemptionRequest",
    "plan_preemption",
    "preempt_events",
    "reservation_nodes",
    "run_cycle",
    "segment_floor",
    "shape_floor",
    "spare_models",
    "pending_start_events",
    "start_events",
    "stop_event",
    "victim_rule",
]
