"""Admission: may a submitted job ever enter the queue? (rule D2.rejection).

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
   above the effective ``max_min_runtime_s`` (inherited; 0: the budget takes
   only unallocated work, and the message says so), or, where no budget
   sets one, above the occupancy window W: a minimum runtime is protection
   from preemption, and protection longer than the window that measures
   fairness would let one job hold GPUs past every fair-share correction
   (rules D1.allocated-job, D2.rejection and D3.bounded-churn; grown protection is capped by W as well);
6. ``time_limit_above_max``: the job's time limit in force (its ``time_limit_s``,
   else its budget's inherited ``default_time_limit_s``: :func:`time_limit_in_force`)
   is above its budget's inherited ``max_time_limit_s``;
7. ``shape_impossible``: fewer than ``replicas`` declared nodes have at least
   ``gpus_per_replica`` GPUs of the requested model (any model when the job
   names none; a node of unknown model never matches a named model).
   Skipped while no node has registered at all (cold start): an empty
   inventory cannot judge a shape, so the job is queued and waits;
8. ``unsatisfiable_topology``: a gang (``replicas`` > 1) with a
   ``topology_bound`` (rule D1.topology) that no single block (rack) of the
   declared nodes can hold: fewer than ``replicas`` of the nodes that fit its
   shape share one block (one rack; a rack is named within its block). A node
   without a block label is a block and a rack of its own, as placement
   treats it. Skipped on an empty inventory, as check 7.

The declared inventory of checks 7 and 8 is the nodes registered and not
lost at the submission's event time (ready, cordoned or draining: a
cordoned node is expected back), with their labels as registered. A verdict
is final: a job refused because its block or rack is not there yet is not
reconsidered when more nodes register later (its user submits it again); a
job admitted whose nodes are lost later waits in the queue, its pending
reason saying why, until nodes return.

Unallocated jobs (``min_runtime_s == 0``) are free and never charged, so
checks 3-5 do not apply: they may name any existing leaf, even one the user
is not a member of. Shape applies to every job: a gang that no inventory can
hold would wait forever.

Before any of these, the dispatcher asks :func:`authorize` whether a request
(:data:`JOB_REQUESTS`: a submission, a cancel, a hold or a release) comes from the user it names
(rule D10.proven-user): ``unauthenticated`` when no registered key of that user
signed it, ``not_owner`` for a cancel, hold or release of another user's job by a principal
that is not ops. The signature itself is checked by :mod:`apportion.identity`
(crypto is not domain code); this module gets the principal that signed.
Ops' requests on a node (:data:`NODE_REQUEST_TYPES`: cordon, drain,
uncordon) must be signed by a key registered with role ``ops``, or, for a
cordon only, by the dispatcher's (:func:`authorize_node_request`); the dispatcher answers any other with
``NodeRequestRefused`` reason ``unauthenticated``
(:func:`refused_node_request_event`) and folds nothing of it.

Everything else a reader folds from ``apportion.jobs`` and ``apportion.nodes``
must be attributable to its writer (rule D10.authentication: "only node agents
write node reports and workload outcomes; only the dispatcher writes decisions
and commands"), by one rule, :func:`authorize_report`, applied by the
dispatcher's and the accounting's reader edge and by ``audit verify`` alike:

* an ops request on a node (:data:`NODE_REQUEST_TYPES`) counts only when
  :func:`authorize_node_request` allows its signer; otherwise it is ignored
  with the reason ``unauthenticated``;
* a decision or command (:data:`DISPATCHER_TYPES`) counts only when it is signed
  by a key registered for the principal :data:`DISPATCHER`
  (``service:dispatcher``); otherwise it is ignored with the reason
  ``unauthenticated``;
* a node report (:data:`REPORT_TYPES`) counts only when it is signed by a key
  registered for the principal ``node:<node_id>`` of the node it names
  (:func:`node_principal`) and, for a report of a run (:data:`RUN_REPORT_TYPES`),
  that node holds the run: it is the node of the reported replica in the
  run's ``JobPlaced`` (any of its nodes when no replica is named); otherwise
  it is ignored with the reason ``unauthenticated_node``. ``JobFailed`` and
  ``JobLost`` are also the dispatcher's (a gang replica failed, a node was
  lost): signed by :data:`DISPATCHER`, they count as its decisions.

Who signed is decided by the signature alone, never by the ``producer`` a
record claims.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import NamedTuple

from apportion.domain.budgets import BudgetTree
from apportion.durations import format_duration
from apportion.events import (
    DispatcherConfigured,
    Event,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobHeld,
    JobHoldRequested,
    JobLost,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobReleased,
    JobReleaseRequested,
    JobRequeued,
    JobStarted,
    JobSubmitted,
    NodeCordoned,
    NodeDrained,
    NodeDrainRequested,
    NodeHeartbeat,
    NodeLost,
    NodeRegistered,
    NodeRequestRefused,
    NodeUncordoned,
    RejectReason,
    StartWorkload,
    StopWorkload,
    WorkloadRefused,
    det_id,
)
from apportion.timeutil import WEEK_S

__all__ = [
    "NodeShape",
    "Principal",
    "Rejection",
    "ShapeLike",
    "DISPATCHER_TYPES",
    "DISPATCHER",
    "NODE_PREFIX",
    "NODE_REQUEST_TYPES",
    "JOB_REQUESTS",
    "OWNER_REQUESTS",
    "REPORT_TYPES",
    "RUN_REPORT_TYPES",
    "UNAUTHENTICATED",
    "UNAUTHENTICATED_NODE",
    "admit",
    "authorize",
    "authorize_node_request",
    "authorize_report",
    "bound_possible",
    "is_attributed",
    "node_principal",
    "refused_node_request_event",
    "refused_request_event",
    "rejected_event",
    "shape_possible",
    "time_limit_in_force",
]

#: Requests on a job a user signs (:func:`authorize`); all but the submission act on an existing job (its owner).
JOB_REQUESTS = (JobSubmitted, JobCancelRequested, JobHoldRequested, JobReleaseRequested)

#: Requests on an existing job: only its owner or ops may make them.
OWNER_REQUESTS = (JobCancelRequested, JobHoldRequested, JobReleaseRequested)

#: What each owner request asks, in a refusal's words.
_VERB = {"JobCancelRequested": "cancel", "JobHoldRequested": "hold", "JobReleaseRequested": "release"}

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

#: Reports of one run (``job_id``, ``attempt``): the node that reports one must hold the run.
RUN_REPORT_TYPES = (JobStarted, JobCheckpointed, JobCompleted, JobFailed, JobLost, WorkloadRefused)

#: Principal names of services (``service:<name>``): a service's key signs what that service writes.
SERVICE_PREFIX = "service:"

#: The dispatcher's principal: a key registered for it proves its decisions and commands.
DISPATCHER = SERVICE_PREFIX + "dispatcher"

#: What only the dispatcher writes (``services/dispatcher``): each must be signed by a key of :data:`DISPATCHER`.
DISPATCHER_TYPES = (
    JobQueued,
    JobRejected,
    JobPlaced,
    JobPreempted,
    JobRequeued,
    JobCancelled,
    JobHeld,
    JobReleased,
    NodeLost,
    NodeDrained,
    NodeRequestRefused,
    StartWorkload,
    StopWorkload,
    DispatcherConfigured,
)

#: Ops' requests on a node (the CLI's ``cordon``, ``drain``, ``undrain``): each must be signed by an ops key.
NODE_REQUEST_TYPES = (NodeCordoned, NodeDrainRequested, NodeUncordoned)

#: The dispatcher's default ``producer`` name (only a log from before it signed is read by it, ``authorize_report``).
DISPATCHER_PRODUCER = "dispatcher"

#: Report types the dispatcher writes too (a gang's ``JobFailed``, a lost node's ``JobLost``), signed as its own.
_SHARED_REPORTS = (JobFailed, JobLost)

#: Every type whose writer must be proven by a signature (:func:`authorize_report`).
_ATTRIBUTED = REPORT_TYPES + DISPATCHER_TYPES + NODE_REQUEST_TYPES

#: Reason (dead-letter prefix) of a decision or command that is not proven by the dispatcher's key.
UNAUTHENTICATED = "unauthenticated"

#: Reason (dead-letter prefix) of a node report that is not proven by its node's key, or not of its node's run.
UNAUTHENTICATED_NODE = "unauthenticated_node"


class Principal(NamedTuple):
    """Who signed a request: the ``user`` a registered key proves, and that key's ``role`` (``user``/``ops``)."""

    user: str
    role: str = "user"


