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
pidfile="$1/redis.pid"
if [[ ! -f "$pidfile" ]]; then
    echo "redis: no pid file in $1, nothing to stop"
    exit 0
fi
pid="$(cat "$pidfile")"
is_our_redis() {
    [[ -r "/proc/$1/cmdline" ]] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -q 'redis-server'
}
if ! is_our_redis "$pid"; then
    echo "redis: pid $pid is not running, removing stale pid file"
    rm -f "$pidfile"
    exit 0
fi
kill -TERM "$pid" 2>/dev/null || true
deadline=$(( $(date +%s) + ${REDIS_STOP_TIMEOUT:-10} ))
while is_our_redis "$pid"; do
    if (( $(date +%s) >= deadline )); then
        echo "redis: pid $pid ignored SIGTERM, sending SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
        break
    fi
    sleep 0.05  # poll interval, bounded by the deadline
done
# Give init a moment to reap the exited process, so `pgrep` shows nothing.
reap_deadline=$(( $(date +%s) + 5 ))
while [[ -e "/proc/$pid" ]] && (( $(date +%s) < reap_deadline )); do sleep 0.05; done
rm -f "$pidfile"
echo "redis: stopped pid $pid"
