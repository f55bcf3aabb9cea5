"""Policy settings (env prefix ``APPORTION_``; flags of ``python -m services.policy`` override)."""

from __future__ import annotations

from services._common import ServiceSettings


class PolicySettings(ServiceSettings):
    """Settings of the policy service.

    Attributes:
        group_id: consumer group the processed offsets are committed under.
        producer_name: written as ``producer`` on events.
    """

    group_id: str = "policy"
    producer_name: str = "policy"
