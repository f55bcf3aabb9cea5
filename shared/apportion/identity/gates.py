"""The reader edge's gates (D10.proven-user): who may publish what, checked on each record (pure).

The rules are those of :mod:`apportion.domain.admission`; a gate finds the signer of a record
(:func:`~apportion.identity.canonical.signer_of`), asks the key registry
(:class:`~apportion.identity.registry.KeyRegistry`) whom it proves, and applies the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from apportion import events
from apportion.domain.admission import (
    DISPATCHER,
    JOB_REQUESTS,
    NODE_REQUEST_TYPES,
    OWNER_REQUESTS,
    Rejection,
    authorize,
    authorize_node_request,
    authorize_report,
    is_attributed,
    refused_node_request_event,
    refused_request_event,
)
from apportion.identity.canonical import signer_of
from apportion.identity.registry import KeyRegistry
from apportion.timeutil import Micros, from_us, to_us

__all__ = ["ReportGate", "RequestGate"]


class ReportGate:
    """The reader edge's check of who wrote what (D10.proven-user); folds the identity events it sees.

    Used by the dispatcher's and the accounting's :class:`~apportion.bus.intake.Intake`
    (:meth:`~apportion.bus.intake.Intake.authenticate`), the standby's token floor
    (:func:`services.dispatcher.lease.highest_token_in_log`) and :func:`check_reports`
    in ``audit verify``, all with each record's :func:`log_position`. The rule is
    :func:`apportion.domain.admission.authorize_report`: decisions and
    commands signed by the dispatcher's key, node reports by their node's,
    of runs placed on that node.

    Args:
        keys: the registry to fold into and check with, or a callable
            returning it (a service whose state, registry included, is
            replaced on restore). Default: a new one.
        folds: the event types the reader folds (``None``: all). An event of another type is let through
            unchecked, since the fold ignores it anyway: the accounting, which folds no heartbeat or start,
            verifies about one node signature per run (its completion) instead of every report.
    """

    def __init__(
        self,
        keys: KeyRegistry | Callable[[], KeyRegistry] | None = None,
        folds: tuple[type, ...] | None = None,
    ):
        reg = keys if keys is not None else KeyRegistry()
        self._keys = reg if callable(reg) and not isinstance(reg, KeyRegistry) else (lambda: reg)
        self.folds = folds

    @property
    def keys(self) -> KeyRegistry:
        """The registry in force."""
        return self._keys()

    @keys.setter
    def keys(self, registry: KeyRegistry) -> None:
        self._keys = lambda: registry

    def observe(self, ev: events.Event, position: int | None = None) -> bool:
        """Fold an identity event at its record's ``position`` (:func:`log_position`); True when ``ev`` was one."""
        return self.keys.apply(ev, position)

    def emitted(self, ev: events.Event) -> None:
        """Note an event this reader wrote itself and will not read back (the dispatcher's echoes): its placements."""
        if isinstance(ev, events.JobPlaced):
            self.keys.place(ev)

    def checks(self, ev: events.Event) -> bool:
        """Does :meth:`report_refusal` check the signature of ``ev`` (attributed, of a type the reader folds)?"""
        return is_attributed(ev) and (self.folds is None or isinstance(ev, self.folds))

    def report_refusal(self, raw: bytes | str | None, ev: events.Event, position: int | None = None) -> str | None:
        """Why ``ev`` (read as ``raw``) must be ignored (``unauthenticated...: ...``), or ``None``.

        Check in log order of each partition: a ``JobPlaced`` that passes is
        remembered (:meth:`KeyRegistry.place`) for the reports of its run that
        follow. An event that needs no signature (:func:`~apportion.domain.admission.is_attributed`),
        or is of a type the reader does not fold: ``None`` without a signature check.
        """
        if not self.checks(ev):
            return None
        keys = self.keys
        signer = keys.principal(signer_of(raw, appended=True), to_us(ev.ts), position)
        why = authorize_report(ev, signer, keys.placement(ev), dispatcher_keyed=keys.knows(DISPATCHER))
        if why is None and isinstance(ev, events.JobPlaced):
            keys.place(ev)
        return why


