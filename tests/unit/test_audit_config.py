"""The dispatcher's recorded configuration is what the audit re-runs with (rule D4.configured)."""

from __future__ import annotations

import pytest

from apportion.audit.config import config_from_event, config_from_log, configured_event, with_overrides
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import EngineConfig
from tests.kit.builders import dt, h

LIVE = DispatchConfig(engine=EngineConfig(delta=0.1, grace_s=5.0, reservation_after_s=600.0), heartbeat_timeout_s=600.0)


def _rec(cfg: DispatchConfig, token: int, at: int):
    return configured_event(cfg, instance=f"d{token}", fencing_token=token, ts=dt(at), producer="dispatcher")


def test_the_record_round_trips_to_the_same_config() -> None:
    assert config_from_log([_rec(LIVE, 1, h(0))]) == LIVE


def test_the_config_in_force_is_the_latest_at_or_before_the_time() -> None:
    other = with_overrides(LIVE, delta=0.2)
    log = [_rec(LIVE, 1, h(0)), _rec(other, 2, h(5))]
    assert config_from_log(log, at_us=h(4)) == LIVE
    assert config_from_log(log, at_us=h(5)) == other
    assert config_from_log(log) == other
    assert config_from_log(log, at_us=h(0) - 1) is None


def test_a_log_without_a_record_gives_none() -> None:
    assert config_from_log([]) is None


def test_overrides_replace_only_the_fields_given() -> None:
    got = with_overrides(LIVE, grace_s=30.0, heartbeat_timeout_s=0.0)
    assert (got.engine.delta, got.engine.grace_s, got.engine.reservation_after_s) == (0.1, 30.0, 600.0)
    assert got.heartbeat_timeout_s is None  # 0 turns the timeout off


def test_another_policy_version_is_refused() -> None:
    rec = _rec(LIVE, 1, h(0)).model_copy(update={"policy_version": "fairtree-0"})
    with pytest.raises(ValueError, match="ran policy 'fairtree-0'"):
        config_from_log([rec])


def test_a_fairtree_2_record_reads_with_patience_off() -> None:
    # a record written before patience existed: no patience_s field (read as 0, the rule off), policy fairtree-2
    raw = _rec(LIVE, 1, h(0)).model_dump(mode="json")
    del raw["patience_s"]
    raw["policy_version"] = "fairtree-2"
    from apportion import events

    old = events.DispatcherConfigured.model_validate(raw)
    got = config_from_event(old)
    assert got is not None
    assert (got.engine.patience_s, got.engine.policy_version) == (0.0, "fairtree-2")


def test_the_record_carries_patience() -> None:
    cfg = DispatchConfig(engine=EngineConfig(patience_s=1234.0))
    assert _rec(cfg, 1, h(0)).patience_s == 1234.0
    assert config_from_log([_rec(cfg, 1, h(0))]) == cfg


def test_a_fairtree_3_record_reads_with_the_checkpoint_rule_off() -> None:
    # written before checkpoint_rule existed: no checkpoint_wait_s field (read as 0, the rule off)
    raw = _rec(LIVE, 1, h(0)).model_dump(mode="json")
    del raw["checkpoint_wait_s"]
    del raw["protection_cap_w"]
    del raw["protection_doublings"]
    raw["policy_version"] = "fairtree-3"
    from apportion import events

    got = config_from_event(events.DispatcherConfigured.model_validate(raw))
    assert got is not None
    assert (got.engine.checkpoint_wait_s, got.engine.policy_version) == (0.0, "fairtree-3")
    assert got.engine.protection_cap_w == 0.25  # fairtree-3 capped protection growth at W / 4
    assert got.engine.protection_doublings is None  # and doubled it all the way to that cap


def test_a_fairtree_4_record_reads_with_doubling_to_the_cap() -> None:
    # written before protection_doublings existed: read as None (min_runtime x 2**p up to the cap)
    raw = _rec(LIVE, 1, h(0)).model_dump(mode="json")
    del raw["protection_doublings"]
    raw["policy_version"] = "fairtree-4"
    from apportion import events

    got = config_from_event(events.DispatcherConfigured.model_validate(raw))
    assert got is not None
    assert (got.engine.protection_doublings, got.engine.policy_version) == (None, "fairtree-4")
    assert got.engine.protection_cap_w == LIVE.engine.protection_cap_w


def test_the_record_carries_the_protection_doublings() -> None:
    cfg = DispatchConfig(engine=EngineConfig(protection_doublings=2))
    assert _rec(cfg, 1, h(0)).protection_doublings == 2
    assert config_from_log([_rec(cfg, 1, h(0))]) == cfg


