#!/usr/bin/env bash
# Stop a server started with a pid file: SIGTERM, poll until it exits, SIGKILL after TIMEOUT seconds,
# then wait (bounded) for it to be reaped so `pgrep` shows nothing. Safe when nothing runs; a pid file
# whose process is gone, or is no longer ours (command line lacks PATTERN), is removed as stale.
#
#   infra/stop_pidfile.sh NAME PIDFILE PATTERN TIMEOUT
set -euo pipefail
if [[ $# -ne 4 ]]; then
    echo "usage: $0 NAME PIDFILE PATTERN TIMEOUT" >&2
    exit 64
fi
name="$1" pidfile="$2" pattern="$3" timeout="$4"
if [[ ! -f "$pidfile" ]]; then
    echo "$name: no pid file $pidfile, nothing to stop"
    exit 0
fi
pid="$(cat "$pidfile")"
is_ours() {
    [[ -r "/proc/$1/cmdline" ]] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -q -- "$pattern"
}
if ! is_ours "$pid"; then
    echo "$name: pid $pid is not running, removing stale pid file"
    rm -f "$pidfile"
    exit 0
fi
kill -TERM "$pid" 2>/dev/null || true
deadline=$(( $(date +%s) + timeout ))
while is_ours "$pid"; do
    if (( $(date +%s) >= deadline )); then
        echo "$name: pid $pid ignored SIGTERM for ${timeout}s, sending SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
        break
    fi
    sleep 0.05  # poll interval, bounded by the deadline
done
reap_deadline=$(( $(date +%s) + 5 ))
while [[ -e "/proc/$pid" ]] && (( $(date +%s) < reap_deadline )); do sleep 0.05; done
rm -f "$pidfile"
echo "$name: stopped pid $pid"
