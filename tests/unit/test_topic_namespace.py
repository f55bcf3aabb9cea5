"""The topic namespace: the registry takes it as an argument, the settings edge reads it.

``apportion.topics`` is part of the pure core's contract and reads no
environment (``test_purity``); ``APPORTION_TOPIC_PREFIX`` is read by
``apportion.settings.topic_prefix`` alone, at each call, and every name a
service, the CLI or the audit derives from the namespace carries it.
"""

from __future__ import annotations

import pytest

from apportion import events, topics
from apportion.bus.intake import screen
from apportion.settings import topic_name, topic_prefix
from tests.kit.builders import submitted

NS = "ns1."


def test_the_registry_names_a_topic_in_the_namespace_it_is_given() -> None:
    assert topics.JOBS.named("") == "apportion.jobs"
    assert topics.JOBS.named(NS) == "ns1.apportion.jobs"
    assert topics.by_name("ns1.apportion.jobs", NS) is topics.JOBS
    assert topics.by_name("apportion.jobs", NS) is topics.JOBS  # a base name is found in any namespace
    assert topics.by_name("ns1.apportion.jobs", "") is None  # another namespace's topic is not ours
    assert events.topic_of(submitted("j1"), NS) == "ns1.apportion.submissions"


def test_the_settings_edge_reads_the_prefix_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APPORTION_TOPIC_PREFIX", raising=False)
    assert topic_prefix() == "" and topic_name(topics.JOBS) == "apportion.jobs"
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", NS)
    assert topic_prefix() == NS and topic_name(topics.JOBS) == "ns1.apportion.jobs"


def test_every_name_derived_from_the_namespace_carries_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    from apportion import readmodel
    from apportion.audit.source import audit_topics
    from apportion.audit.verify import dispatcher_input_topics
    from apportion.cli.verdicts import policy_group
    from services.dispatcher.lease import lease_key, token_key
    from services.dispatcher.snapshot import snapshot_key
    from services.node_agent.config import NodeAgentSettings

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", NS)
    monkeypatch.delenv("APPORTION_POLICY_GROUP_ID", raising=False)
    assert audit_topics() == tuple(f"ns1.{t.base}" for t in topics.ALL_TOPICS if t is not topics.DEADLETTER)
    assert dispatcher_input_topics() == (
        "ns1.apportion.submissions",
        "ns1.apportion.jobs",
        "ns1.apportion.nodes",
        "ns1.apportion.budgets",
    )
    assert readmodel.usage_key() == "ns1.apportion:rm:usage"
    assert readmodel.checkpoint_key() == "ns1.apportion:ckpt:accounting"
    assert (lease_key(), token_key(), snapshot_key()) == (
        "ns1.apportion:dispatcher:lease",
        "ns1.apportion:dispatcher:token",
        "ns1.apportion:ckpt:dispatcher",
    )
    assert policy_group() == "ns1.policy"
    assert (
        NodeAgentSettings(node_prefix="a-").instance_id()
        == "ns1.node-agent." + NodeAgentSettings(node_prefix="a-").agent_name()
    )


def test_the_reader_edge_checks_a_record_s_topic_in_the_namespace_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    e = submitted("j1")
    raw = events.encode(e)
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", NS)
    assert screen(raw, b"j1", "ns1.apportion.submissions") == e
    with pytest.raises(events.DecodeError, match="does not belong on apportion.jobs"):
        screen(raw, b"j1", "ns1.apportion.jobs")
    monkeypatch.delenv("APPORTION_TOPIC_PREFIX")
    # out of that namespace the name is no registry topic, so only the key is checked
    assert screen(raw, b"j1", "ns1.apportion.jobs") == e
