"""One Kafka principal per node agent (rule D10.authentication; ``apportion.bus.security``): the names, the
declaration, and the ACL rows each declared agent gets (the node-agent role's, under its own principal)."""

from __future__ import annotations

import pytest

from apportion.bus.security import (
    GRANTS,
    NODE_AGENT,
    PRINCIPALS,
    declared_node_agents,
    grants,
    node_agent_principal,
    principals,
)


def test_an_agents_principal_is_node_agent_dot_its_name() -> None:
    assert node_agent_principal("rack-1") == "node-agent.rack-1"
    assert node_agent_principal("n_07") == "node-agent.n_07"


@pytest.mark.parametrize("bad", ["", "-x", "a.b", "a b", "a/b", "x" * 64, "é"])
def test_a_bad_agent_name_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="node agent name"):
        node_agent_principal(bad)


def test_each_declared_agent_gets_exactly_the_node_agent_rows_under_its_own_principal() -> None:
    role = [g for g in GRANTS if g.principal == NODE_AGENT]
    assert role, "the table has node-agent rows"
    got = grants(("a", "b"))
    assert got[: len(GRANTS)] == GRANTS
    extra = got[len(GRANTS) :]
    assert [(g.principal, g.resource, g.name, g.operations, g.prefixed) for g in extra] == [
        (f"node-agent.{a}", g.resource, g.name, g.operations, g.prefixed) for a in ("a", "b") for g in role
    ]
    assert grants() == GRANTS
    assert principals(("a", "b")) == (*PRINCIPALS, "node-agent.a", "node-agent.b")


def test_the_declaration_is_a_comma_list_in_order_without_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPORTION_KAFKA_NODE_AGENTS", " rack2, rack1 ,rack2,, ")
    assert declared_node_agents() == ("rack2", "rack1")
    monkeypatch.setenv("APPORTION_KAFKA_NODE_AGENTS", "ok,not ok")
    with pytest.raises(ValueError, match="'not ok'"):
        declared_node_agents()
