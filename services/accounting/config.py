"""Accounting settings (env prefix ``APPORTION_``; flags of ``python -m services.accounting`` override).

Attributes are event-time seconds unless they say wall.
"""

from __future__ import annotations

from apportion.bus.service import ServiceSettings
from apportion.timeutil import WEEK_S


class AccountingSettings(ServiceSettings):
    """Settings of the accounting service.

    Attributes:
        window_s: occupancy window W (default 7 days).
        snapshot_interval_s: event seconds between periodic snapshots (grid
            of multiples since the epoch); 0 disables them.
        snapshot_debounce_wall_s: after a change, wait at most this many wall
            seconds (and at least this long since the last one) before publishing.
        rebuild: ignore and wipe the checkpoint and the Redis read model, and
            rebuild from offset 0 (``--rebuild``). Without it a start resumes
            from the checkpoint when one is usable.
        checkpoint_interval_wall_s: least wall seconds between two
            checkpoints (each is written with a read-model write, in the same
            Redis transaction; stretched to 20x the last encode time for
            large states); 0 = with every read-model write. A graceful stop
            always writes one.
        group_id: consumer group the processed offsets are committed under.
        producer_name: written as ``producer`` on events.
    """

    window_s: float = float(WEEK_S)
    snapshot_interval_s: float = 300.0
    snapshot_debounce_wall_s: float = 0.5
    rebuild: bool = False
    checkpoint_interval_wall_s: float = 10.0
    group_id: str = "accounting"
    producer_name: str = "accounting"
