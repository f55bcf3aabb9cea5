"""Policy settings (env prefix ``APPORTION_``; flags of ``python -m services.policy`` override)."""

from __future__ import annotations

from apportion.bus.service import ServiceSettings
from apportion.timeutil import WEEK_S


class PolicySettings(ServiceSettings):
    """Settings of the policy service.

    Attributes:
        group_id: consumer group the processed offsets are committed under.
        producer_name: written as ``producer`` on events.
        instance_id: Kafka static group membership id (``group.instance.id``):
            a restart with the same id takes the place of the previous
            member at once, even after ``kill -9``, instead of waiting for
            its session to time out (60 s). Each running instance needs its own.
        faust_dir: parent of the per-instance faust data directory (a fresh
            ``apportion-policy-*`` folder is made in it at start and removed
            at stop); ``None`` uses the system temp directory.
        window_s: the window W (default 7 days, as the dispatcher's): budget events older than the newest
            one folded minus W are not folded, and the ids kept to drop duplicates are forgotten after W.
    """

    group_id: str = "policy"
    producer_name: str = "policy"
    faust_dir: str | None = None
    instance_id: str = "policy-0"
    window_s: float = float(WEEK_S)