def test_the_record_carries_the_churn_bound() -> None:
    cfg = DispatchConfig(engine=EngineConfig(churn_bound=5))
    assert _rec(cfg, 1, h(0)).churn_bound == 5
    assert config_from_log([_rec(cfg, 1, h(0))]) == cfg


def test_a_fairtree_5_record_reads_with_no_churn_bound_and_the_cap_w() -> None:
    # a fairtree-5 dispatcher recorded protection_cap_w 1.0 and, before churn_bound existed, no churn_bound: read as
    # None (no job is protected until done), whatever this engine's defaults (fairtree-6: 0.25 and 5)
    raw = _rec(DispatchConfig(engine=EngineConfig(protection_cap_w=1.0)), 1, h(0)).model_dump(mode="json")
    del raw["churn_bound"]
    raw["policy_version"] = "fairtree-5"
    from apportion import events

    got = config_from_event(events.DispatcherConfigured.model_validate(raw))
    assert got is not None
    assert (got.engine.churn_bound, got.engine.protection_cap_w, got.engine.policy_version) == (None, 1.0, "fairtree-5")


def test_the_default_record_is_fairtree_10_with_free_las_the_gang_rule_churn_bound_5_and_the_cap_w_over_4() -> None:
    rec = _rec(DispatchConfig(), 1, h(0))
    got = (rec.policy_version, rec.free_las, rec.gang_rule, rec.churn_bound, rec.protection_cap_w)
    assert got == ("fairtree-10", True, True, 5, 0.25)
    assert (rec.protection_doublings, rec.grow_over_share) == (3, False)


def test_a_fairtree_9_record_re_runs_with_every_job_grown() -> None:
    # before grow_over_share existed a record carried none: read as True (every job's protection grew)
    raw = _rec(DispatchConfig(), 1, h(0)).model_dump(mode="json")
    del raw["grow_over_share"]
    raw["policy_version"] = "fairtree-9"
    from apportion import events

    rec = events.DispatcherConfigured.model_validate(raw)
    got = config_from_log([rec])
    assert got is not None
    assert (got.engine.grow_over_share, got.engine.policy_version) == (True, "fairtree-9")
    assert config_from_log([_rec(DispatchConfig(), 1, h(0))]) == DispatchConfig()  # off: recorded and read back


@pytest.mark.parametrize("version", ["fairtree-8", "fairtree-7", "fairtree-6", "fairtree-2"])
def test_a_log_of_a_policy_before_fairtree_9_is_refused(version: str) -> None:
    # fairtree-8 and fairtree-9 changed the reservation fit with no knob to turn back: their predecessors' decisions
    # are not re-run
    rec = _rec(DispatchConfig(), 1, h(0)).model_copy(update={"policy_version": version})
    with pytest.raises(ValueError, match=f"ran policy '{version}'"):
        config_from_log([rec])


def test_a_record_without_free_las_reads_as_free_work_in_budget_order() -> None:
    # before free_las existed a record carried none: read as False (free work leaf by leaf in the budget order)
    raw = _rec(DispatchConfig(), 1, h(0)).model_dump(mode="json")
    del raw["free_las"]
    from apportion import events

    rec = events.DispatcherConfigured.model_validate(raw)
    assert rec.free_las is False
    got = config_from_log([rec])
    assert got is not None and got.engine.free_las is False
    assert config_from_log([_rec(DispatchConfig(), 1, h(0))]) == DispatchConfig()  # on: recorded and read back


def test_a_fairtree_6_record_reads_without_the_gang_rule() -> None:
    # before gang_rule existed a record carried no gang_rule: read as False (a gang could go for a smaller job)
    raw = _rec(DispatchConfig(), 1, h(0)).model_dump(mode="json")
    del raw["gang_rule"]
    raw["policy_version"] = "fairtree-6"
    from apportion import events

    got = config_from_event(events.DispatcherConfigured.model_validate(raw))
    assert got is not None
    assert (got.engine.gang_rule, got.engine.churn_bound, got.engine.policy_version) == (False, 5, "fairtree-6")


def test_the_record_carries_the_checkpoint_wait() -> None:
    cfg = DispatchConfig(engine=EngineConfig(checkpoint_wait_s=900.0))
    assert _rec(cfg, 1, h(0)).checkpoint_wait_s == 900.0
    assert config_from_log([_rec(cfg, 1, h(0))]) == cfg
