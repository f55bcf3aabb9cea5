"""``python -m services.dispatcher``: the scheduling service (one leader, any number of standbys).

Examples::

    python -m services.dispatcher
    python -m services.dispatcher --instance-id dispatcher-b --metrics-port 9103
    APPORTION_TIME_SCALE=1200 APPORTION_HEARTBEAT_TIMEOUT_S=6000 python -m services.dispatcher

Every flag has an ``APPORTION_<NAME>`` environment variable; flags win.
"""

from __future__ import annotations

import argparse

from apportion.bus.principal import start_as
from apportion.bus.service import add_common_flags, flag_overrides, serve
from services.dispatcher.config import DispatcherSettings


def parse_args(argv: list[str] | None = None) -> dict:
    """Command-line flags -> settings overrides (only the flags given)."""
    ap = argparse.ArgumentParser(
        prog="python -m services.dispatcher",
        description="apportion dispatcher: folds submissions, jobs, nodes and budgets; runs the fair-share "
        "scheduling cycle; publishes decisions and StartWorkload/StopWorkload. One instance leads "
        "(Redis lease with fencing token); others wait as standbys.",
    )
    ap.add_argument("--instance-id", help="lease owner id (default host-pid)")
    ap.add_argument("--delta", type=float, help="preemption hysteresis in r (default 0.05)")
    ap.add_argument("--grace-s", type=float, help="SIGTERM-to-SIGKILL grace for preempted runs, event seconds")
    ap.add_argument(
        "--heartbeat-timeout-s", type=float, help="event seconds without heartbeat before NodeLost (0: off)"
    )
    ap.add_argument("--reservation-after-s", type=float, help="blocked allocated job waiting this long reserves nodes")
    ap.add_argument("--window-s", type=float, help="occupancy window W in seconds (default 7 days)")
    ap.add_argument("--tick-wall-s", type=float, help="wall seconds between timer ticks")
    ap.add_argument("--lease-ttl-wall-s", type=float, help="leadership lease TTL, wall seconds")
    add_common_flags(ap, DispatcherSettings)
    return flag_overrides(ap, argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point: settings from flags and environment, then run until SIGTERM."""
    from services.dispatcher.app import run

    args = parse_args(argv)
    start_as("dispatcher")  # its own Kafka principal, or exit 2 saying which to set
    serve("dispatcher", DispatcherSettings(**args), run)


if __name__ == "__main__":
    main()
