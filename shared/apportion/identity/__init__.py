"""Proven users (D10.proven-user): Ed25519 signatures over the canonical bytes of a request.

A ``JobSubmitted``, ``JobCancelRequested``, ``JobHoldRequested`` or ``JobReleaseRequested`` names a ``user``; the
dispatcher believes that name only when the request carries a valid
signature by a key that ops registered for that user
(:class:`~apportion.events.UserKeyRegistered`, not revoked by a
:class:`~apportion.events.UserKeyRevoked`) at the request's event time.
Otherwise it refuses the request with ``JobRejected`` reason
``unauthenticated`` (:func:`apportion.domain.admission.authorize` is the rule).
Because the proof travels in the record, ``audit verify`` re-checks every
signature from the log alone (:mod:`apportion.audit.signatures`).

Modules:

* :mod:`~apportion.identity.canonical`: the canonical bytes a signature covers and the check of a
  signature (pure);
* :mod:`~apportion.identity.registry`: the key registry, a fold of the key events (pure);
* :mod:`~apportion.identity.gates`: the reader edge's checks of who may publish what (pure);
* :mod:`~apportion.identity.keys`: signing identities, their key files and keyrings, and the signers
  of decisions and reports.
"""
