#!/usr/bin/env bash
# Make an apportion signing identity (rule D10.proven-user) once, with openssl: FILE (the identity file
# `apportion keys init` writes: user, role, the base64 raw Ed25519 public key and 32-byte seed) and PUBLIC
# (the same without the private key, for provisioning to register). Mode MODE (default 0600; 0644 for a
# file a container must read, in a directory of mode 0700). An existing FILE is kept (rotate by deleting it,
# then have ops revoke the old key). `created` is the key's registration time (provision --register-keys).
#
#   infra/signing-key.sh FILE PUBLIC USER ROLE [MODE]
set -euo pipefail
if [[ $# -lt 4 || $# -gt 5 ]]; then
    echo "usage: $0 FILE PUBLIC USER ROLE [MODE]" >&2
    exit 64
fi
file="$1" public="$2" user="$3" role="$4" mode="${5:-0600}"
(umask 077; mkdir -p "$(dirname "$file")" "$(dirname "$public")")
if [[ ! -s "$file" ]]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    openssl genpkey -algorithm ed25519 -outform DER -out "$tmp/k.der" 2>/dev/null
    seed="$(tail -c 32 "$tmp/k.der" | base64 -w0)"  # a PKCS#8 Ed25519 key ends with its 32-byte seed
    pub="$(openssl pkey -inform DER -in "$tmp/k.der" -pubout -outform DER | tail -c 32 | base64 -w0)"
    created="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    (umask 077; printf '{"user": "%s", "role": "%s", "public_key": "%s", "private_key": "%s", "created": "%s"}\n' \
        "$user" "$role" "$pub" "$seed" "$created" > "$file.tmp")
    mv "$file.tmp" "$file"
fi
chmod "$mode" "$file"
# the public half, derived from FILE every time (so it always matches)
python3 - "$file" "$public" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
out = {k: doc[k] for k in ("user", "role", "public_key", "created")}
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
    f.write("\n")
PY
chmod 0644 "$public"