class RequestGate(ReportGate):
    """The dispatcher's intake check of requests (D10.proven-user): who may act in whose name.

    Folds the identity events it sees; for a ``JobSubmitted`` or a
    ``JobCancelRequested`` returns the ``JobRejected`` the dispatcher
    publishes instead of deciding on the request (``unauthenticated`` or
    ``not_owner``), for an ops request on a node not signed by ops its
    ``NodeRequestRefused`` (``unauthenticated``), or ``None`` to let it
    through. As a :class:`ReportGate` (the same registry) it is the
    dispatcher's intake check of node reports; it lets the ops requests on
    nodes through there (they get a verdict here, not a dead letter).

    Args:
        producer: the dispatcher's producer name (written on refusals).
    """

    def __init__(self, producer: str = "dispatcher") -> None:
        super().__init__(None)
        self.producer = producer
        self.refused = 0

    def report_refusal(self, raw: bytes | str | None, ev: events.Event, position: int | None = None) -> str | None:
        """:meth:`ReportGate.report_refusal`, but ``None`` for an ops request on a node (:meth:`refusal` answers it)."""
        if isinstance(ev, NODE_REQUEST_TYPES):
            return None
        return super().report_refusal(raw, ev, position)

    def refusal(
        self,
        raw: bytes | None,
        ev: events.Event,
        jobs: Mapping[str, Any],
        now_us: Micros,
        *,
        rebuild: bool = False,
        position: int | None = None,
    ) -> Any:
        """The ``JobRejected`` (or ``NodeRequestRefused``) refusing ``ev``, or ``None`` (allowed, or not a request).

        Args:
            raw: the record value ``ev`` was decoded from (the signature is checked on it).
            ev: the decoded event; identity events are folded here.
            jobs: the dispatcher's jobs by id (``spec.user``, ``spec.budget``): a cancel's owner.
            now_us: event time of the refusal.
            rebuild: an ops request on a node checked by a rebuild, whose registry holds revocations later in
                the log than the request: they count by event time only (an operator's rotated key must not
                undo the drains it signed; a live refusal is in the log as its verdict).
            position: the request's record's place in the log (:func:`log_position`), so that the keys are
                those as of it, as the audit judges it (:func:`check_requests`); ``None``: every revocation
                folded so far counts.
        """
        if self.keys.apply(ev):
            return None
        if isinstance(ev, NODE_REQUEST_TYPES):
            # position 0 (before any record): the revocations folded with a place count by event time only
            # the appended form too: the dispatcher's own cordon (of a node refusing starts) is signed as a decision
            signer = self.keys.principal(signer_of(raw, appended=True), to_us(ev.ts), 0 if rebuild else position)
            refused = authorize_node_request(ev, signer)
            if refused is None:
                return None
            self.refused += 1
            return refused_node_request_event(ev, refused, ts=from_us(now_us), producer=self.producer)
        if not isinstance(ev, JOB_REQUESTS):
            return None
        rejection = self.check(raw, ev, jobs, position)
        if rejection is None:
            return None
        self.refused += 1
        if isinstance(ev, events.JobSubmitted):
            budget = ev.budget
        else:
            rec = jobs.get(ev.job_id)
            budget = rec.spec.budget if rec is not None else ""
        return refused_request_event(ev, rejection, budget=budget, ts=from_us(now_us), producer=self.producer)

    def check(
        self,
        raw: bytes | None,
        ev: events.JobSubmitted | events.JobCancelRequested | events.JobHoldRequested | events.JobReleaseRequested,
        jobs: Mapping[str, Any],
        position: int | None = None,
    ) -> Rejection | None:
        """:func:`~apportion.domain.admission.authorize` of ``ev`` with the signer of ``raw`` at ``ev.ts``.

        ``position``: its record's place in the log (:func:`log_position`; ``None``: unknown).
        """
        signer = self.keys.principal(signer_of(raw), to_us(ev.ts), position)
        owner = None
        if isinstance(ev, OWNER_REQUESTS):
            rec = jobs.get(ev.job_id)
            owner = rec.spec.user if rec is not None else None
        return authorize(ev, signer, owner)
