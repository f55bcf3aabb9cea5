#!/usr/bin/env bash
# Stop the broker started by start.sh for DATADIR, or every node of the
# cluster started by start-cluster.sh there (DATADIR/broker-N, all at once):
# SIGTERM (controlled shutdown), poll until it exits, SIGKILL after
# KAFKA_STOP_TIMEOUT seconds (default 30; 10 for a cluster: its last node
# cannot finish a controlled shutdown once the quorum is gone, and waits for
# it).  Safe to run when nothing is running.
#
#   infra/kafka/stop.sh DATADIR
set -euo pipefail
if [[ $# -ne 1 ]]; then
    echo "usage: $0 DATADIR" >&2
    exit 64
fi
stop="$(dirname "${BASH_SOURCE[0]}")/../stop_pidfile.sh"
nodes=("$1"/broker-*/)
if [[ -d "${nodes[0]}" ]]; then
    pids=()
    for d in "${nodes[@]}"; do
        bash "$stop" kafka "${d%/}/kafka.pid" 'kafka\.Kafka ' "${KAFKA_STOP_TIMEOUT:-10}" &
        pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    exit "$rc"
fi
exec bash "$stop" kafka "$1/kafka.pid" 'kafka\.Kafka ' "${KAFKA_STOP_TIMEOUT:-30}"
