"""Pure helpers of the dispatcher service around :mod:`apportion.domain.dispatch`.

The decisions themselves are :func:`apportion.domain.dispatch.step`; this
module only adds what the service needs on top and can be tested without
Kafka or Redis:

* :func:`recover` - rebuild the state from the log and decide what the
  previous leader left undecided;
* :func:`fence` - stamp the leader's fencing token on decisions and commands,
  and the input position on placements (for the audit);
* :func:`read_model` - the ``apportion:rm:jobs`` / ``apportion:rm:nodes`` rows
  (:mod:`apportion.readmodel`), with each pending job's position in the
  fair-share order and its pending reason, from the engine's own cycle
  (:mod:`apportion.domain.engine.reasons`);
* :func:`keys_bear` - whether key events read after a batch was judged change
  how any record of it was judged (rule D10.proven-user, at the commit).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from apportion.domain.cluster import UNTIL_STARTED
from apportion.domain.dispatch import (
    DispatchConfig,
    DispatchState,
    decide,
    evolve,
    hold_answered,
    submission_decided,
    with_job_settings,
)
from apportion.domain.engine import PendingJob, PendingReason, reason_dict, run_cycle
from apportion.domain.fairshare import FairShareQueue
from apportion.domain.idle import run_idle
from apportion.events import (
    Event,
    JobCancelRequested,
    JobHoldRequested,
    JobLost,
    JobPlaced,
    JobReleaseRequested,
    JobSubmitted,
    NodeLost,
    StartWorkload,
    StopWorkload,
    WorkloadRefused,
)
from apportion.timeutil import Micros, from_us, s_to_us

FENCED = (JobPlaced, StartWorkload, StopWorkload, NodeLost)


def recover(state: DispatchState, log: Sequence[Event], now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    """Fold the log into ``state`` and decide what is still undecided.

    A leader may die between reading a ``JobSubmitted`` and publishing its
    ``JobQueued``/``JobRejected``; its successor finds such submissions here
    and admits them now. The same for the node agents' ``WorkloadRefused``
    and ``JobLost`` (a start refused by an agent that restarted while no
    leader ran is undone and the job requeued), for a ``JobCancelRequested``
    whose job is still active once the log is folded (sent while no leader ran:
    it is carried out now, not lost), and for a hold or release request no
    verdict answers yet. Decision ids are deterministic, so if the old
    leader's decision did reach the log after all, readers de-duplicate.

    Args:
        state: a fresh state.
        log: the events of the submissions, jobs, nodes and budgets topics in
            log order (:func:`apportion.logrecord.log_order`).
        now_us: event time of the recovery decisions.
        cfg: dispatcher knobs.

    Returns:
        The new decisions (already folded into ``state``).
    """
    for ev in log:
        evolve(state, ev)
    out: list[Event] = []
    for ev in log:
        if state.is_stale(ev):
            continue  # older than the window: not folded, and its job's end may be forgotten
        if isinstance(ev, JobSubmitted) and not submission_decided(state, ev):
            out.extend(_decide_folded(state, ev, now_us, cfg))
        elif isinstance(ev, WorkloadRefused) or (isinstance(ev, JobLost) and ev.producer != cfg.producer):
            # an agent's report the old leader may not have answered (it arrived while nobody led, or
            # during this rebuild): the domain acts only if the run it names is still the job's current one
            out.extend(_decide_folded(state, ev, now_us, cfg))
        elif isinstance(ev, JobCancelRequested) and (ev.job_id in state.jobs or ev.job_id in state.arrays):
            out.extend(_decide_folded(state, ev, now_us, cfg))  # JobCancelled ends the job: decided once
        elif isinstance(ev, (JobHoldRequested, JobReleaseRequested)) and not hold_answered(state, ev):
            out.extend(_decide_folded(state, ev, now_us, cfg))  # answered once: its verdict's id is the request's
    return out


def resend_starts(state: DispatchState, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    """``StartWorkload`` again for every replica of a running run that has not reported ``JobStarted``.

    A leader killed between its ``JobPlaced`` (jobs topic) and its ``StartWorkload`` (commands topic)
    leaves a run placed whose start never reaches its agent: its GPUs would be held for ever (seen in
    the chaos campaign). A new leader sends the starts of such runs once, after its rebuild, under the
    same deterministic ids (:func:`apportion.domain.engine.start_events`). An agent that got the first
    copy refuses this one (``duplicate_start``, which undoes nothing); one that restarted since refuses
    a command older than its registration, but this copy is new. Runs waiting for victims
    (``awaiting``) and stopping runs are left alone.
    """
    from apportion.domain.engine import start_events

    ts = from_us(now_us)
    out: list[Event] = []
    for key in sorted(state.cluster.runs):
        run = state.cluster.runs[key]
        rec = state.jobs.get(key[0])
        if run.stopping or key in state.awaiting or rec is None or rec.attempt != key[1] or rec.status != "running":
            continue
        missing = [r for r in sorted(run.open_replicas) if r not in run.started_replicas]
        if missing:
            starts = start_events(
                key[0],
                key[1],
                run.placements,
                ts,
                rec.spec.duration_s,
                rec.spec.command,
                cfg.producer,
                progress_s=run.resumed_from_s,
                checkpoint_interval_s=rec.spec.checkpoint_interval_s,
            )
            out += [starts[r] for r in missing]
    return with_job_settings(state, out)


def _decide_folded(state: DispatchState, ev: Event, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    """``decide`` on an event already folded, then fold what it decided."""
    new = decide(state, ev, now_us, cfg)
    for e in new:
        evolve(state, e)
    return new


def fence(evts: Iterable[Event], token: int, inputs: dict[str, int] | None = None) -> list[Event]:
    """Decisions and commands carrying the leader's fencing token, ``JobPlaced`` also the input position.

    ``JobPlaced``, ``StartWorkload``, ``StopWorkload`` and ``NodeLost`` get
    ``fencing_token=token`` (agents refuse commands of an older token). With
    ``inputs`` (``"topic:partition"`` -> next offset read, see
    :attr:`apportion.events.Decision.inputs`), each ``JobPlaced`` also gets
    that position in its decision, so the audit re-runs it on exactly that
    prefix of the log. Other events pass unchanged.

    At most one copy per event (``model_copy``: no re-validation), and none
    for an event that already carries ``token`` when no ``inputs`` are
    given: fencing twice is harmless and cheap.
    """
    pos = dict(sorted(inputs.items())) if inputs is not None else None
    out: list[Event] = []
    for e in evts:
        if not isinstance(e, FENCED):
            out.append(e)
            continue
        update: dict[str, Any] = {}
        if e.fencing_token != token:
            update["fencing_token"] = token
        if pos is not None and isinstance(e, JobPlaced):
            update["decision"] = e.decision.model_copy(update={"inputs": pos})
        out.append(e.model_copy(update=update) if update else e)
    return out


def read_model(
    state: DispatchState, now_us: Micros, cfg: DispatchConfig
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Rows of ``apportion:rm:jobs`` and ``apportion:rm:nodes`` at ``now_us``.

    Pending jobs get ``position``: their 0-based place in the order a cycle
    would walk now (rule D3.scheduling-cycle): every allocated job in
    fair-share order (budget order, then submitted_at, job_id), then every
    unallocated one, leaf by leaf in the budget order at the start of the
    cycle, those that have not run yet first and then the requeued ones by least
    attained service (rule D3.free-las; D3.free-order reorders them in the cycle),
    and why they wait: the engine's cycle at ``now_us`` on the same snapshot,
    asked to explain (``run_cycle(..., explain=True)``), gives each job it
    leaves pending a typed reason; ``reason`` is its one-line text
    (``kind: facts``, the kind stable for scripts) and ``reason_detail`` its
    fields (:func:`~apportion.domain.engine.reasons.reason_dict`). A job
    that cycle would place gets ``placeable: ...`` (the dispatcher's next
    cycle places it). A job backing off after a refused start is left out of
    that cycle and its order (``position`` ``None``); its reason is
    :class:`~apportion.domain.engine.reasons.RefusedBackoff` (the node, the
    refusal, when it may be placed again), a held job's :class:`~apportion.domain.engine.reasons.Held` (who held
    it, when, why; ahead of any other). An element of a job array beyond its ``%N`` limit keeps a
    ``position`` in the order (the array's places go to its elements in the order they start:
    :func:`_released_first`) and its reason is :class:`~apportion.domain.engine.reasons.ArrayLimit`. With another scheduler than the engine
    (``cfg.scheduler``, the simulator's baselines) reasons are left empty:
    only the engine explains its own decisions.

    A running job's row carries ``idle_s`` and ``idle`` when its node agents report its GPU use
    (:func:`~apportion.domain.idle.run_idle`: event seconds all its GPUs have been idle, and whether that
    reached the nodes' ``idle_after_s``); without a report the fields are absent.

    Returns:
        ``(jobs, nodes)`` keyed by job id and node id.
    """
    snap = state.cycle_snapshot(now_us)
    # the order counts an array's elements held back by its limit: they keep their place in it
    pending = {leaf: jobs for leaf, jobs in state.pending_now(now_us, arrays=False).items() if snap.tree.is_leaf(leaf)}
    # the order the cycle walks: every allocated job in fair-share order, then the unallocated ones (pass 2)
    walk = [job for _, job in FairShareQueue(snap.tree, snap.occupancy, snap.capacity_gpu_s, pending)]
    free = [job for job in walk if not job.allocated]
    if cfg.engine.least_attained_free:  # rule D3.free-las: the fresh ones, then least attained
        free.sort(key=lambda job: job.attained_gpu_s)  # stable: ties keep the walk's order
    ranked = _released_first(state, [job for job in walk if job.allocated] + free, now_us)
    position = {job.job_id: i for i, job in enumerate(ranked)}
    jobs: dict[str, dict[str, Any]] = {}
    reasons: dict[str, PendingReason] = {}
    placeable: set[str] = set()
    if cfg.scheduler is None:
        res = run_cycle(snap, now_us, cfg.engine, explain=True)
        reasons = res.reasons
        placeable = {e.job_id for e in res.events if isinstance(e, JobPlaced)}
    for job_id, rec in state.jobs.items():
        spec = rec.spec
        row: dict[str, Any] = {
            "job_id": job_id,
            "budget": spec.budget,
            "user": spec.user,
            "state": rec.status,
            "allocated": spec.allocated,
            "gpus_per_replica": spec.gpus_per_replica,
            "replicas": spec.replicas,
            "min_runtime_s": spec.min_runtime_s,
            "submitted_at": from_us(rec.submitted_at_us).isoformat(),
            "attempt": rec.attempt,
            "reason": "",
            "nodes": [],
            "started_at": None,
            "position": None,
        }
        run = state.cluster.runs.get((job_id, rec.attempt))
        if run is not None:
            row["nodes"] = [p.node_id for p in run.placements]
            if run.started_at_us is not None:
                row["started_at"] = from_us(run.started_at_us).isoformat()
            idle = run_idle(state.idle, run)
            if idle is not None:  # absent while any replica's GPU use is unknown
                row["idle_s"], row["idle"] = idle.idle_s, idle.idle
            if run.protected_until_us is not None:
                row["protected_until"] = (
                    from_us(run.protected_until_us).isoformat()
                    if run.protected_until_us < UNTIL_STARTED
                    else "until started"
                )
        if rec.status == "pending":
            row["position"] = position.get(job_id)
            why = state.waiting_reason(job_id, now_us) or reasons.get(job_id)
            if why is not None:
                row["reason"] = why.text()
                row["reason_detail"] = reason_dict(why)
            elif job_id in placeable:
                row["reason"] = "placeable: a cycle now places it (the dispatcher's next one)"
        jobs[job_id] = row
    nodes: dict[str, dict[str, Any]] = {}
    for nid, n in state.cluster.nodes.items():
        running = sorted(f"{k[0]}#{k[1]}" for k in snap.cluster.node_runs.get(nid, ()))
        nodes[nid] = {
            "node_id": nid,
            "state": n.state,
            "gpu_count": n.gpu_count,
            "gpu_model": n.gpu_model,
            "free_gpus": len(n.free),
            "running": running,
            "last_heartbeat": from_us(n.last_heartbeat_us).isoformat() if n.last_heartbeat_us else None,
        }
    return jobs, nodes