class NodeShape(NamedTuple):
    """``nodes`` nodes of ``gpus`` GPUs of ``model`` each (``model=None``: unknown), in ``block`` and ``rack``
    (rule D1.topology; ``None``: not labelled)."""

    gpus: int
    model: str | None = None
    nodes: int = 1
    block: str | None = None
    rack: str | None = None


ShapeLike = (
    NodeShape
    | tuple[int, str | None]
    | tuple[int, str | None, int]
    | tuple[int, str | None, int, str | None, str | None]
)
"""A :class:`NodeShape` or a plain ``(gpus, model[, nodes[, block, rack]])`` tuple."""


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
    fitting = sum(ns.nodes for ns in _fitting(gpus_per_replica, gpu_model, node_shapes))
    return fitting >= replicas, fitting


def _fitting(gpus_per_replica: int, gpu_model: str | None, node_shapes: Iterable[ShapeLike]) -> Iterator[NodeShape]:
    """The shapes whose nodes each give ``gpus_per_replica`` GPUs of ``gpu_model`` (any model when ``None``)."""
    for shape in node_shapes:
        ns = shape if isinstance(shape, NodeShape) else NodeShape(*shape)
        if ns.gpus >= gpus_per_replica and (gpu_model is None or ns.model == gpu_model):
            yield ns


