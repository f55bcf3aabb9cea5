#!/usr/bin/env bash
# Start a local KRaft cluster of BROKERS nodes on 127.0.0.1, data in DATADIR.
#
#   infra/kafka/start-cluster.sh BROKERS DATADIR [PORT]
#
# Each node is a combined broker + controller (start.sh) in DATADIR/broker-N,
# node ids 1..BROKERS, one static quorum of all of them (so a cluster of three
# keeps its quorum, and takes writes, with one node down).  Ports are chosen
# once and kept in DATADIR/cluster.ports ("node port controller-port" lines;
# PORT, when given, is node 1's client port), so a node restarted later comes
# back on the same addresses; the cluster id (DATADIR/cluster.id) and the
# secrets (DATADIR/secrets/, SASL/SCRAM as start.sh sets it up) and the TLS
# directory (tls/ beside DATADIR: one CA and server certificate) are shared.
# Replication: min(3, BROKERS) replicas of the internal topics and by default,
# min.insync.replicas one less (at least 1).
#
# Idempotent: nodes already running are left alone, so running it again after
# a node died (kill -9) restarts just that node.  Starts every missing node,
# then waits for each to answer (no fixed sleeps).  Last lines:
# KAFKA_BOOTSTRAP=127.0.0.1:P1,127.0.0.1:P2,... and, when secured,
# KAFKA_SECRETS=DIR.  Stop with infra/kafka/stop.sh DATADIR (all nodes).
#
# Environment: as start.sh (KAFKA_HEAP_OPTS, KAFKA_START_TIMEOUT,
# APPORTION_KAFKA_PLAINTEXT).
set -euo pipefail
if [[ $# -lt 2 || $# -gt 3 ]]; then
    echo "usage: $0 BROKERS DATADIR [PORT]" >&2
    exit 64
fi
brokers="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$2"
# private: the log holds every job's command and environment, the metadata every principal's SCRAM record;
# no job account may read them past the ACLs (docs/security.md, "Node boundary")
chmod 700 "$2"
datadir="$(cd "$2" && pwd)"
first_port="${3:-0}"
if ! [[ "$brokers" =~ ^[1-9][0-9]*$ ]]; then
    echo "start-cluster.sh: BROKERS must be a positive integer, got '$brokers'" >&2
    exit 64
fi

if [[ -d "$datadir/kraft-logs" ]]; then
    echo "start-cluster.sh: $datadir holds a single broker: start it with start.sh (or remove the directory)" >&2
    exit 1
fi
ports_file="$datadir/cluster.ports"
if [[ ! -s "$ports_file" ]]; then
    # 2 x BROKERS distinct free ports, held open together so none is handed out twice
    python3 - "$brokers" "$first_port" > "$ports_file.tmp" <<'EOF'
import socket, sys
n, first = int(sys.argv[1]), int(sys.argv[2])
socks = []
for _ in range(2 * n):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
ports = [s.getsockname()[1] for s in socks]
if first:
    ports[0] = first
for i in range(n):
    print(i + 1, ports[2 * i], ports[2 * i + 1])
EOF
    mv "$ports_file.tmp" "$ports_file"
fi
if [[ "$(wc -l < "$ports_file")" -ne "$brokers" ]]; then
    echo "start-cluster.sh: $datadir holds a cluster of $(wc -l < "$ports_file") nodes, not $brokers" >&2
    exit 1
fi

voters="$(awk '{printf "%s%s@127.0.0.1:%s", (NR > 1 ? "," : ""), $1, $3}' "$ports_file")"
rf=$(( brokers < 3 ? brokers : 3 ))
bootstrap="$(awk '{printf "%s127.0.0.1:%s", (NR > 1 ? "," : ""), $2}' "$ports_file")"

tls="${APPORTION_TLS_DIR:-$(dirname "$datadir")/tls}"  # beside DATADIR: one CA and certificate for every node
start_node() {  # node port cport -> start.sh's output in DATADIR/broker-N.start.log
    APPORTION_TLS_DIR="$tls" KAFKA_NODE_ID="$1" KAFKA_CONTROLLER_PORT="$3" KAFKA_QUORUM_VOTERS="$voters" \
        KAFKA_REPLICATION="$rf" KAFKA_SECRETS_DIR="$datadir/secrets" KAFKA_CLUSTER_ID_FILE="$datadir/cluster.id" \
        KAFKA_NO_WAIT=1 bash "$here/start.sh" "$2" "$datadir/broker-$1" > "$datadir/broker-$1.start.log" 2>&1
}
# node 1 first (it makes the cluster id and the super users' passwords), then the others in parallel (each
# formats its storage with its own JVM)
rows=()
while read -r node port cport; do rows+=("$node $port $cport"); done < "$ports_file"
read -r node port cport <<< "${rows[0]}"
start_node "$node" "$port" "$cport" || { cat "$datadir/broker-$node.start.log" >&2; exit 1; }
jobs_=()
for row in "${rows[@]:1}"; do
    read -r node port cport <<< "$row"
    start_node "$node" "$port" "$cport" &
    jobs_+=("$!:$node")
done
for j in "${jobs_[@]}"; do
    if ! wait "${j%%:*}"; then
        cat "$datadir/broker-${j##*:}.start.log" >&2
        exit 1
    fi
done
started=()
for row in "${rows[@]}"; do
    read -r node port cport <<< "$row"
    if grep -q "^kafka node $node starting" "$datadir/broker-$node.start.log"; then
        started+=("$node $port")
    fi
done

probe=()
[[ -f "$datadir/broker-1/plaintext" ]] || probe=(--sasl SCRAM-SHA-512)
with_tls=0
if [[ ${#probe[@]} -gt 0 && ! -f "$datadir/broker-1/no-tls" ]]; then with_tls=1; probe+=(--tls "$tls/ca.pem"); fi
t0="$(date +%s%N)"
for entry in "${started[@]}"; do
    read -r node port <<< "$entry"
    d="$datadir/broker-$node"
    pid="$(cat "$d/kafka.pid")"
    if ! python3 "$here/wait_ready.py" 127.0.0.1 "$port" --pid "$pid" --timeout "${KAFKA_START_TIMEOUT:-90}" "${probe[@]}"; then
        echo "start-cluster.sh: node $node did not become ready; first errors in $d/kafka.log:" >&2
        grep -m 5 -E ' (ERROR|FATAL) |Exception:' "$d/kafka.log" >&2 || tail -n 20 "$d/kafka.log" >&2
        exit 1
    fi
    rss_kb="$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status")"
    printf 'kafka node %s ready on 127.0.0.1:%s (pid %s), RSS %d MiB\n' "$node" "$port" "$pid" $(( rss_kb / 1024 ))
done
t1="$(date +%s%N)"
printf 'kafka %s cluster of %s ready on %s (%s started) in %d.%02ds, replication %s, min.insync.replicas %s\n' \
    "$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/pom.xml")" "$brokers" "$bootstrap" \
    "${#started[@]}" $(( (t1 - t0) / 1000000000 )) $(( (t1 - t0) / 10000000 % 100 )) "$rf" $(( rf > 1 ? rf - 1 : 1 ))
echo "KAFKA_BOOTSTRAP=$bootstrap"
if [[ ${#probe[@]} -gt 0 ]]; then echo "KAFKA_SECRETS=$datadir/secrets"; fi
if [[ "$with_tls" == 1 ]]; then echo "KAFKA_TLS=$tls"; fi
