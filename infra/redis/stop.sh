#!/usr/bin/env bash
# Stop the redis-server started by start.sh for DATADIR (SIGTERM, poll, then
# SIGKILL after REDIS_STOP_TIMEOUT seconds, default 10).  Safe when nothing runs.
#
#   infra/redis/stop.sh DATADIR
set -euo pipefail
if [[ $# -ne 1 ]]; then
    echo "usage: $0 DATADIR" >&2
    exit 64
fi
exec bash "$(dirname "${BASH_SOURCE[0]}")/../stop_pidfile.sh" redis "$1/redis.pid" 'redis-server' "${REDIS_STOP_TIMEOUT:-10}"
