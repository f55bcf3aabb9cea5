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
exec bash "$(dirname "${BASH_SOURCE[0]}")/../stop_pidfile.sh" kafka "$1/kafka.pid" 'kafka\.Kafka ' "${KAFKA_STOP_TIMEOUT:-30}"
