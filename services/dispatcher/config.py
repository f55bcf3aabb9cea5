"""Dispatcher settings (env prefix ``APPORTION_``; flags of ``python -m services.dispatcher`` override).

Durations in event seconds (scaled by the clock) unless they say wall. The decision knobs (``window_s``,
``delta``, ``grace_s``, ``heartbeat_timeout_s``, ``reservation_after_s``, ``patience_s``, ``checkpoint_wait_s``)
default to the domain's own defaults (:class:`apportion.domain.engine.EngineConfig`,
:class:`apportion.domain.dispatch.DispatchConfig`), never retyped here; what a running dispatcher uses is
in its ``DispatcherConfigured`` record (rule D4.configured).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from apportion.bus.service import ServiceSettings
from apportion.domain.dispatch import DEFAULT_HEARTBEAT_TIMEOUT_S, DispatchConfig
from apportion.domain.engine import EngineConfig

#: The domain's defaults (one home: ``EngineConfig`` and ``dispatch.DEFAULT_HEARTBEAT_TIMEOUT_S``); the settings
#: only name them.
_ENGINE = EngineConfig()
_DISPATCH = DispatchConfig()


class DispatcherSettings(ServiceSettings):
    """Settings of one dispatcher instance.

    Attributes:
        instance_id: unique id of this instance in the leadership lease
            (default: host name and pid).
        lease_ttl_wall_s: lease time-to-live, wall seconds; a standby takes
            over at most this long after the leader dies.
        tick_wall_s: wall seconds between timer ticks (heartbeat timeouts,
            protection expiry for drains, grace periods, reservations).
        window_s: occupancy window W (default 7 days).
        delta: preemption hysteresis in r (rule D3.victims).
        grace_s: SIGTERM-to-SIGKILL grace for preempted runs.
        heartbeat_timeout_s: no heartbeat for this long -> NodeLost.
        reservation_after_s: a blocked allocated job waiting this long reserves nodes.
        patience_s: longest wait of a job at or over its share before it preempts whatever the
            work lost (``preemption.patience_rule``; 0 = off).
        checkpoint_wait_s: longest a preemption waits for its victims' next checkpoint
            (``preemption.checkpoint_rule``; 0 = off).
        refusal_backoff_s, refusal_backoff_cap_s: a job whose start a node refused waits
            ``refusal_backoff_s x 2^(refusals - 1)``, at most the cap, before it is placed again (0 = off).
        cordon_after_refusals: a node refusing this many starts in a row is cordoned (0 = never).
        producer_name: written as ``producer`` on events.
        reconcile_misses: consecutive heartbeats of a node that must disagree
            with the runs before a missing replica is lost or an unknown one
            stopped (:mod:`apportion.domain.reconcile`); 0 disables.
        future_tolerance_s: an input event whose time is more than this many
            event seconds after the dispatcher's clock is dead-lettered (it would
            move the window ahead; producers' clocks may lag or lead by less).
        snapshot_every_wall_s: wall seconds between snapshots of the state in
            Redis (:mod:`services.dispatcher.snapshot`); a start reads the
            snapshot and the log's tail; 0: no snapshots, every start replays
            the log from offset 0.
        transaction_timeout_wall_s: the broker aborts a transaction of decisions left open this long
            (a leader killed mid-commit): until then readers on ``read_committed`` wait at it.
        dispatcher_key: the identity file of ``service:dispatcher``
            (``APPORTION_DISPATCHER_KEY``; ``apportion keys init --service
            dispatcher``); every value published is signed with it (rule D10.authentication). ``None``: the
            development keyring (``APPORTION_KEYRING``).
    """

    instance_id: str = ""
    lease_ttl_wall_s: float = 3.0
    tick_wall_s: float = 0.2
    window_s: float = _ENGINE.window_s
    delta: float = _ENGINE.delta
    grace_s: float = _ENGINE.grace_s
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    reservation_after_s: float = _ENGINE.reservation_after_s
    patience_s: float = _ENGINE.patience_s
    checkpoint_wait_s: float = _ENGINE.checkpoint_wait_s
    refusal_backoff_s: float = _DISPATCH.refusal_backoff_s
    refusal_backoff_cap_s: float = _DISPATCH.refusal_backoff_cap_s
    cordon_after_refusals: int = _DISPATCH.cordon_after_refusals or 0
    producer_name: str = "dispatcher"
    reconcile_misses: int = 2
    future_tolerance_s: float = 3600.0
    snapshot_every_wall_s: float = 60.0
    transaction_timeout_wall_s: float = 10.0
    dispatcher_key: Path | None = None

    def owner(self) -> str:
        """This instance's lease owner id."""
        return self.instance_id or f"{socket.gethostname()}-{os.getpid()}"

    def transactional_id(self) -> str:
        """The one Kafka transactional id every dispatcher instance of this namespace publishes under
        (``<prefix>dispatcher``): a new leader's ``init_transactions`` fences the previous one's producer
        (docs/leadership.md)."""
        from apportion.settings import topic_prefix

        return f"{topic_prefix()}dispatcher"
