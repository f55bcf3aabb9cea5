#!/usr/bin/env bash
# Stop the broker started by start.sh for DATADIR: SIGTERM (controlled
# shutdown), poll until it exits, SIGKILL after KAFKA_STOP_TIMEOUT seconds
# (default 30).  Safe to run when nothing is running.
#
#   infra/kafka/stop.sh DATADIR
set -euo pipefail
if [[ $# -ne 1 ]]; then
    echo "usage: $0 DATADIR" >&2
    exit 64
fi
pidfile="$1/kafka.pid"
if [[ ! -f "$pidfile" ]]; then
    echo "kafka: no pid file in $1, nothing to stop"
    exit 0
fi
pid="$(cat "$pidfile")"
is_our_broker() {
    [[ -r "/proc/$1/cmdline" ]] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -q 'kafka\.Kafka '
}
if ! is_our_broker "$pid"; then
    echo "kafka: pid $pid is not running, removing stale pid file"
    rm -f "$pidfile"
    exit 0
fi
kill -TERM "$pid" 2>/dev/null || true
deadline=$(( $(date +%s) + ${KAFKA_STOP_TIMEOUT:-30} ))
while is_our_broker "$pid"; do
    if (( $(date +%s) >= deadline )); then
        echo "kafka: pid $pid ignored SIGTERM for ${KAFKA_STOP_TIMEOUT:-30}s, sending SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
        break
    fi
    sleep 0.1  # poll interval, bounded by the deadline
done
# Give init a moment to reap the exited process, so `pgrep` shows nothing.
reap_deadline=$(( $(date +%s) + 5 ))
while [[ -e "/proc/$pid" ]] && (( $(date +%s) < reap_deadline )); do sleep 0.05; done
rm -f "$pidfile"
echo "kafka: stopped pid $pid"
