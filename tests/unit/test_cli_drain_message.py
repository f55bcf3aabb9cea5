"""What `apportion drain` says once the dispatcher shows the node: draining (runs left) or drained (none)."""

from __future__ import annotations

from apportion.cli.nodes import DRAIN_DONE


def test_a_drained_node_is_said_to_be_empty_and_a_draining_one_to_wait_for_its_runs() -> None:
    said = {state: msg.format(node="sim-7", state=state) for state, msg in DRAIN_DONE.items()}
    assert said == {
        "draining": "[bold]sim-7[/] is draining: no new work lands on it, and it is drained once its runs end or are "
        "preempted as their minimum runtimes allow (`apportion nodes`)",
        "drained": "[bold]sim-7[/] is drained: no run is left on it",
    }
