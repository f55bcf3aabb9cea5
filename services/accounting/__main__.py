"""``python -m services.accounting``: occupancy windows, snapshots and the Redis read model.

Examples::

    python -m services.accounting
    python -m services.accounting --rebuild --metrics-port 9102
    APPORTION_TIME_SCALE=600 APPORTION_SNAPSHOT_INTERVAL_S=60 python -m services.accounting

Every flag has an ``APPORTION_<NAME>`` environment variable; flags win.
"""

from __future__ import annotations

import argparse
import asyncio

from services._common import install_signal_handlers, setup_logging
from services.accounting.config import AccountingSettings


def parse_args(argv: list[str] | None = None) -> dict:
    """Command-line flags -> settings overrides (only the flags given)."""
    ap = argparse.ArgumentParser(prog="python -m services.accounting",
                                 description="apportion accounting: folds jobs, nodes and budgets into "
                                             "occupancy windows; publishes OccupancySnapshot; keeps the "
                                             "Redis read model. Rebuilds from offset 0 on every start.")
    ap.add_argument("--rebuild", action="store_true", default=None,
                    help="also wipe the Redis read model before rebuilding")
    ap.add_argument("--window-s", type=float, help="occupancy window W in seconds (default 7 days)")
    ap.add_argument("--snapshot-interval-s", type=float, help="event seconds between periodic snapshots")
    ap.add_argument("--snapshot-debounce-wall-s", type=float, help="wall seconds of debounce after changes")
    ap.add_argument("--bootstrap", dest="kafka_bootstrap", help="Kafka host:port")
    ap.add_argument("--redis", dest="redis_url", help="Redis URL")
    ap.add_argument("--time-scale", type=float, help="event seconds per wall second")
    ap.add_argument("--metrics-port", type=int, help="Prometheus port (0: off)")
    ap.add_argument("--log-level", help="DEBUG, INFO, WARNING")
    return {k: v for k, v in vars(ap.parse_args(argv)).items() if v is not None}


def main(argv: list[str] | None = None) -> None:
    settings = AccountingSettings(**parse_args(argv))
    setup_logging("accounting", settings.log_level, settings.log_json)
    from services.accounting.app import run

    async def go() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await run(settings, stop)

    asyncio.run(go())


if __name__ == "__main__":
    main()
