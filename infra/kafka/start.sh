#!/usr/bin/env bash
# Start a single-node KRaft Kafka broker on 127.0.0.1:PORT with its data in DATADIR.
#
#   infra/kafka/start.sh PORT DATADIR
#
# Formats storage once (idempotent), starts the broker in the background
# (DATADIR/kafka.pid, log in DATADIR/kafka.log), then polls a Metadata call
# until the broker answers while checking the process is still alive: no
# fixed sleeps.  Prints startup time and resident memory, and a last line
# KAFKA_BOOTSTRAP=127.0.0.1:PORT.  Stop it with infra/kafka/stop.sh DATADIR.
#
# Security (rules D10.authentication and D10.transport, docs/security.md): SASL_SSL (TLS, SCRAM-SHA-512)
# on 127.0.0.1 and ACLs (StandardAuthorizer), from security.properties.template.
# The passwords of the super users admin and controller are made once in
# DATADIR/secrets/ (mode 0600); admin's SCRAM credential is stored when the
# storage is formatted (--add-scram).  The certificates are in APPORTION_TLS_DIR
# (default tls/ beside DATADIR, shared with Redis; apportion.bus.tls makes a local CA and the server
# certificate there when they are missing).  APPORTION_KAFKA_PLAINTEXT=1 starts
# a plaintext broker without ACLs instead, and APPORTION_NO_TLS=1 the same
# SASL/SCRAM and ACLs without TLS (SASL_PLAINTEXT: to measure what TLS costs,
# bench/bench_live.py --no-tls); both development only, fixed when the storage
# is formatted.
#
# Environment: KAFKA_HEAP_OPTS (default -Xms256m -Xmx512m), KAFKA_GC_OPTS (the
# collector, default -XX:+UseParallelGC), KAFKA_JVM_OPTS (extra flags), KAFKA_CONTROLLER_PORT (default: a free port),
# KAFKA_START_TIMEOUT seconds (default 90), APPORTION_KAFKA_PLAINTEXT.
# One node of a cluster (set by start-cluster.sh, which starts all of them):
# KAFKA_NODE_ID (default 1), KAFKA_QUORUM_VOTERS (default
# 1@127.0.0.1:CONTROLLER_PORT), KAFKA_REPLICATION (replicas of the internal
# topics and the default, default 1; min.insync.replicas is one less, at least
# 1), KAFKA_SECRETS_DIR and KAFKA_CLUSTER_ID_FILE (shared by the nodes;
# default DATADIR/secrets and DATADIR/cluster.id), KAFKA_NO_WAIT=1 (start and
# return; the caller waits for the cluster).
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 PORT DATADIR" >&2
    exit 64
fi
port="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$2"
# private: the log holds every job's command and environment, the metadata every principal's SCRAM record;
# no job account may read them past the ACLs (docs/security.md, "Node boundary")
chmod 700 "$2"
datadir="$(cd "$2" && pwd)"
pidfile="$datadir/kafka.pid"
logfile="$datadir/kafka.log"
props="$datadir/server.properties"

if [[ -f "$datadir/cluster.ports" ]]; then
    echo "start.sh: $datadir holds a cluster: start it with start-cluster.sh (make up BROKERS=N)" >&2
    exit 1