def _released_first(state: DispatchState, ranked: list[PendingJob], now_us: Micros) -> list[PendingJob]:
    """``ranked`` with the places of each ``%N``-limited array's elements given in the order they start: those
    a cycle sees now (:meth:`~apportion.domain.dispatch.DispatchState.pending_now`) in their order, then the
    ones its limit holds back lowest index first (:meth:`~apportion.domain.dispatch.ArrayRecord.release_order`,
    the order the limit lets them in: ``sweep_2`` before ``sweep_10``, rule D3.scheduling-cycle)."""
    places: dict[str, list[int]] = {}
    for i, job in enumerate(ranked):
        array_id = state.array_of(job.job_id)
        if array_id is not None and state.arrays[array_id].throttle is not None:
            places.setdefault(array_id, []).append(i)
    if not places:
        return ranked
    seen = {job.job_id for jobs in state.pending_now(now_us).values() for job in jobs}
    out = list(ranked)
    for array_id, slots in places.items():
        elements = {ranked[i].job_id: ranked[i] for i in slots}
        held = state.arrays[array_id].release_order(j for j in elements if j not in seen)
        order = [j for j in elements if j in seen] + held
        for i, job_id in zip(slots, order, strict=True):
            out[i] = elements[job_id]
    return out


def heartbeats_behind(state: DispatchState, now_us: Micros, cfg: DispatchConfig) -> bool:
    """True when the log's newest heartbeat (of a node neither lost nor drained) is more than half the
    heartbeat timeout before ``now_us``: the log is behind (or every node went silent at once).

    A start then grants the heartbeats a grace (:meth:`DispatcherService.bootstrap`): after a broker
    outage the agents' buffered heartbeats are still on their way. ``False`` without nodes or timeout.
    """
    if cfg.heartbeat_timeout_s is None:
        return False
    newest = max(
        (n.last_heartbeat_us for n in state.cluster.nodes.values() if n.state not in ("lost", "drained")),
        default=None,
        key=lambda t: t or 0,
    )
    return newest is not None and now_us - newest > s_to_us(cfg.heartbeat_timeout_s / 2)