def bound_possible(
    gpus_per_replica: int, replicas: int, gpu_model: str | None, bound: str, node_shapes: Iterable[ShapeLike]
) -> tuple[bool, int]:
    """Can ``replicas`` distinct nodes of one block (``bound="block"``) or one rack (``"rack"``) each give
    ``gpus_per_replica`` GPUs of the model (rule D1.topology)?

    A rack is named within its block (rack ``r1`` of two blocks is two racks); a node without a block label is
    a block and a rack of its own, one with a block and no rack a rack of its own, as placement groups them.

    Returns:
        ``(possible, most)``: whether one block (rack) holds k fitting nodes, and the most fitting nodes any
        one holds.
    """
    domains: dict[tuple[str, str | None], int] = {}
    most = 0
    for ns in _fitting(gpus_per_replica, gpu_model, node_shapes):
        if ns.nodes <= 0:
            continue
        if ns.block is None or (bound == "rack" and ns.rack is None):
            most = max(most, 1)  # each node a domain of its own
            continue
        key = (ns.block, ns.rack if bound == "rack" else None)
        domains[key] = domains.get(key, 0) + ns.nodes
        most = max(most, domains[key])
    return most >= replicas, most


def admit(
    tree: BudgetTree, job: JobSubmitted, node_shapes: Iterable[ShapeLike], window_s: float = WEEK_S
) -> Rejection | None:
    """Check a submission against the tree and node shapes (rule D2.rejection).

    Args:
        tree: the budget tree in force at the submission's event time.
        job: the submission.
        node_shapes: the declared inventory (see :func:`shape_possible`).
        window_s: the occupancy window W, seconds: the ceiling of a minimum runtime where no budget sets a limit.

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
        if limit == 0.0:  # a limit of 0 admits min_runtime 0 only: unallocated work (D1.unallocated-job)
            return Rejection(
                RejectReason.MIN_RUNTIME_TOO_LONG,
                f"budget {path!r} takes only unallocated work (its max_min_runtime is 0s): submit with "
                f"min_runtime 0 (free, preemptible at any time), not {format_duration(job.min_runtime_s)}",
            )
        if limit is not None and job.min_runtime_s > limit:
            return Rejection(
                RejectReason.MIN_RUNTIME_TOO_LONG,
                f"min_runtime {format_duration(job.min_runtime_s)} is above the budget's limit "
                f"{format_duration(limit)} (max_min_runtime of {path!r})",
            )
        if limit is None and job.min_runtime_s > window_s:
            return Rejection(
                RejectReason.MIN_RUNTIME_TOO_LONG,
                f"min_runtime {format_duration(job.min_runtime_s)} is above the occupancy window "
                f"{format_duration(window_s)}, the limit "
                f"where no budget above {path!r} sets max_min_runtime",
            )
    max_s = tree.time_limits_s(path)[1]
    in_force = time_limit_in_force(tree, job)
    if max_s is not None and in_force is not None and in_force > max_s:
        whose = (
            "its time_limit_s"
            if job.time_limit_s is not None
            else f"the default {format_duration(in_force)} of budget {path!r}"
        )
        return Rejection(
            RejectReason.TIME_LIMIT_TOO_LONG,
            f"time limit {format_duration(in_force)} ({whose}) is above the max_time_limit "
            f"{format_duration(max_s)} of budget {path!r}",
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
    bound = job.topology_bound
    if shapes and bound is not None and job.replicas > 1:
        ok, most = bound_possible(job.gpus_per_replica, job.replicas, job.gpu_model, bound, shapes)
        if not ok:
            model = f" {job.gpu_model}" if job.gpu_model else ""
            return Rejection(
                RejectReason.UNSATISFIABLE_TOPOLOGY,
                f"needs {job.replicas} node(s) with >= {job.gpus_per_replica}{model} GPUs each within one {bound} "
                f"(topology_bound); the most such nodes any one {bound} of the registered nodes has is {most}",
            )
    return None


def time_limit_in_force(tree: BudgetTree, job: JobSubmitted) -> float | None:
    """The time limit of ``job``, seconds per run (``D1.job``'s optional ``time_limit_s``): the one home of the
    rule (``JobQueued.time_limit_s``).

    The submission's ``time_limit_s`` when it gives one, else its budget's (inherited)
    ``default_time_limit_s``; ``None``: no limit. Admission refuses a limit in force above the budget's
    ``max_time_limit_s`` (``time_limit_above_max``), so a queued job's limit never exceeds it.
    """
    if job.time_limit_s is not None:
        return job.time_limit_s
    return tree.time_limits_s(job.budget)[0]


def authorize(
    request: JobSubmitted | JobCancelRequested | JobHoldRequested | JobReleaseRequested,
    signer: Principal | None,
    owner: str | None = None,
) -> Rejection | None:
    """May this request act in the name of its ``user`` (rule D10.proven-user)?

    Args:
        request: a submission, or a cancel, hold or release request (:data:`JOB_REQUESTS`).
        signer: the principal whose registered, unrevoked key made a valid
            signature of the request at its event time
            (:meth:`apportion.identity.registry.KeyRegistry.principal`), or ``None``
            when there is none (unsigned, a bad signature, an unknown or
            revoked key).
        owner: for a cancel, hold or release, the user of the job it names (``None`` when the
            dispatcher knows no such job: there is nothing to protect).

    Returns:
        ``None`` when allowed; else ``unauthenticated`` (no signer, or the
        signer is another user than ``request.user``; ops sign as themselves
        too) or ``not_owner`` (a cancel, hold or release of another user's job by a principal
        whose role is not ``ops``).
    """
    if signer is None:
        return Rejection(
            RejectReason.UNAUTHENTICATED,
            f"no valid signature by a key registered for user {request.user!r} at {request.ts.isoformat()}",
        )
    if signer.user.startswith((NODE_PREFIX, SERVICE_PREFIX)):
        return Rejection(
            RejectReason.UNAUTHENTICATED, f"{signer.user!r} is a node's or a service's key: it signs no requests"
        )
    if signer.user != request.user:
        return Rejection(
            RejectReason.UNAUTHENTICATED,
            f"signed with a key of {signer.user!r}, not of the user {request.user!r} the request names",
        )
    if isinstance(request, OWNER_REQUESTS) and owner is not None and owner != signer.user and signer.role != OPS:
        return Rejection(
            RejectReason.NOT_OWNER,
            f"job {request.job_id!r} belongs to {owner!r}; "
            f"{signer.user!r} may {_VERB[request.type]} only their own jobs",
        )
    return None


def authorize_node_request(
    request: NodeCordoned | NodeDrainRequested | NodeUncordoned, signer: Principal | None
) -> Rejection | None:
    """May this cordon, drain or uncordon change the node (rule D10.authentication: only ops drain or cordon nodes)?

    Args:
        request: the ops request.
        signer: the principal whose registered, unrevoked key made a valid
            signature of the request at its event time, or ``None`` (unsigned,
            a bad signature, an unknown or revoked key).

    Returns:
        ``None`` when a key registered with role ``ops`` signed it, or for a
        ``NodeCordoned`` the dispatcher's key (it cordons a node that refused
        several starts in a row, rule D3.refused-starts; it never
        drains nor uncordons); else ``unauthenticated``: no signer, a node's or
        another service's key, or a researcher's key (role ``user``: proven, but not ops).
    """
    what = f"{request.type} of node {request.node_id!r}"
    if isinstance(request, NodeCordoned) and signer is not None and signer.user == DISPATCHER:
        return None
    if signer is None:
        return Rejection(
            RejectReason.UNAUTHENTICATED,
            f"{what}: no valid signature by a key registered with role {OPS!r} at {request.ts.isoformat()}",
        )
    if signer.user.startswith((NODE_PREFIX, SERVICE_PREFIX)) or signer.role != OPS:
        return Rejection(
            RejectReason.UNAUTHENTICATED,
            f"{what}: signed with the key of {signer.user!r} (role {signer.role!r}); only {OPS!r} may drain or cordon",
        )
    return None


def node_principal(node_id: str) -> str:
    """The principal whose registered key proves the reports of ``node_id``: ``node:<node_id>``."""
    return NODE_PREFIX + node_id


def is_attributed(event: Event) -> bool:
    """Must ``event``'s writer be proven by a signature? True for decisions, commands and node reports."""
    return isinstance(event, _ATTRIBUTED)


