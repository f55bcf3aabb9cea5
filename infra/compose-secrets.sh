#!/usr/bin/env bash
# Make the secrets docker-compose.yml mounts (docker secrets), once, in DIR (default .secrets, git- and
# docker-ignored):
#
#   DIR/kafka/<name>.password   admin and controller (the super users every broker is started with), and one
#                               per principal of apportion.bus.security.PRINCIPALS (provisioning creates
#                               their SCRAM users from these files; each service reads its own)
#   DIR/redis/users.acl         the Redis ACL file (infra/redis/acl.sh) and DIR/redis/<user>.password
#   DIR/grafana/admin.password  Grafana's admin password
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
mkdir -p "$dir/redis"
bash "$here/redis/acl.sh" "$dir/redis" 0644 > "$dir/redis/users.acl.tmp"
mv "$dir/redis/users.acl.tmp" "$dir/redis/users.acl"
chmod 0644 "$dir/redis/users.acl"
bash "$pw" "$dir/grafana" admin 0644 > /dev/null
chmod 0700 "$dir/kafka" "$dir/redis" "$dir/grafana"
echo "secrets in $dir (Kafka principals, Redis ACL users, Grafana admin); next: docker compose up --build"