fi
command -v java >/dev/null || { echo "start.sh: Java 17+ is required (apt-get install openjdk-17-jre-headless)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "start.sh: python3 is required for the readiness probe" >&2; exit 1; }
[[ -f "$here/lib/.complete" ]] || "$here/fetch.sh"

is_our_broker() {  # pid -> true when it is a live kafka.Kafka process
    [[ -r "/proc/$1/cmdline" ]] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -q 'kafka\.Kafka '
}

secure=1
if [[ -f "$datadir/plaintext" || ( ! -f "$datadir/kraft-logs/meta.properties" && "${APPORTION_KAFKA_PLAINTEXT:-}" == 1 ) ]]; then
    secure=0
fi
secrets="${KAFKA_SECRETS_DIR:-$datadir/secrets}"
tls="${APPORTION_TLS_DIR:-$(dirname "$datadir")/tls}"  # beside DATADIR: what Kafka and Redis of a stack share
if [[ ! -f "$datadir/kraft-logs/meta.properties" ]]; then
    rm -f "$datadir/no-tls"
    if [[ "${APPORTION_NO_TLS:-}" == 1 ]]; then touch "$datadir/no-tls"; fi
fi
with_tls=1
if [[ -f "$datadir/no-tls" ]]; then with_tls=0; fi

if [[ -f "$pidfile" ]] && is_our_broker "$(cat "$pidfile")"; then
    running_port="$(cat "$datadir/kafka.port" 2>/dev/null || echo '?')"
    if [[ "$running_port" != "$port" ]]; then
        echo "start.sh: a broker already runs on $datadir at port $running_port (pid $(cat "$pidfile"))" >&2
        exit 1
    fi
    echo "kafka already running on 127.0.0.1:$port (pid $(cat "$pidfile"))"
    echo "KAFKA_BOOTSTRAP=127.0.0.1:$port"
    if [[ "$secure" == 1 ]]; then echo "KAFKA_SECRETS=$secrets"; fi
    if [[ "$secure$with_tls" == 11 ]]; then echo "KAFKA_TLS=$tls"; fi
    exit 0
fi

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
cport="${KAFKA_CONTROLLER_PORT:-$(free_port)}"

if [[ "$secure" == 0 ]]; then touch "$datadir/plaintext"; fi
node_id="${KAFKA_NODE_ID:-1}"
voters="${KAFKA_QUORUM_VOTERS:-$node_id@127.0.0.1:$cport}"
rf="${KAFKA_REPLICATION:-1}"
min_isr=$(( rf > 1 ? rf - 1 : 1 ))
cluster_id_file="${KAFKA_CLUSTER_ID_FILE:-$datadir/cluster.id}"
password() {  # name -> its password, made once (infra/password.sh)
    bash "$here/../password.sh" "$secrets" "$1"
}
(umask 077; sed -e "s|@PORT@|$port|g" -e "s|@CONTROLLER_PORT@|$cport|g" -e "s|@LOG_DIR@|$datadir/kraft-logs|g" \
    -e "s|@NODE_ID@|$node_id|g" -e "s|@VOTERS@|$voters|g" -e "s|@RF@|$rf|g" -e "s|@MIN_ISR@|$min_isr|g" \
    "$here/server.properties.template" > "$props")
scram=()
probe=()
if [[ "$secure" == 1 ]]; then
    admin_pw="$(password admin)"
    no_tls=()  # APPORTION_NO_TLS: the same listeners as SASL_PLAINTEXT, no ssl.* settings
    probe=(--sasl SCRAM-SHA-512)
    if [[ "$with_tls" == 1 ]]; then
        bash "$here/../tls.sh" "$tls" > /dev/null
        probe+=(--tls "$tls/ca.pem")
    else
        no_tls=(-e "s|SASL_SSL|SASL_PLAINTEXT|g" -e "s|sasl_ssl|sasl_plaintext|g" -e "/^ssl\./d")
    fi
    sed -e "s|@PORT@|$port|g" -e "s|@CONTROLLER_PORT@|$cport|g" -e "s|@ADMIN_PASSWORD@|$admin_pw|g" \
        -e "s|@CONTROLLER_PASSWORD@|$(password controller)|g" \
        -e "s|@TLS_KEYSTORE@|$tls/keystore.pem|g" -e "s|@TLS_CA@|$tls/ca.pem|g" "${no_tls[@]}" \
        "$here/security.properties.template" >> "$props"
    scram=(--add-scram "SCRAM-SHA-512=[name=admin,password=$admin_pw]")
fi

java_log=(-Dlog4j2.configurationFile="$here/log4j2.properties")
cp="$here/lib/*"

# Format storage once.  The cluster id is kept beside the data so that a
# re-format after a partial failure uses the same id.
if [[ ! -f "$datadir/kraft-logs/meta.properties" ]]; then
    # A base64url UUID, never starting with "-" (it would read as an option).
    [[ -s "$cluster_id_file" ]] || python3 -c '
import base64, uuid
while True:
    cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    if not cid.startswith("-"):
        print(cid)
        break' > "$cluster_id_file"
    if ! env -u COLUMNS java -Xmx256m "${java_log[@]}" -cp "$cp" kafka.tools.StorageTool format \
            --cluster-id="$(cat "$cluster_id_file")" --config="$props" --ignore-formatted "${scram[@]}" \
            > "$datadir/format.log" 2>&1; then
        echo "start.sh: formatting storage failed:" >&2
        tail -n 20 "$datadir/format.log" >&2
        exit 1
    fi
fi

# The most descriptors the broker may have (server.properties' max.connections is sized well below them).
ulimit -Sn "$(ulimit -Hn)" 2>/dev/null || true

t0="$(date +%s%N)"
# setsid: the broker outlives the shell (and a Ctrl-C in it) that started it. The parallel collector: on two
# cores shared with the services it gave a lower submit-to-start latency than G1 (docs/performance.md,
# "Submit to StartWorkload").
# shellcheck disable=SC2086
setsid java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m} ${KAFKA_GC_OPTS:--XX:+UseParallelGC} -Djava.awt.headless=true \
    ${KAFKA_JVM_OPTS:-} "${java_log[@]}" -cp "$cp" kafka.Kafka "$props" \
    > "$logfile" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$pidfile"
echo "$port" > "$datadir/kafka.port"
if [[ "${KAFKA_NO_WAIT:-}" == 1 ]]; then
    echo "kafka node $node_id starting on 127.0.0.1:$port (pid $pid)"
    exit 0
fi

if ! python3 "$here/wait_ready.py" 127.0.0.1 "$port" --pid "$pid" --timeout "${KAFKA_START_TIMEOUT:-90}" "${probe[@]}"; then
    echo "start.sh: broker did not become ready; first errors in $logfile:" >&2
    grep -m 5 -E ' (ERROR|FATAL) |Exception:' "$logfile" >&2 || tail -n 20 "$logfile" >&2
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
    exit 1
fi
t1="$(date +%s%N)"
rss_kb="$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status")"
printf 'kafka %s ready on 127.0.0.1:%s (pid %s) in %d.%02ds, RSS %d MiB\n' \
    "$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/pom.xml")" \
    "$port" "$pid" $(( (t1 - t0) / 1000000000 )) $(( (t1 - t0) / 10000000 % 100 )) $(( rss_kb / 1024 ))
echo "KAFKA_BOOTSTRAP=127.0.0.1:$port"
if [[ "$secure" == 1 ]]; then echo "KAFKA_SECRETS=$secrets"; fi
if [[ "$secure$with_tls" == 11 ]]; then echo "KAFKA_TLS=$tls"; fi