def read_to(positions: Mapping[str, int], ends: Mapping[str, int]) -> bool:
    """True when every partition of ``ends`` has been read up to its offset there (``positions``: the next
    offset to read, ``"topic:partition"`` -> offset; a partition not in it has not been read). The read
    barrier of a loss by heartbeat timeout (rule D3.loss-barrier)."""
    return all(positions.get(p, 0) >= end for p, end in ends.items())


def heartbeats(state: DispatchState) -> dict[str, str]:
    """Node id -> its newest heartbeat (or registration) time, ISO, as the read model's ``last_heartbeat``."""
    return {
        nid: from_us(n.last_heartbeat_us).isoformat() for nid, n in state.cluster.nodes.items() if n.last_heartbeat_us
    }


def keys_bear(late: Iterable[Any], folded: Iterable[Any]) -> bool:
    """Rule D10.proven-user at the commit: would the key records ``late`` change how a record of ``folded``
    was judged (both kafka-python records, ``late`` read after ``folded`` was judged)?

    The key registry judges a signed record only through the key that signed it
    (:meth:`apportion.identity.registry.KeyRegistry.principal`) and, for a decision, whether the dispatcher
    has a key at all (:func:`apportion.domain.admission.authorize_report`). So a late registration or
    revocation bears when its key signed a record of ``folded`` (in either signed form:
    :func:`apportion.identity.canonical.signer_of`), or when it is the dispatcher's. A late record that is
    not a key event (undecodable, or another event of the topic) bears on nothing.
    """
    from apportion.domain.admission import DISPATCHER
    from apportion.events import DecodeError, UserKeyRegistered, UserKeyRevoked, decode
    from apportion.identity.canonical import signer_of

    keys = set()
    for rec in late:
        try:
            ev = decode(rec.value)
        except DecodeError:
            continue
        if isinstance(ev, (UserKeyRegistered, UserKeyRevoked)):
            if ev.user == DISPATCHER:
                return True
            keys.add(ev.public_key)
    if not keys:
        return False
    return any(
        rec.value is not None and (signer_of(rec.value) in keys or signer_of(rec.value, appended=True) in keys)
        for rec in folded
    )
