#!/usr/bin/env bash
# Print apportion's Redis ACL file (users and what each may do), the passwords made once in SECRETS_DIR
# (infra/password.sh; MODE as there).  The one declaration of Redis users: infra/redis/start.sh, the compose
# secrets (infra/compose-secrets.sh) and the testcontainers fixture (apportion.bus.containers) use it.
#
#   infra/redis/acl.sh SECRETS_DIR [MODE] > users.acl
#
# The default user is off; admin may do anything (provisioning, tests); dispatcher and accounting may run any
# non-dangerous command on apportion's keys (*apportion:*); cli (the CLI) may only read them; web (the
# dashboard) may only read the read models (*apportion:rm:*).
set -euo pipefail
if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 SECRETS_DIR [MODE]" >&2
    exit 64
fi
pw="$(dirname "${BASH_SOURCE[0]}")/../password.sh"
secrets="$1" mode="${2:-0600}"
echo "user default off"
echo "user admin on >$(bash "$pw" "$secrets" admin "$mode") ~* &* +@all"
echo "user dispatcher on >$(bash "$pw" "$secrets" dispatcher "$mode") ~*apportion:* +@all -@dangerous"
echo "user accounting on >$(bash "$pw" "$secrets" accounting "$mode") ~*apportion:* +@all -@dangerous"
echo "user cli on >$(bash "$pw" "$secrets" cli "$mode") ~*apportion:* -@all +@read +@connection"
echo "user web on >$(bash "$pw" "$secrets" web "$mode") ~*apportion:rm:* -@all +@read +@connection"
