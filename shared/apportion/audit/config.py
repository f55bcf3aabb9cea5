"""The dispatcher's configuration as its log records it (rule D4.configured): the audit needs no flags.

A leading dispatcher publishes :class:`~apportion.events.DispatcherConfigured`
(:func:`configured_event`) before its first decision. :func:`config_from_log`
gives the configuration in force at an event time, so ``audit verify`` and
``audit explain`` re-run each decision with the knobs it was made with.
Flags given on the command line override single fields (for what-if audits).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime

from apportion import events
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import POLICY_VERSION, EngineConfig
from apportion.logrecord import LogRecord
from apportion.timeutil import Micros, to_us

__all__ = ["configured_event", "resumed_event", "config_from_event", "config_from_log", "with_overrides"]


def configured_event(
    cfg: DispatchConfig, *, instance: str, fencing_token: int | None, ts: datetime, producer: str
) -> events.DispatcherConfigured:
    """The record of ``cfg`` a dispatcher publishes when it starts leading (id: one per instance and token)."""
    e = cfg.engine
    return events.DispatcherConfigured(
        event_id=events.det_id("DispatcherConfigured", instance, fencing_token),
        ts=ts,
        producer=producer,
        instance=instance,
        fencing_token=fencing_token,
        policy_version=e.policy_version,
        window_s=e.window_s,
        delta=e.delta,
        grace_s=e.grace_s,
        heartbeat_timeout_s=cfg.heartbeat_timeout_s,
        reservation_after_s=e.reservation_after_s,
        patience_s=e.patience_s,
        checkpoint_wait_s=e.checkpoint_wait_s,
        protection_cap_w=e.protection_cap_w,
        protection_doublings=e.protection_doublings,
        churn_bound=e.churn_bound,
        gang_rule=e.gang_rule,
        free_las=e.free_las,
        grow_over_share=e.grow_over_share,
        dispatcher_producer=cfg.producer,
        refusal_backoff_s=cfg.refusal_backoff_s,
        refusal_backoff_cap_s=cfg.refusal_backoff_cap_s,
        cordon_after_refusals=cfg.cordon_after_refusals,
        fail_on_no_account=cfg.fail_on_no_account,
        refusal_detail=cfg.refusal_detail,
    )


def resumed_event(configured: events.DispatcherConfigured, at: datetime) -> events.DispatcherConfigured:
    """``configured`` again at ``at``, granting heartbeats a grace from then (``heartbeats_from=at``).

    What a dispatcher publishes when it can read the log again after it could not (rule D4.configured:
    the audit re-runs its decisions with the same grace). Its id: one per instance, token and time.
    """
    return configured.model_copy(
        update={
            "event_id": events.det_id(
                "DispatcherConfigured", configured.instance, configured.fencing_token, "heartbeats_from", to_us(at)
            ),
            "ts": at,
            "heartbeats_from": at,
        }
    )


def config_from_event(ev: events.DispatcherConfigured) -> DispatchConfig:
    """The :class:`DispatchConfig` a :class:`~apportion.events.DispatcherConfigured` records."""
    return DispatchConfig(
        engine=EngineConfig(
            delta=ev.delta,
            reservation_after_s=ev.reservation_after_s,
            patience_s=ev.patience_s,
            checkpoint_wait_s=ev.checkpoint_wait_s,
            protection_cap_w=ev.protection_cap_w,
            protection_doublings=ev.protection_doublings,
            churn_bound=ev.churn_bound,
            gang_rule=ev.gang_rule,
            free_las=ev.free_las,
            grow_over_share=ev.grow_over_share,
            window_s=ev.window_s,
            grace_s=ev.grace_s,
            policy_version=ev.policy_version,
            producer=ev.dispatcher_producer,
        ),
        heartbeat_timeout_s=ev.heartbeat_timeout_s,
        producer=ev.dispatcher_producer,
        refusal_backoff_s=ev.refusal_backoff_s,
        refusal_backoff_cap_s=ev.refusal_backoff_cap_s,
        cordon_after_refusals=ev.cordon_after_refusals,
        fail_on_no_account=ev.fail_on_no_account,
        refusal_detail=ev.refusal_detail,
    )


#: Older policy versions whose decisions this engine re-runs exactly with the configuration their record gives:
#: ``fairtree-9`` is ``fairtree-10`` with every job's protection grown with its preemptions (its records carry no
#: ``grow_over_share``, read as True). Logs of earlier versions are refused rather than re-run with other decisions:
#: ``fairtree-8`` and ``fairtree-9`` each changed the reservation fit with no knob to turn it back.
COMPATIBLE_VERSIONS = ("fairtree-9",)


def config_from_log(records: Iterable[LogRecord | events.Event], at_us: Micros | None = None) -> DispatchConfig | None:
    """The configuration in force at ``at_us`` (the latest record at or before it; the last one when ``None``).

    Returns:
        ``None`` when the log records none (a log written before the record
        existed: the caller falls back to flags or the defaults).
    """
    best: events.DispatcherConfigured | None = None
    for r in records:
        ev = r if isinstance(r, events.Event) else r.event
        if isinstance(ev, events.DispatcherConfigured) and (at_us is None or to_us(ev.ts) <= at_us):
            if best is None or (to_us(ev.ts), ev.fencing_token or 0) >= (to_us(best.ts), best.fencing_token or 0):
                best = ev
    if best is None:
        return None
    if best.policy_version not in (POLICY_VERSION, *COMPATIBLE_VERSIONS):
        # decisions of another policy version cannot be re-run by this code; say so rather than differ silently
        raise ValueError(f"the log's dispatcher ran policy {best.policy_version!r}; this audit runs {POLICY_VERSION!r}")
    return config_from_event(best)


def with_overrides(
    cfg: DispatchConfig,
    *,
    delta: float | None = None,
    grace_s: float | None = None,
    reservation_after_s: float | None = None,
    window_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
) -> DispatchConfig:
    """``cfg`` with the fields given replaced (``heartbeat_timeout_s`` 0 turns the timeout off)."""
    eng = cfg.engine
    eng = replace(
        eng,
        delta=eng.delta if delta is None else delta,
        grace_s=eng.grace_s if grace_s is None else grace_s,
        reservation_after_s=eng.reservation_after_s if reservation_after_s is None else reservation_after_s,
        window_s=eng.window_s if window_s is None else window_s,
    )
    hb = cfg.heartbeat_timeout_s if heartbeat_timeout_s is None else (heartbeat_timeout_s or None)
    return replace(cfg, engine=eng, heartbeat_timeout_s=hb)
