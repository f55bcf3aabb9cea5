"""Admission: may a submitted job ever enter the queue? (DESIGN section 2).

:func:`admit` checks a ``JobSubmitted`` against the budget tree and the
declared node shapes and returns ``None`` (admitted) or a
:class:`Rejection` carrying a machine-readable :class:`RejectReason` and a
message for humans; :func:`rejected_event` turns it into the ``JobRejected``
fact. Pure: no I/O, no clock.

Checks, first failure wins, in this order:

1. ``unknown_budget``: the budget path is not in the tree;
2. ``not_a_leaf``: the budget has children (jobs charge leaves, so the
   fair-share order of leaves decides who runs);
3. ``zero_share`` (allocated jobs only): the absolute share is 0, so the
   job could only ever be charged against no entitlement;
4. ``not_a_member`` (allocated jobs only): the budget's effective members
   (inherited from the nearest ancestor that sets them; ``None`` = anyone)
   exclude the user;
5. ``min_runtime_above_limit`` (allocated jobs only): ``min_runtime_s`` is
   above the effective ``max_min_runtime_s`` (inherited; ``None`` = no limit);
6. ``shape_impossible``: fewer than ``replicas`` declared nodes have at least
   ``gpus_per_replica`` GPUs of the requested model (any model when the job
   names none; a node of unknown model never matches a named model).
   Skipped while no node has registered at all (cold start): an empty
   inventory cannot judge a shape, so the job is queued and waits.

Unallocated jobs (``min_runtime_s == 0``) are free and never charged, so
checks 3-5 do not apply: they may name any existing leaf, even one the user
is not a member of. Shape applies to every job: a gang that no inventory can
hold would wait forever.

Before any of these, the dispatcher asks :func:`authorize` whether a request
(``JobSubmitted`` or ``JobCancelRequested``) comes from the user it names
(DESIGN section 10): ``unauthenticated`` when no registered key of that user
signed it, ``not_owner`` for a cancel of another user's job by a principal
that is not ops. The signature itself is checked by :mod:`apportion.identity`
(crypto is not domain code); this module gets the principal that signed.

Node reports (DESIGN section 10: "a node agent may report only for the nodes
it registered") have their own rule, :func:`authorize_report`, applied by the
dispatcher's and the accounting's reader edge and by ``audit verify`` alike:
a report (:data:`REPORT_TYPES`) counts only when it is signed by a key
registered for the principal ``node:<node_id>`` of the node it names
(:func:`node_principal`); otherwise it is ignored with the reason
``unauthenticated_node``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import NamedTuple

from apportion.domain.budgets import BudgetTree
from apportion.events import (
    Event,
    JobCancelRequested,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobLost,
    JobRejected,
    JobStarted,
    JobSubmitted,
    NodeHeartbeat,
    NodeRegistered,
    RejectReason,
    WorkloadRefused,
    det_id,
)

__all__ = [
    "NodeShape",
    "Principal",
    "Rejection",
    "ShapeLike",
    "NODE_PREFIX",
    "REPORT_TYPES",
    "UNAUTHENTICATED_NODE",
    "admit",
    "authorize",
    "authorize_report",
    "is_node_report",
    "node_principal",
    "refused_request_event",
    "rejected_event",
    "shape_possible",
]

#: The role of a principal that may cancel any job (a key registered with ``role="ops"``).
OPS = "ops"

#: Principal names of node agents: ``node:<node_id>`` (a key registered for one proves reports of that node).
NODE_PREFIX = "node:"

#: What a node agent writes for its node (``services/node_agent/logic``): each must be signed by the node's key.
REPORT_TYPES = (
    NodeRegistered,
    NodeHeartbeat,
    JobStarted,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobLost,
    WorkloadRefused,
)

#: Report types the dispatcher writes too (a gang's ``JobFailed``, a lost node's ``JobLost``), unsigned.
_DISPATCHER_WRITES = (JobFailed, JobLost)

#: Reason (dead-letter prefix) of a node report that is not proven by its node's key.
UNAUTHENTICATED_NODE = "unauthenticated_node"


class Principal(NamedTuple):
    """Who signed a request: the ``user`` a registered key proves, and that key's ``role`` (``user``/``ops``)."""

    user: str
    role: str = "user"


class NodeShape(NamedTuple):
    """``nodes`` nodes of ``gpus`` GPUs of ``model`` each (``model=None``: unknown)."""

    gpus: int
    model: str | None = None
    nodes: int = 1


