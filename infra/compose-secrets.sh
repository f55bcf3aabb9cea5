#!/usr/bin/env bash
# Make the secrets docker-compose.yml mounts (docker secrets), once, in DIR (default .secrets, git- and
# docker-ignored):
#
#   DIR/kafka/<name>.password   admin and controller (the super users every broker is started with), and one
#                               per principal of apportion.bus.security.PRINCIPALS (provisioning creates
#                               their SCRAM users from these files; each service reads its own)
#   DIR/redis/users.acl         the Redis ACL file (infra/redis/acl.sh) and DIR/redis/<user>.password
#   DIR/grafana/admin.password  Grafana's admin password
#   DIR/keys/                   signing identities (infra/signing-key.sh, rule D10.proven-user): dispatcher.json
#                               (service:dispatcher, signs every decision), nodes/<id>/<id>.json (node:<id>, one
#                               per node agent of docker-compose.yml, signs its reports), ops.json (role ops, for
#                               the operator's CLI: APPORTION_IDENTITY=DIR/keys/ops.json); DIR/keys/public/ their
#                               public halves, which the provision container registers (--register-keys)
#   DIR/tls/                    the local CA and the servers' certificate (apportion.bus.tls, through
#                               infra/tls.sh): ca.pem (every client's APPORTION_TLS_CA), server.pem, server.key,
#                               keystore.pem (Kafka's) for the compose service names, localhost and 127.0.0.1;
#                               ca.key (mode 0600) is mounted nowhere.  Bring your own CA: put its ca.pem and a
#                               server.pem/server.key/keystore.pem it issued for those names there first
#
# Files are mode 0644 so a container's user can read its bind-mounted secret; the directories are 0700, so
# other users of the host cannot.  Idempotent: existing passwords are kept (rotate by deleting a file, then
# `docker compose up --force-recreate`).  Nothing here is ever written to the repository.
#
#   infra/compose-secrets.sh [DIR]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="${1:-$here/../.secrets}"
mkdir -p "$dir"
chmod 0700 "$dir"
pw="$here/password.sh"
# the Kafka principals (apportion.bus.security.PRINCIPALS; tests/unit/test_compose.py checks they agree)
for name in admin controller dispatcher accounting policy node-agent researcher ops web; do
    bash "$pw" "$dir/kafka" "$name" 0644 > /dev/null
done
# one Kafka principal per node agent (apportion.bus.security.node_agent_principal; APPORTION_KAFKA_NODE_AGENTS
# of the provision service declares the same names)
for agent in node-1 node-2 node-3; do
    bash "$pw" "$dir/kafka" "node-agent.$agent" 0644 > /dev/null
done
mkdir -p "$dir/redis"
bash "$here/redis/acl.sh" "$dir/redis" 0644 > "$dir/redis/users.acl.tmp"
mv "$dir/redis/users.acl.tmp" "$dir/redis/users.acl"
chmod 0644 "$dir/redis/users.acl"
bash "$pw" "$dir/grafana" admin 0644 > /dev/null
key="$here/signing-key.sh"
bash "$key" "$dir/keys/dispatcher.json" "$dir/keys/public/dispatcher.json" service:dispatcher user 0644
# the node agents of docker-compose.yml (APPORTION_NODE_ID; tests/unit/test_compose.py checks they agree)
for node in node-1 node-2 node-3; do
    bash "$key" "$dir/keys/nodes/$node/$node.json" "$dir/keys/public/node-$node.json" "node:$node" user 0644
done
bash "$key" "$dir/keys/ops.json" "$dir/keys/public/ops.json" ops ops 0600
# the names clients reach the servers by: the compose services (Kafka's nodes, Redis, the dashboard), and the host
bash "$here/tls.sh" "$dir/tls" --mode 0644 --host kafka-1 --host kafka-2 --host kafka-3 --host redis --host web \
    > /dev/null
chmod 0700 "$dir/kafka" "$dir/redis" "$dir/grafana" "$dir/tls" "$dir/keys" "$dir/keys/public" "$dir/keys/nodes" "$dir/keys/nodes/"*
echo "secrets in $dir (Kafka principals, Redis ACL users, Grafana admin, signing keys, TLS CA and certificate);" \
    "next: docker compose up --build"
