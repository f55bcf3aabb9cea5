"""`apportion nodes` at 80 columns: the GPU model stays whole once a cordon's reason appears; the reason (then the
heartbeat's age) leaves the table for a line per node after it. Before, rich shrank every column and cut the
model to `sim-a100-80…`."""

from __future__ import annotations

from typing import Any

from apportion.cli.nodes import nodes_table
from tests.unit.test_cli_narrow import render

MODEL = "sim-a100-80gb"
REASON = "bios update, back by 18:00 (ticket OPS-1234)"


def _row(node: str, state: str, reason: str, free: int, running: int, age: float | None) -> dict[str, Any]:
    return {
        "node_id": node,
        "state": state,
        "reason": reason,
        "gpu_model": MODEL,
        "free_gpus": free,
        "gpu_count": 8,
        "running": [f"j{i}" for i in range(running)],
        "heartbeat_age_s": age,
    }


ROWS = [
    _row("sim-node-00", "ready", "", 2, 3, 4.2),
    _row("sim-node-01", "cordoned", REASON, 8, 0, 61.0),
]


def test_nodes_at_80_columns_keeps_the_model_whole_and_puts_the_reason_below() -> None:
    assert render(nodes_table(ROWS, 80)) == [
        "                             nodes (2)",
        "node         state     model          free/GPUs  running  heartbeat",
        "───────────────────────────────────────────────────────────────────",
        "sim-node-00  ready     sim-a100-80gb  2/8        3        4s ago",
        "sim-node-01  cordoned  sim-a100-80gb  8/8        0        1m1s ago",
        "sim-node-01: bios update, back by 18:00 (ticket OPS-1234)",
    ]


def test_nodes_wide_enough_keeps_the_reason_in_the_table() -> None:
    lines = render(nodes_table(ROWS, 120), 120)
    assert lines[1].split() == ["node", "state", "reason", "model", "free/GPUs", "running", "heartbeat"]
    assert lines[4].startswith(f"sim-node-01  cordoned  {REASON}  {MODEL}  8/8")
    assert len(lines) == 5
