"""``python -m services.policy``: owns the budget tree, publishes FairShareRanking.

Examples::

    python -m services.policy
    python -m services.policy --metrics-port 9103

Every flag has an ``APPORTION_<NAME>`` environment variable; flags win.
"""

from __future__ import annotations

import argparse
import asyncio

from services._common import install_signal_handlers, setup_logging
from services.policy.config import PolicySettings


def parse_args(argv: list[str] | None = None) -> dict:
    """Command-line flags -> settings overrides (only the flags given)."""
    ap = argparse.ArgumentParser(prog="python -m services.policy",
                                 description="apportion policy: validates budget changes (BudgetRejected) "
                                             "and publishes FairShareRanking on snapshot or budget changes.")
    ap.add_argument("--bootstrap", dest="kafka_bootstrap", help="Kafka host:port")
    ap.add_argument("--time-scale", type=float, help="event seconds per wall second")
    ap.add_argument("--metrics-port", type=int, help="Prometheus port (0: off)")
    ap.add_argument("--log-level", help="DEBUG, INFO, WARNING")
    return {k: v for k, v in vars(ap.parse_args(argv)).items() if v is not None}


def main(argv: list[str] | None = None) -> None:
    settings = PolicySettings(**parse_args(argv))
    setup_logging("policy", settings.log_level, settings.log_json)
    from services.policy.app import run

    async def go() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await run(settings, stop)

    asyncio.run(go())


if __name__ == "__main__":
    main()
