#!/usr/bin/env python3
"""Create apportion's Kafka topics from the registry and report drift.

Thin wrapper around :mod:`apportion.bus.provision`; run it with the project's
virtualenv, e.g. ``.venv/bin/python infra/provision.py --bootstrap 127.0.0.1:9092``.
"""

import sys

from apportion.bus.provision import main

if __name__ == "__main__":
    sys.exit(main())
