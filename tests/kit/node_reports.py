"""Node reports on a log (rule D10.authentication): ``reg_node``, a node's registration as its agent writes it, and
``log_of``, records of events each with its value as written (a plain encoding unless given) and broker time."""

from __future__ import annotations

from datetime import datetime

from apportion import events
from apportion.events import NodeRegistered
from apportion.logrecord import LogRecord, log_order
from tests.kit.signed_requests import T0


def reg_node(node: str = "n0", at: datetime = T0) -> NodeRegistered:
    return NodeRegistered(
        event_id=events.det_id("reg", node, at), node_id=node, gpu_count=8, ts=at, producer="node-agent"
    )


def log_of(*items: tuple[events.Event, bytes | None, int]) -> list[LogRecord]:
    """Records of ``(event, value or None for plain, broker timestamp ms)``, offsets per topic, in log order."""
    nxt: dict[str, int] = {}
    out = []
    for ev, value, ms in items:
        t = events.topic_of(ev, "")
        off = nxt.get(t, 0)
        nxt[t] = off + 1
        raw = value if value is not None else events.encode(ev)
        out.append(LogRecord(t, 0, off, events.key_of(ev), ms, raw, ev))
    out.sort(key=log_order)
    return out