ShapeLike = NodeShape | tuple[int, str | None] | tuple[int, str | None, int]
"""A :class:`NodeShape` or a plain ``(gpus, model[, nodes])`` tuple."""


class Rejection(NamedTuple):
    """Why a job is refused: ``reason`` for machines, ``message`` for humans."""

    reason: RejectReason
    message: str


def shape_possible(
    gpus_per_replica: int, replicas: int, gpu_model: str | None, node_shapes: Iterable[ShapeLike]
) -> tuple[bool, int]:
    """Can some ``replicas`` distinct nodes each give ``gpus_per_replica`` GPUs of the model?

    Args:
        gpus_per_replica: g >= 1.
        replicas: k >= 1.
        gpu_model: required model, or ``None`` for any.
        node_shapes: the declared inventory, one :class:`NodeShape` (or a
            plain ``(gpus, model[, count])`` tuple) per node or group of nodes.

    Returns:
        ``(possible, fitting)``: whether at least k nodes fit, and how many do.
    """
    fitting = 0
    for shape in node_shapes:
        ns = shape if isinstance(shape, NodeShape) else NodeShape(*shape)
        if ns.gpus >= gpus_per_replica and (gpu_model is None or ns.model == gpu_model):
            fitting += ns.nodes
    return fitting >= replicas, fitting


def admit(tree: BudgetTree, job: JobSubmitted, node_shapes: Iterable[ShapeLike]) -> Rejection | None:
    """Check a submission against the tree and node shapes (DESIGN section 2).

    Args:
        tree: the budget tree in force at the submission's event time.
        job: the submission.
        node_shapes: the declared inventory (see :func:`shape_possible`).

    Returns:
        ``None`` when the job may be queued, else the first failing check as
        a :class:`Rejection` (order in the module docstring).
    """
    path = job.budget
    if path not in tree:
        return Rejection(RejectReason.UNKNOWN_BUDGET, f"budget {path!r} does not exist")
    if not tree.is_leaf(path):
        kids = ", ".join(tree.children(path))
        return Rejection(RejectReason.NOT_A_LEAF, f"budget {path!r} has children ({kids}); submit to a leaf budget")
    if job.allocated:
        if tree.abs_share(path) <= 0.0:
            return Rejection(
                RejectReason.ZERO_SHARE,
                f"budget {path!r} has absolute share 0; an allocated job (min_runtime_s > 0) cannot be charged to it",
            )
        members = tree.members(path)
        if members is not None and job.user not in members:
            return Rejection(RejectReason.NOT_A_MEMBER, f"user {job.user!r} is not a member of budget {path!r}")
        limit = tree.max_min_runtime_s(path)
        if limit is not None and job.min_runtime_s > limit:
            return Rejection(
                RejectReason.MIN_RUNTIME_TOO_LONG,
                f"min_runtime_s {job.min_runtime_s:g} is above the limit {limit:g} s of budget {path!r}",
            )
    shapes = list(node_shapes)
    # An empty inventory (cold start: no node has registered yet) says nothing about what fits;
    # the job is queued and waits for nodes rather than being refused for good.
    ok, fitting = shape_possible(job.gpus_per_replica, job.replicas, job.gpu_model, shapes)
    if shapes and not ok:
        model = f" {job.gpu_model}" if job.gpu_model else ""
        return Rejection(
            RejectReason.SHAPE_IMPOSSIBLE,
            f"needs {job.replicas} node(s) with >= {job.gpus_per_replica}{model} "
            f"GPUs each; the declared nodes have {fitting} such node(s)",
        )
    return None


def authorize(
    request: JobSubmitted | JobCancelRequested, signer: Principal | None, owner: str | None = None
) -> Rejection | None:
    """May this request act in the name of its ``user`` (DESIGN section 10)?

    Args:
        request: a submission or a cancel request.
        signer: the principal whose registered, unrevoked key made a valid
            signature of the request at its event time
            (:meth:`apportion.identity.KeyRegistry.principal`), or ``None``
            when there is none (unsigned, a bad signature, an unknown or
            revoked key).
        owner: for a cancel, the user of the job it names (``None`` when the
            dispatcher knows no such job: there is nothing to protect).

    Returns:
        ``None`` when allowed; else ``unauthenticated`` (no signer, or the
        signer is another user than ``request.user``; ops sign as themselves
        too) or ``not_owner`` (a cancel of another user's job by a principal
        whose role is not ``ops``).
    """
    if signer is None:
        return Rejection(
            RejectReason.UNAUTHENTICATED,
            f"no valid signature by a key registered for user {request.user!r} at {request.ts.isoformat()}",
        )
    if signer.user.startswith(NODE_PREFIX):
        return Rejection(
            RejectReason.UNAUTHENTICATED, f"{signer.user!r} is a node's key: it signs reports, not requests"
        )
    if signer.user != request.user:
        return Rejection(
            RejectReason.UNAUTHENTICATED,
            f"signed with a key of {signer.user!r}, not of the user {request.user!r} the request names",
        )
    if isinstance(request, JobCancelRequested) and owner is not None and owner != signer.user and signer.role != OPS:
        return Rejection(
            RejectReason.NOT_OWNER,
            f"job {request.job_id!r} belongs to {owner!r}; {signer.user!r} may cancel only their own jobs",
        )
    return None


