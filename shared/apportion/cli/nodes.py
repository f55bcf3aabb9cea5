"""Node commands: ``top``, ``nodes``, ``drain``, ``cordon``, ``undrain`` (ops)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from apportion.cli.common import (
    DEFAULT_WAIT_S,
    Bootstrap,
    Column,
    JsonOut,
    NoWait,
    RedisUrl,
    Timeout,
    _checked,
    _identity,
    _now,
    _print_json,
    _publish,
    _published,
    _ratio,
    _redis,
    _require_topics,
    at_seconds,
    fitted_table,
    left_out,
    out,
    refuse,
    report_verdict,
)
from apportion.cli.lazyimport import lazy_module
from apportion.durations import format_duration
from apportion.settings import topic_name

if TYPE_CHECKING:
    from apportion import events
    from apportion.domain.nodes import NodeEvent
else:
    events = lazy_module("apportion.events")  # imported by the commands that use it, not by their --help


def _top_data(r: Any, head: int) -> dict[str, Any]:
    """One frame of `top`: usage meta, budget rows with job counts, the queue head, idle runs, nodes.

    ``idle_runs``: running jobs whose node agents report their GPUs idle past the nodes' ``idle_after_s``
    (the row's ``idle``), longest idle first."""
    from collections import Counter

    from apportion import readmodel

    budgets = readmodel.read_hash(r, readmodel.budgets_key())
    meta = readmodel.read_hash(r, readmodel.usage_key()).get("meta", {})
    jobs = list(readmodel.read_hash(r, readmodel.jobs_key()).values())
    nodes = list(readmodel.read_hash(r, readmodel.nodes_key()).values())
    counts: dict[str, Counter[str]] = {}
    for j in jobs:
        for p in _ancestors(str(j.get("budget", "?"))):
            counts.setdefault(p, Counter())[str(j.get("state", "?"))] += 1
    for path, row in budgets.items():
        c = counts.get(path, Counter())
        row["pending"], row["running"] = c.get("pending", 0), c.get("running", 0)
    pending = sorted(
        (j for j in jobs if j.get("state") == "pending"),
        key=lambda j: (j.get("position") if j.get("position") is not None else 1 << 30, j.get("job_id", "")),
    )
    idle = sorted(
        (j for j in jobs if j.get("state") == "running" and j.get("idle")),
        key=lambda j: (-float(j.get("idle_s") or 0.0), j.get("job_id", "")),
    )
    return {
        "meta": meta,
        "budgets": list(budgets.values()),
        "queue_head": pending[:head],
        "idle_runs": idle,
        "nodes": nodes,
    }


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def top(
    interval: Annotated[float, typer.Option(help="Refresh period, wall seconds.")] = 1.0,
    iterations: Annotated[int, typer.Option(min=0, help="Stop after N refreshes (0 = until Ctrl-C).")] = 0,
    head: Annotated[int, typer.Option("--head", min=0, help="Pending jobs shown at the head of the queue.")] = 10,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Live view: the budget tree (share, occupancy, r, rank, jobs), the head of the queue with its pending
    reasons, the idle runs (GPUs idle past their nodes' idle_after_s, as the node agents report) and the
    nodes (those not ready with their state), refreshed until Ctrl-C. `--json`: one frame.

    When stdout is not a terminal (piped, redirected) it prints one frame and exits, or, with --iterations N,
    N frames one after the other."""
    import time as _time
    from collections import Counter

    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    r = _redis(redis_url)
    if as_json:
        _print_json(_top_data(r, head))
        return

    right = {"justify": "right"}
    tree_columns: list[Column] = [
        ("budget", {}, lambda b: "  " * str(b.get("path", "")).count("/") + str(b.get("path", "")).rsplit("/", 1)[-1]),
        ("share", right, lambda b: f"{b.get('share', 0):.3f}"),
        ("abs", right, lambda b: f"{b.get('abs_share', 0):.3f}"),
        ("O GPU-h", right, lambda b: f"{b.get('occupancy_gpu_s', 0) / 3600:.1f}"),
        ("U GPU-h", right, lambda b: f"{b.get('unallocated_gpu_s', 0) / 3600:.1f}"),
        ("r", right, lambda b: _ratio(b.get("ratio"))),
        ("rank", right, lambda b: "" if b.get("rank") is None else str(b["rank"])),
        ("pending", right, lambda b: str(b["pending"] or "")),
        ("running", right, lambda b: str(b["running"] or "")),
    ]
    head_columns: list[Column] = [
        ("pos", {}, lambda j: "-" if j.get("position") is None else str(j["position"])),
        ("job", {}, lambda j: str(j.get("job_id", ""))),
        ("budget", {}, lambda j: str(j.get("budget", ""))),
        ("user", {}, lambda j: str(j.get("user", ""))),
        ("GPUs", {}, lambda j: f"{j.get('replicas', 1)}x{j.get('gpus_per_replica', '?')}"),
        ("reason", {}, lambda j: str(j.get("reason", ""))),
    ]

    def frame() -> Group:
        # no cell is cut: the tree fits 80 columns as it is; a pending reason that does not fit the queue head's
        # table follows it, a line per job (as in `queue`)
        d = _top_data(r, head)
        meta = d["meta"]
        title = f"budgets at {at_seconds(meta.get('at'))}  capacity {meta.get('capacity_gpus', '?')} GPUs"
        bt, _ = fitted_table(title, tree_columns, d["budgets"], out.width, ())
        qt, moved = fitted_table(
            f"queue head ({len(d['queue_head'])} shown)", head_columns, d["queue_head"], out.width, ("reason",)
        )
        reasons = [
            Text(f"{j.get('job_id', '')}: {' '.join(left_out(head_columns, moved, j, bare=('reason',)))}")
            for j in d["queue_head"]
            if moved and j.get("reason")
        ]
        it = Table(title=f"idle runs ({len(d['idle_runs'])})")
        for col in ("job", "budget", "user", "GPUs", "idle", "nodes"):
            it.add_column(col)
        for j in d["idle_runs"]:
            it.add_row(
                j.get("job_id", ""),
                j.get("budget", ""),
                j.get("user", ""),
                f"{j.get('replicas', 1)}x{j.get('gpus_per_replica', '?')}",
                format_duration(float(j.get("idle_s") or 0.0)),
                ",".join(j.get("nodes") or []),
            )
        ns = d["nodes"]
        states = Counter(str(n.get("state", "?")) for n in ns)
        free = sum(int(n.get("free_gpus", 0)) for n in ns)
        total = sum(int(n.get("gpu_count", 0)) for n in ns)
        nt = Table(title=f"nodes: {', '.join(f'{k} {v}' for k, v in sorted(states.items()))}; GPUs free {free}/{total}")
        for col in ("node", "state", "free/GPUs", "running"):
            nt.add_column(col)
        for n in ns:
            if n.get("state") != "ready":
                nt.add_row(
                    n.get("node_id", ""),
                    n.get("state", ""),
                    f"{n.get('free_gpus', '?')}/{n.get('gpu_count', '?')}",
                    str(len(n.get("running") or [])),
                )
        return Group(bt, qt, *reasons, *((it,) if d["idle_runs"] else ()), nt)

    if not out.is_terminal:  # a pipe: a live display would print nothing until Ctrl-C
        for i in range(max(iterations, 1)):
            if i:
                _time.sleep(interval)
            out.print(frame())
        return
    n = 0
    with Live(frame(), console=out, refresh_per_second=4, transient=False) as live:
        try:
            while iterations <= 0 or n < iterations:
                n += 1
                live.update(frame())
                if iterations <= 0 or n < iterations:
                    _time.sleep(interval)
        except KeyboardInterrupt:
            pass


# --------------------------------------------------------------------------- ops


def _node_notes(bootstrap: str) -> dict[str, dict[str, Any]]:
    """:func:`node_notes` of ``apportion.nodes`` at ``bootstrap`` (read once, heartbeats not decoded)."""
    from apportion import topics
    from apportion.bus.reader import iter_topic_records

    return node_notes(iter_topic_records(bootstrap, [topic_name(topics.NODES)], decode=False))


def node_notes(records: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per node, from the records of ``apportion.nodes`` (``key``, ``raw``) in offset order: the last heartbeat's
    time and the reason of the last cordon/drain request (``reason``, ``by``); one pass, decoding only the events
    that are not heartbeats. A request the dispatcher refused (``NodeRequestRefused``: not signed by ops) changed
    nothing, so its reason is not shown."""
    from apportion.domain.admission import NODE_REQUEST_TYPES

    notes: dict[str, dict[str, Any]] = {}
    last_beat: dict[str, bytes] = {}
    changes: dict[str, list[Any]] = {}
    refused: set[Any] = set()
    for rec in records:
        if rec.key is None or rec.raw is None:
            continue  # a tombstone says nothing about a node
        if b'"NodeHeartbeat"' in rec.raw:
            last_beat[rec.key] = rec.raw
            continue
        try:
            ev = events.decode(rec.raw)
        except events.DecodeError:
            continue
        notes.setdefault(rec.key, {})
        if isinstance(ev, events.NodeRequestRefused):
            refused.add(ev.refused_event_id)
        elif isinstance(ev, (*NODE_REQUEST_TYPES, events.NodeLost)):
            changes.setdefault(rec.key, []).append(ev)
    for node, evs in changes.items():  # after the pass: a refusal follows the request it refuses
        n = notes[node]
        for ev in evs:
            if ev.event_id in refused:
                continue
            if isinstance(ev, (events.NodeCordoned, events.NodeDrainRequested)):
                n.update(reason=ev.reason, reason_by=ev.by, reason_at=ev.ts.isoformat())
            elif isinstance(ev, events.NodeUncordoned):
                n.update(reason="", reason_by=ev.by, reason_at=ev.ts.isoformat())
            else:
                n.update(reason=f"no heartbeat since {ev.last_heartbeat.isoformat()}")
    for node, raw in last_beat.items():
        try:
            notes.setdefault(node, {})["heartbeat_at"] = events.decode(raw).ts
        except events.DecodeError:
            continue
    return notes


def node_rows(rc: Any, bootstrap: str | None) -> list[dict[str, Any]]:
    """The rows `apportion nodes --json` prints: the dispatcher's ``apportion:rm:nodes`` rows with, from the log,
    the last heartbeat, its age in seconds on the stack's event clock (``heartbeat_age_s``) and the cordon/drain
    ``reason`` and ``reason_by`` of nodes not ready. Used by the CLI and the web dashboard.

    Exits (``typer.Exit`` 3) when Kafka at ``bootstrap`` cannot be reached or the namespace is not provisioned.
    """
    from apportion import readmodel, topics
    from apportion.settings import event_clock
    from apportion.timeutil import to_us

    rows = list(readmodel.read_hash(rc, readmodel.nodes_key()).values())
    conn = _require_topics(bootstrap, topic_name(topics.NODES))
    notes = _checked(lambda: _node_notes(conn.bootstrap))
    now_us = event_clock().now_us()
    for r in rows:
        n = notes.get(r.get("node_id", ""), {})
        beat = n.get("heartbeat_at")
        if beat is not None:
            r["last_heartbeat"] = beat.isoformat()
        r["heartbeat_age_s"] = (
            round((now_us - to_us(datetime.fromisoformat(r["last_heartbeat"]))) / 1e6, 1)
            if r.get("last_heartbeat")
            else None
        )
        r["reason"] = n.get("reason", "") if r.get("state") != "ready" else ""
        r["reason_by"] = n.get("reason_by", "") if r.get("state") != "ready" else ""
    return rows


def nodes(
    redis_url: RedisUrl = None,
    bootstrap: Bootstrap = None,
    as_json: JsonOut = False,
) -> None:
    """Nodes with state, cordon/drain reason, GPUs free/total, model, running jobs and heartbeat age.

    State and free GPUs are the dispatcher's; the reason and the last heartbeat come from the log
    (apportion.nodes); the age is measured on the stack's event clock (APPORTION_TIME_SCALE and epochs).

    Examples:

      apportion nodes
      apportion nodes --json
    """
    rows = node_rows(_redis(redis_url), bootstrap)
    if as_json:
        _print_json(rows)
        return
    out.print(nodes_table(rows, out.width))


def _heartbeat_cell(r: Any) -> str:
    age = r.get("heartbeat_age_s")
    return "-" if age is None else f"{format_duration(max(0.0, round(age)))} ago"


def nodes_table(rows: Sequence[Any], width: int) -> Any:
    """``apportion nodes``' table of ``rows`` (:func:`node_rows`), fitted to ``width`` columns with no cell cut
    (:func:`apportion.cli.common.fitted_table`): node, state, reason, model, free/GPUs, running, heartbeat. The
    reason (a cordon's or drain's words, of any length), then the heartbeat's age, leave the table first, for a
    line per node that has one after it (``node: reason``), so the GPU model stays whole."""
    from rich.console import Group
    from rich.text import Text

    columns: list[Column] = [
        ("node", {}, lambda r: str(r.get("node_id", ""))),
        ("state", {}, lambda r: str(r.get("state", ""))),
        ("reason", {}, lambda r: str(r.get("reason") or "")),
        ("model", {}, lambda r: str(r.get("gpu_model") or "-")),
        ("free/GPUs", {}, lambda r: f"{r.get('free_gpus', '?')}/{r.get('gpu_count', '?')}"),
        ("running", {}, lambda r: str(len(r.get("running") or []))),
        ("heartbeat", {}, _heartbeat_cell),
    ]
    t, moved = fitted_table(f"nodes ({len(rows)})", columns, rows, width, ("reason", "heartbeat"))
    lines = []
    for r in rows if moved else ():
        said = [part for part in left_out(columns, moved, r, bare=("reason",)) if part]
        if said:
            lines.append(Text.assemble((str(r.get("node_id", "")), "bold"), ": ", "; ".join(said)))
    return Group(t, *lines)


def _node_row(r: Any, node_id: str, bootstrap: str | None) -> dict[str, Any] | None:
    """The dispatcher's read-model row of ``node_id``; a node only the log knows yet gives a bare row."""
    from apportion import readmodel
    from apportion.cli import verdicts
    from apportion.topics import NODES

    row = readmodel.read_hash(r, readmodel.nodes_key()).get(node_id)
    if row is not None:
        return row
    conn = _require_topics(bootstrap, topic_name(NODES))
    evs = _checked(lambda: verdicts.key_events(conn.bootstrap, topic_name(NODES), node_id))
    if any(isinstance(e, events.NodeRegistered) for e in evs):
        return {"node_id": node_id, "state": "unknown"}
    return None


def _node_change(
    ev: NodeEvent,
    node_id: str,
    want: set[str],
    done: str | dict[str, str],
    *,
    refused: str,
    already: set[str],
    no_wait: bool,
    timeout: float,
    bootstrap: str | None,
    redis_url: str | None,
    as_json: bool,
) -> None:
    """Check the node exists and is in a state the change applies to, publish, wait for the dispatcher's view.

    A state the node state machine would leave unchanged (:func:`apportion.domain.nodes.node_transition`: a lost
    node ignores everything but a registration) is refused with ``refused``; one of ``already`` is a success
    with nothing to publish. ``done`` is what is printed once the node shows a state of ``want``, or a message per
    state.
    """
    from apportion import readmodel
    from apportion.cli import verdicts
    from apportion.domain.nodes import is_node_state, node_transition
    from apportion.topics import NODES

    r = _redis(redis_url)
    conn = _require_topics(bootstrap, topic_name(NODES))
    row = _node_row(r, node_id, bootstrap)
    if row is None:
        known = sorted(readmodel.read_hash(r, readmodel.nodes_key()))
        hint = f" (known: {', '.join(known[:8])}{', ...' if len(known) > 8 else ''})" if known else " (none known)"
        refuse(f"no node {node_id}{hint}", as_json=as_json, verdict="not_found", reason="no_node", node_id=node_id)
    state = str(row.get("state"))
    if is_node_state(state) and state not in already and node_transition(state, ev) == state:
        refuse(f"node {node_id} is {state}: {refused}", as_json=as_json, reason=state, node_id=node_id)
    if state in already:
        if as_json:
            _print_json({"ok": True, "published": [], "verdict": "unchanged", "state": state})
        else:
            out.print(f"node [bold]{escape(node_id)}[/] is already {state}: nothing to do")
        return
    _publish([ev], bootstrap)
    if no_wait:
        _published([ev], as_json, f"{type(ev).__name__} published for [bold]{escape(node_id)}[/] (not waiting)")
        return

    def shows() -> str | None:
        got = readmodel.read_hash(r, readmodel.nodes_key()).get(node_id, {}).get("state")
        return got if got in want else None

    seen = verdicts.wait_for(shows, timeout)
    if seen is None:  # refused (not signed by ops)? Read once: the node's partition holds all its heartbeats
        for no in _checked(lambda: verdicts.key_events(conn.bootstrap, topic_name(NODES), node_id)):
            if isinstance(no, events.NodeRequestRefused) and no.refused_event_id == ev.event_id:
                refuse(
                    f"the dispatcher refused {type(ev).__name__} of {node_id}: {no.reason.value}: {no.message}",
                    as_json=as_json,
                    verdict="rejected",
                    reason=no.reason.value,
                    node_id=node_id,
                )
    report_verdict(
        {"ok": seen is not None, "published": [events.to_dict(ev)], "verdict": seen or "no_verdict", "state": seen},
        None
        if seen is not None
        else f"the dispatcher did not show {node_id} as {'/'.join(sorted(want))} within {timeout:g} s "
        "(is it running?); the request is in the log",
        3,
        as_json=as_json,
    )
    if not as_json:
        said = done if isinstance(done, str) else done[seen]
        out.print(said.format(node=escape(node_id), state=seen))


#: What `drain` says once the dispatcher shows the node draining (runs left on it) or drained (none).
DRAIN_DONE = {
    "draining": "[bold]{node}[/] is draining: no new work lands on it, and it is drained once its runs end or are "
    "preempted as their minimum runtimes allow (`apportion nodes`)",
    "drained": "[bold]{node}[/] is drained: no run is left on it",
}


def drain(
    node_id: Annotated[str, typer.Argument(help="Node to drain.")],
    reason: Annotated[str, typer.Option(help="Why (kept in the log, shown by `nodes`).")] = "maintenance",
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Drain a node: cordon it, preempt unallocated work now, allocated work as its minimum runtime expires.

    Waits until the dispatcher shows the node draining (or drained). Exit 1 for
    a node nobody registered or a lost node.

    Examples:

      apportion drain sim-7 --reason "fan swap"
      apportion drain sim-7 --no-wait
    """
    ident = _identity(None, bootstrap, ops=True)
    ev = ident.sign(events.NodeDrainRequested(node_id=node_id, reason=reason, by=ident.user, ts=_now(), producer="cli"))
    _node_change(
        ev,
        node_id,
        {"draining", "drained"},
        DRAIN_DONE,
        refused="no heartbeat, nothing to drain",
        already={"draining", "drained"},
        no_wait=no_wait,
        timeout=timeout,
        bootstrap=bootstrap,
        redis_url=redis_url,
        as_json=as_json,
    )


def cordon(
    node_id: Annotated[str, typer.Argument(help="Node to cordon.")],
    reason: Annotated[str, typer.Option(help="Why (kept in the log, shown by `nodes`).")] = "",
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Cordon a node: no new work lands on it; running work stays. Exit 1 for an unknown or lost node.

    Examples:

      apportion cordon sim-7 --reason "flaky NIC"
    """
    ident = _identity(None, bootstrap, ops=True)
    ev = ident.sign(events.NodeCordoned(node_id=node_id, reason=reason, by=ident.user, ts=_now(), producer="cli"))
    _node_change(
        ev,
        node_id,
        {"cordoned"},
        "cordoned [bold]{node}[/]",
        refused="no heartbeat, nothing to cordon",
        already={"cordoned"},
        no_wait=no_wait,
        timeout=timeout,
        bootstrap=bootstrap,
        redis_url=redis_url,
        as_json=as_json,
    )


def undrain(
    node_id: Annotated[str, typer.Argument(help="Node to return to service.")],
    no_wait: NoWait = False,
    timeout: Timeout = DEFAULT_WAIT_S,
    bootstrap: Bootstrap = None,
    redis_url: RedisUrl = None,
    as_json: JsonOut = False,
) -> None:
    """Uncordon a cordoned, draining or drained node. Exit 1 for an unknown or lost node; 0 if already ready.

    Examples:

      apportion undrain sim-7
    """
    ident = _identity(None, bootstrap, ops=True)
    ev = ident.sign(events.NodeUncordoned(node_id=node_id, by=ident.user, ts=_now(), producer="cli"))
    _node_change(
        ev,
        node_id,
        {"ready"},
        "[bold]{node}[/] is ready",
        refused="no heartbeat; it returns when its agent registers again",
        already={"ready"},
        no_wait=no_wait,
        timeout=timeout,
        bootstrap=bootstrap,
        redis_url=redis_url,
        as_json=as_json,
    )
