"""``python -m services.accounting``: occupancy windows, snapshots and the Redis read model.

A start resumes from the checkpoint stored in Redis with the read model
(the state and the offsets it covers) and reads only the records logged
since; with no usable checkpoint (none, another format or window, corrupt,
offsets no longer in the log) it says why and rebuilds from offset 0.
``--rebuild`` ignores and wipes the checkpoint and the read model and
rebuilds from offset 0.

Examples::

    python -m services.accounting
    python -m services.accounting --rebuild --metrics-port 9102
    APPORTION_TIME_SCALE=600 APPORTION_SNAPSHOT_INTERVAL_S=60 python -m services.accounting

Every flag has an ``APPORTION_<NAME>`` environment variable; flags win.
"""

from __future__ import annotations

import argparse

from apportion.bus.principal import start_as
from apportion.bus.service import add_common_flags, flag_overrides, serve
from services.accounting.config import AccountingSettings


def parse_args(argv: list[str] | None = None) -> dict:
    """Command-line flags -> settings overrides (only the flags given)."""
    ap = argparse.ArgumentParser(
        prog="python -m services.accounting",
        description="apportion accounting: folds jobs, nodes and budgets into "
        "occupancy windows; publishes OccupancySnapshot; keeps the "
        "Redis read model. A start resumes from the checkpoint kept "
        "with the read model; without a usable one it rebuilds from "
        "offset 0 (the log says why).",
    )
    ap.add_argument(
        "--rebuild",
        action="store_true",
        default=None,
        help="ignore and wipe the checkpoint and the read model; rebuild from offset 0",
    )
    ap.add_argument("--window-s", type=float, help="occupancy window W in seconds (default 7 days)")
    ap.add_argument("--snapshot-interval-s", type=float, help="event seconds between periodic snapshots")
    ap.add_argument("--snapshot-debounce-wall-s", type=float, help="wall seconds of debounce after changes")
    ap.add_argument(
        "--checkpoint-interval-wall-s",
        type=float,
        help="least wall seconds between checkpoints (default 10; 0: with every read-model write)",
    )
    add_common_flags(ap, AccountingSettings)
    return flag_overrides(ap, argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point: settings from flags and environment, then run until SIGTERM."""
    from services.accounting.app import run

    args = parse_args(argv)
    start_as("accounting")  # its own Kafka principal, or exit 2 saying which to set
    serve("accounting", AccountingSettings(**args), run)


if __name__ == "__main__":
    main()