def authorize_report(
    event: Event,
    signer: Principal | None,
    placement: Sequence[str] | None = None,
    *,
    dispatcher_keyed: bool = True,
) -> str | None:
    """May this event of the jobs, nodes or commands log change anything (rule D10.authentication)?

    The one rule of who writes what (module docstring): a decision or command
    must be the dispatcher's; a node report must be its node's, and a report
    of a run must come from a node that holds the run.

    Args:
        event: a decoded event (anything not :func:`is_attributed` passes).
        signer: the principal whose registered, unrevoked key made a valid
            signature of the record (:meth:`apportion.identity.registry.KeyRegistry.principal`),
            or ``None`` (unsigned, a bad signature, an unknown or revoked key).
        placement: for a report of a run (:data:`RUN_REPORT_TYPES`), the node
            of each replica of the run (``JobPlaced.placements`` in replica
            order), or ``None`` when the reader knows no placement of it (its
            folds then ignore the report: they know no such run).
        dispatcher_keyed: whether the reader has read a key registration of
            :data:`DISPATCHER`. ``False`` only on a log from before the
            dispatcher signed (every stack registers its key before it starts):
            decisions are then taken as they are, and so are a ``JobFailed`` or
            ``JobLost`` whose ``producer`` is :data:`DISPATCHER_PRODUCER`.

    Returns:
        ``None`` when it counts; else the reason to ignore it: starting with
        :data:`UNAUTHENTICATED` for a decision or command not signed by
        :data:`DISPATCHER` or an ops request on a node :func:`authorize_node_request`
        refuses; with :data:`UNAUTHENTICATED_NODE` for a report with
        no signer, naming no node, signed by another principal than
        ``node:<its node_id>``, or of a run its node does not hold.
    """
    if isinstance(event, NODE_REQUEST_TYPES):
        refused = authorize_node_request(event, signer)
        return None if refused is None else f"{UNAUTHENTICATED}: {refused.message}"
    if isinstance(event, DISPATCHER_TYPES):
        if (signer is not None and signer.user == DISPATCHER) or not dispatcher_keyed:
            return None
        by = "no valid signature" if signer is None else f"the key of {signer.user!r}"
        return (
            f"{UNAUTHENTICATED}: {event.type} is the dispatcher's to write, but it carries {by}, not {DISPATCHER!r}'s"
        )
    if not isinstance(event, REPORT_TYPES):
        return None
    if isinstance(event, _SHARED_REPORTS):
        if signer is not None and signer.user == DISPATCHER:
            return None
        if not dispatcher_keyed and signer is None and event.producer == DISPATCHER_PRODUCER:
            return None
    node = getattr(event, "node_id", None)
    if node is None:
        return f"{UNAUTHENTICATED_NODE}: {event.type} names no node, so no node's key can prove it"
    if signer is None:
        return f"{UNAUTHENTICATED_NODE}: {event.type} of node {node!r} is not signed by a key registered for it"
    if signer.user != node_principal(node):
        return f"{UNAUTHENTICATED_NODE}: {event.type} of node {node!r} is signed by the key of {signer.user!r}"
    if placement is not None and isinstance(event, RUN_REPORT_TYPES):
        replica = getattr(event, "replica", None)
        if replica is None:
            holds = node in placement
        else:
            holds = 0 <= replica < len(placement) and placement[replica] == node
        if not holds:
            run = f"{getattr(event, 'job_id', '')}/{getattr(event, 'attempt', '')}"
            which = "" if replica is None else f" replica {replica}"
            return (
                f"{UNAUTHENTICATED_NODE}: {event.type} of run {run}{which} by node {node!r}, "
                f"but the run is placed on {', '.join(placement)}"
            )
    return None


def refused_request_event(
    request: JobSubmitted | JobCancelRequested | JobHoldRequested | JobReleaseRequested,
    rejection: Rejection,
    *,
    budget: str,
    ts: datetime,
    producer: str = "dispatcher",
) -> JobRejected:
    """The ``JobRejected`` of a refused request (id deterministic in the request's id).

    Args:
        request: the refused submission, or cancel, hold or release request.
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


def refused_node_request_event(
    request: NodeCordoned | NodeDrainRequested | NodeUncordoned,
    rejection: Rejection,
    *,
    ts: datetime,
    producer: str = "dispatcher",
) -> NodeRequestRefused:
    """The ``NodeRequestRefused`` of a refused ops request (id deterministic in the request's id).

    Args:
        request: the refused cordon, drain or uncordon.
        rejection: what :func:`authorize_node_request` returned.
        ts: event time of the decision (aware UTC).
        producer: writer name.
    """
    return NodeRequestRefused(
        event_id=det_id("NodeRequestRefused", request.node_id, request.event_id),
        node_id=request.node_id,
        request=request.type,
        refused_event_id=request.event_id,
        reason=rejection.reason,
        message=rejection.message,
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