def node_principal(node_id: str) -> str:
    """The principal whose registered key proves the reports of ``node_id``: ``node:<node_id>``."""
    return NODE_PREFIX + node_id


def is_node_report(event: Event, dispatcher: str = "dispatcher") -> bool:
    """Must ``event`` be proven by a node's key? True for every :data:`REPORT_TYPES` event of a node agent.

    The dispatcher writes ``JobFailed`` (a gang replica failed) and ``JobLost``
    (its node was lost) itself, unsigned, with ``producer`` = its producer
    name: those are its decisions, not node reports (see docs/security.md,
    "Known limits").

    Args:
        event: a decoded event.
        dispatcher: the dispatcher's ``producer`` name.
    """
    if not isinstance(event, REPORT_TYPES):
        return False
    return not (isinstance(event, _DISPATCHER_WRITES) and event.producer == dispatcher)


def authorize_report(event: Event, signer: Principal | None, dispatcher: str = "dispatcher") -> str | None:
    """May this node report change anything (DESIGN section 10: an agent reports only for its own nodes)?

    Args:
        event: a decoded event (anything that is not a node report passes,
            :func:`is_node_report`).
        signer: the principal whose registered, unrevoked key made a valid
            signature of the record (:meth:`apportion.identity.KeyRegistry.principal`),
            or ``None`` (unsigned, a bad signature, an unknown or revoked key).
        dispatcher: the dispatcher's ``producer`` name.

    Returns:
        ``None`` when it counts; else the reason to ignore it, starting with
        :data:`UNAUTHENTICATED_NODE`: no signer, a report that names no node,
        or a signer other than ``node:<the report's node_id>``.
    """
    if not is_node_report(event, dispatcher):
        return None
    node = getattr(event, "node_id", None)
    if node is None:
        return f"{UNAUTHENTICATED_NODE}: {event.type} names no node, so no node's key can prove it"
    if signer is None:
        return f"{UNAUTHENTICATED_NODE}: {event.type} of node {node!r} is not signed by a key registered for it"
    if signer.user != node_principal(node):
        return f"{UNAUTHENTICATED_NODE}: {event.type} of node {node!r} is signed by the key of {signer.user!r}"
    return None


def refused_request_event(
    request: JobSubmitted | JobCancelRequested,
    rejection: Rejection,
    *,
    budget: str,
    ts: datetime,
    producer: str = "dispatcher",
) -> JobRejected:
    """The ``JobRejected`` of a refused request (id deterministic in the request's id).

    Args:
        request: the refused submission or cancel request.
        rejection: what :func:`authorize` returned.
        budget: the submission's budget, or the cancelled job's (``""`` when unknown).
        ts: event time of the decision (aware UTC).
        producer: writer name.
    """
    return JobRejected(
        event_id=det_id("JobRejected", request.job_id, request.event_id),
        job_id=request.job_id,
        budget=budget,
        user=request.user,
        reason=rejection.reason,
        message=rejection.message,
        request=request.type,
        refused_event_id=request.event_id,
        ts=ts,
        producer=producer,
    )


def rejected_event(
    job: JobSubmitted, rejection: Rejection, *, ts: datetime, producer: str = "dispatcher"
) -> JobRejected:
    """The ``JobRejected`` fact for ``rejection``; its id is deterministic in the submission.

    Args:
        job: the refused submission.
        rejection: what :func:`admit` returned.
        ts: event time of the decision (aware UTC).
        producer: writer name.
    """
    return JobRejected(
        event_id=det_id("JobRejected", job.job_id, job.event_id),
        job_id=job.job_id,
        budget=job.budget,
        user=job.user,
        reason=rejection.reason,
        message=rejection.message,
        ts=ts,
        producer=producer,
    )
