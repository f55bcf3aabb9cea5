"""``python -m services.dispatcher``: the scheduling service (one leader, any number of standbys).

Examples::

    python -m services.dispatcher
    python -m services.dispatcher --instance-id dispatcher-b --metrics-port 9103
    APPORTION_TIME_SCALE=1200 APPORTION_HEARTBEAT_TIMEOUT_S=6000 python -m services.dispatcher

Every flag has an ``APPORTION_<NAME>`` environment variable; flags win.
"""

from __future__ import annotations

import argparse
import asyncio

from services._common import install_signal_handlers, setup_logging
from services.dispatcher.config import DispatcherSettings


def parse_args(argv: list[str] | None = None) -> dict:
    """Command-line flags -> settings overrides (only the flags given)."""
    ap = argparse.ArgumentParser(
        prog="python -m services.dispatcher",
        description="apportion dispatcher: folds submissions, jobs, nodes and budgets; runs the fair-share "
                    "scheduling cycle; publishes decisions and StartWorkload/StopWorkload. One instance leads "
                    "(Redis lease with fencing token); others wait as standbys.")
    ap.add_argument("--instance-id", help="lease owner id (default host-pid)")
    ap.add_argument("--delta", type=float, help="preemption hysteresis in r (default 0.05)")
    ap.add_argument("--grace-s", type=float, help="SIGTERM-to-SIGKILL grace for preempted runs, event seconds")
    ap.add_argument("--heartbeat-timeout-s", type=float, help="event seconds without heartbeat before NodeLost (0: off)")
    ap.add_argument("--reservation-after-s", type=float, help="blocked allocated job waiting this long reserves nodes")
    ap.add_argument("--window-s", type=float, help="occupancy window W in seconds (default 7 days)")
    ap.add_argument("--tick-wall-s", type=float, help="wall seconds between timer ticks")
    ap.add_argument("--lease-ttl-wall-s", type=float, help="leadership lease TTL, wall seconds")
    ap.add_argument("--bootstrap", dest="kafka_bootstrap", help="Kafka host:port")
    ap.add_argument("--redis", dest="redis_url", help="Redis URL")
    ap.add_argument("--time-scale", type=float, help="event seconds per wall second")
    ap.add_argument("--metrics-port", type=int, help="Prometheus port (0: off)")
    ap.add_argument("--log-level", help="DEBUG, INFO, WARNING")
    return {k: v for k, v in vars(ap.parse_args(argv)).items() if v is not None}


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    settings = DispatcherSettings(**parse_args(argv))
    setup_logging("dispatcher", settings.log_level, settings.log_json)
    from services.dispatcher.app import run

    async def go() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await run(settings, stop)

    asyncio.run(go())


if __name__ == "__main__":
    main()
