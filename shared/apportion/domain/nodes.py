"""The node state machine (rule D1.node): the one home of node-state transitions.

States: ``ready`` (takes new work), ``cordoned`` (no new work),
``draining`` (cordoned, running work being moved off), ``drained``
(empty after a drain), ``lost`` (no heartbeat within the timeout).

Transitions (:func:`node_transition`; ``None`` is a node no
``NodeRegistered`` has announced yet):

==================== ============================= ============
event                from                          to
==================== ============================= ============
``NodeRegistered``   any (unknown and lost too)    ``ready``
``NodeCordoned``     ready, cordoned, draining,    ``cordoned``
                     drained
``NodeDrainRequested`` the same                    ``draining``
``NodeDrained``      the same                      ``drained``
``NodeUncordoned``   the same                      ``ready``
``NodeLost``         the same                      ``lost``
any node event       unknown / ``lost``            unchanged
==================== ============================= ============

A lost node returns only by registering again (its agent restarts); every
other event for an unknown or lost node is ignored, so duplicates and late
deliveries are harmless. Capacity C(t) counts the GPUs of the nodes in
:data:`COUNTED_STATES` (rule D1.capacity); only :data:`SCHEDULABLE` nodes
take new work.

Callers: :class:`apportion.domain.cluster.ClusterState` (the dispatcher's
view), :class:`apportion.domain.occupancy.OccupancyLedger` (capacity, so
accounting and the simulator), the CLI's ``drain``/``cordon``/``undrain``
(which refuse an event the machine would ignore).
"""

from __future__ import annotations

from typing import Literal, TypeAlias, TypeGuard, overload

from apportion.events import (
    NodeCordoned,
    NodeDrained,
    NodeDrainRequested,
    NodeLost,
    NodeRegistered,
    NodeUncordoned,
)

__all__ = [
    "NodeState",
    "NodeEvent",
    "NODE_STATES",
    "NODE_EVENT_TYPES",
    "COUNTED_STATES",
    "SCHEDULABLE",
    "node_transition",
    "is_node_state",
]

NodeState: TypeAlias = Literal["ready", "cordoned", "draining", "drained", "lost"]  # pragma: no mutate
"""A node's state (rule D1.node)."""

NodeEvent: TypeAlias = NodeRegistered | NodeCordoned | NodeDrainRequested | NodeDrained | NodeUncordoned | NodeLost
"""The events that drive :func:`node_transition` (heartbeats do not change the state)."""

#: Every node state, in the order rule D1.node lists them.
NODE_STATES: tuple[NodeState, ...] = ("ready", "cordoned", "draining", "drained", "lost")

#: The event types of :data:`NodeEvent` (for ``isinstance`` filters).
NODE_EVENT_TYPES = (NodeRegistered, NodeCordoned, NodeDrainRequested, NodeDrained, NodeUncordoned, NodeLost)

#: States whose GPUs count toward capacity C(t) (rule D1.capacity: ready and draining).
COUNTED_STATES: frozenset[str] = frozenset({"ready", "draining"})

#: The one state in which a node takes new work.
SCHEDULABLE: NodeState = "ready"


@overload
def node_transition(state: NodeState | None, event: NodeRegistered) -> NodeState: ...
@overload
def node_transition(state: NodeState, event: NodeEvent) -> NodeState: ...
@overload
def node_transition(state: NodeState | None, event: NodeEvent) -> NodeState | None: ...


def node_transition(state: NodeState | None, event: NodeEvent) -> NodeState | None:
    """The state a node is in after ``event`` (the table in the module docstring).

    Args:
        state: the node's state before the event, or ``None`` for a node not
            registered yet.
        event: a node event (:data:`NodeEvent`).

    Returns:
        The new state; ``state`` itself when the event does not apply (an
        unknown or lost node, for every event but ``NodeRegistered``).
    """
    if isinstance(event, NodeRegistered):
        return "ready"
    if state is None or state == "lost":
        return state
    if isinstance(event, NodeCordoned):
        return "cordoned"
    if isinstance(event, NodeDrainRequested):
        return "draining"
    if isinstance(event, NodeDrained):
        return "drained"
    if isinstance(event, NodeUncordoned):
        return "ready"
    return "lost"


def is_node_state(value: object) -> TypeGuard[NodeState]:
    """True when ``value`` names a node state (a read model's string, say): one of :data:`NODE_STATES`."""
    return value in NODE_STATES
