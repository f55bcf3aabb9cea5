#!/usr/bin/env bash
# Print NAME's password from DIR/NAME.password, making it once (32 random bytes, hex; the file mode 0600,
# or MODE, e.g. 0644 for files a container must read, in a directory of mode 0700).  One home for how
# apportion's infrastructure passwords are made: infra/kafka/start.sh, infra/redis/acl.sh and
# infra/compose-secrets.sh use it (apportion.bus.security.password_of is the same rule in Python).
#
#   infra/password.sh DIR NAME [MODE]
set -euo pipefail
if [[ $# -lt 2 || $# -gt 3 ]]; then
    echo "usage: $0 DIR NAME [MODE]" >&2
    exit 64
fi
dir="$1" name="$2" mode="${3:-0600}"
if [[ ! -s "$dir/$name.password" ]]; then
    (umask 077; mkdir -p "$dir"; python3 -c 'import secrets; print(secrets.token_hex(32))' > "$dir/$name.password.tmp")
    mv "$dir/$name.password.tmp" "$dir/$name.password"
fi
chmod "$mode" "$dir/$name.password"
cat "$dir/$name.password"
