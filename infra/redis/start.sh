#!/usr/bin/env bash
# Start redis-server on 127.0.0.1:PORT (TLS) with its files in DATADIR.
#
#   infra/redis/start.sh PORT DATADIR
#
# Uses Debian's redis-server; installs it with apt-get when it is missing and
# we are root, otherwise says how.  No persistence by default (tests, demo);
# REDIS_APPENDONLY=yes turns the append-only file on.  Waits (polling, with a
# deadline) until PING answers; prints REDIS_URL=rediss://127.0.0.1:PORT/0 and,
# when secured, REDIS_SECRETS=DIR.
#
# Security (rules D10.authentication and D10.transport, docs/security.md): ACL users with passwords
# (DATADIR/secrets/<user>.password, mode 0600, made once; DATADIR/users.acl
# from infra/redis/acl.sh, which declares the users and what each may do).  APPORTION_REDIS_NOAUTH=1 keeps
# the open default user instead (development only).  TLS only: PORT is Redis' tls-port and the plaintext
# port is off (port 0); the server certificate and the CA are in APPORTION_TLS_DIR (default tls/ beside
# DATADIR, shared with Kafka; made by apportion.bus.tls through infra/tls.sh when missing); clients present no
# certificate (tls-auth-clients no: the ACL users authenticate them) and verify the server against the CA.
# Connection limits (docs/infra.md): at most 1024 clients (one more, signed in or not, is closed at once: a
# stack's services and CLIs use a few dozen), and a client idle for 300 s is closed (the services' pools
# reconnect; subscribers and blocked readers are exempt).
# APPORTION_NO_TLS=1 serves plaintext on PORT instead (development only, to measure what TLS costs; the URL is
# then redis://).
set -euo pipefail
if [[ $# -ne 2 ]]; then
    echo "usage: $0 PORT DATADIR" >&2
    exit 64
fi
port="$1"
mkdir -p "$2"
# private: the log holds every job's command and environment, the metadata every principal's SCRAM record;
# no job account may read them past the ACLs (docs/security.md, "Node boundary")
chmod 700 "$2"
datadir="$(cd "$2" && pwd)"
pidfile="$datadir/redis.pid"

if ! command -v redis-server >/dev/null; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        echo "redis-server missing: installing the Debian package" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q redis-server >/dev/null \
            || { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }
    else
        echo "start.sh: redis-server is not installed. Install it with" >&2
        echo "    sudo apt-get install redis-server" >&2
        echo "(or run this script as root, which installs it), or point REDIS_URL at a running Redis." >&2
        exit 1
    fi
fi

is_our_redis() {
    [[ -r "/proc/$1/cmdline" ]] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -q 'redis-server'
}
secrets="$datadir/secrets"
tls="${APPORTION_TLS_DIR:-$(dirname "$datadir")/tls}"  # beside DATADIR: what Kafka and Redis of a stack share
scheme=rediss
if [[ -f "$pidfile" ]] && is_our_redis "$(cat "$pidfile")"; then
    if [[ -f "$datadir/plaintext" ]]; then scheme=redis; fi
    echo "redis already running (pid $(cat "$pidfile"))"
    echo "REDIS_URL=$scheme://127.0.0.1:$port/0"
    if [[ -f "$datadir/users.acl" ]]; then echo "REDIS_SECRETS=$secrets"; fi
    if [[ "$scheme" == rediss ]]; then echo "REDIS_TLS=$tls"; fi
    exit 0
fi
if [[ "${APPORTION_NO_TLS:-}" == 1 ]]; then scheme=redis; fi
rm -f "$datadir/plaintext"
listen=()
if [[ "$scheme" == rediss ]]; then
    bash "$(dirname "${BASH_SOURCE[0]}")/../tls.sh" "$tls" > /dev/null
    listen=(--port 0 --tls-port "$port" --tls-cert-file "$tls/server.pem" --tls-key-file "$tls/server.key"
        --tls-ca-cert-file "$tls/ca.pem" --tls-auth-clients no)
else
    touch "$datadir/plaintext"
    listen=(--port "$port")
fi

auth=()
if [[ "${APPORTION_REDIS_NOAUTH:-}" != 1 ]]; then
    (umask 077; bash "$(dirname "${BASH_SOURCE[0]}")/acl.sh" "$secrets" > "$datadir/users.acl")
    auth=(--aclfile "$datadir/users.acl")
fi

t0="$(date +%s%N)"
# the connection limits: limits.conf, the one file every Redis of the stack is started with
redis-server "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/limits.conf" "${listen[@]}" --bind 127.0.0.1 \
    --protected-mode yes --dir "$datadir" --save '' --appendonly "${REDIS_APPENDONLY:-no}" \
    --daemonize yes --pidfile "$pidfile" --logfile "$datadir/redis.log" "${auth[@]}"

ping() {  # PING with redis-cli (Debian's redis-tools, beside redis-server); an unauthenticated PING is NOAUTH
    local reply tls_args=()
    if [[ "$scheme" == rediss ]]; then tls_args=(--tls --cacert "$tls/ca.pem"); fi
    reply="$(redis-cli -h 127.0.0.1 -p "$port" "${tls_args[@]}" --no-auth-warning ping 2>&1)" || return 1
    [[ "$reply" == "PONG"* || "$reply" == "NOAUTH"* ]]
}
deadline=$(( $(date +%s) + ${REDIS_START_TIMEOUT:-20} ))
until ping 2>/dev/null; do
    if (( $(date +%s) >= deadline )); then
        echo "start.sh: redis did not answer PING on port $port; log:" >&2
        tail -n 20 "$datadir/redis.log" >&2
        exit 1
    fi
    sleep 0.05  # poll interval, bounded by the deadline
done
t1="$(date +%s%N)"
pid="$(cat "$pidfile")"
rss_kb="$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status")"
printf 'redis %s ready on 127.0.0.1:%s (pid %s) in %d ms, RSS %d MiB\n' \
    "$(redis-server --version | sed -n 's/.*v=\([^ ]*\).*/\1/p')" "$port" "$pid" \
    $(( (t1 - t0) / 1000000 )) $(( rss_kb / 1024 ))
echo "REDIS_URL=$scheme://127.0.0.1:$port/0"
if [[ ${#auth[@]} -gt 0 ]]; then echo "REDIS_SECRETS=$secrets"; fi
if [[ "$scheme" == rediss ]]; then echo "REDIS_TLS=$tls"; fi
