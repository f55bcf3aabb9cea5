"""``python -m services.policy``: owns the budget tree, publishes FairShareRanking.

Examples::

    python -m services.policy
    python -m services.policy --metrics-port 9103
    python -m services.policy --faust-dir /var/lib/apportion

Every flag has an ``APPORTION_<NAME>`` environment variable; flags win.
"""

from __future__ import annotations

import argparse

from apportion.bus.principal import start_as
from apportion.bus.service import add_common_flags, flag_overrides, serve
from services.policy.config import PolicySettings


def parse_args(argv: list[str] | None = None) -> dict:
    """Command-line flags -> settings overrides (only the flags given)."""
    ap = argparse.ArgumentParser(
        prog="python -m services.policy",
        description="apportion policy: validates budget changes (BudgetRejected) "
        "and publishes FairShareRanking on snapshot or budget changes.",
    )
    ap.add_argument("--instance-id", help="static group member id; one per running instance")
    ap.add_argument("--faust-dir", help="parent folder of the per-instance faust data dir (default: system temp)")
    ap.add_argument("--window-s", type=float, help="window W in seconds: older budget events are not folded")
    add_common_flags(ap, PolicySettings)
    return flag_overrides(ap, argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point: settings from flags and environment, then run until SIGTERM."""
    from services.policy.app import run

    args = parse_args(argv)
    start_as("policy")  # its own Kafka principal, or exit 2 saying which to set
    serve("policy", PolicySettings(**args), run)


if __name__ == "__main__":
    main()
