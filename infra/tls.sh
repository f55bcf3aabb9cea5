#!/usr/bin/env bash
# Make DIR's local CA and server certificate where they are missing or do not fit, and print
# APPORTION_TLS_CA=DIR/ca.pem.  The certificates are made by apportion.bus.tls (the one home of how; its
# docstring lists the files); this runs it with the first Python that has the `cryptography` package
# (APPORTION_PYTHON, the checkout's .venv, python3).  infra/kafka/start.sh, infra/redis/start.sh and
# infra/compose-secrets.sh use it; `apportion stack up` and the test fixtures call apportion.bus.tls directly.
#
#   infra/tls.sh DIR [--host NAME ...] [--mode 0644]
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: $0 DIR [--host NAME ...] [--mode MODE]" >&2
    exit 64
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${APPORTION_PYTHON:-}"
if [[ -z "$py" ]]; then
    for candidate in "$here/../.venv/bin/python" python3; do
        if "$candidate" -c 'import cryptography' 2>/dev/null; then py="$candidate"; break; fi
    done
fi
if [[ -z "$py" ]]; then
    echo "tls.sh: no Python with the cryptography package (make venv, or set APPORTION_PYTHON)" >&2
    exit 1
fi
PYTHONPATH="$here/../shared${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m apportion.bus.tls "$@"
