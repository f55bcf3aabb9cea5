#!/usr/bin/env bash
# The system packages the test suite needs, installed from Debian's packages when missing.
#
#   infra/prereqs.sh          install what is missing (as root), or name it and exit 1
#   infra/prereqs.sh --check  only name what is missing (exit 1 when something is)
#
# redis-server, Java and Maven (the Kafka broker), make, python3-venv, Debian's chromium with its
# chromedriver (the dashboard's browser tests) and Node.js (docs/producing.md's JavaScript example).
# `make test` and `.ci/run` both call it, so the README's test command works on a fresh machine.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || missing+=(maven)
command -v make >/dev/null || missing+=(make)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
[[ -x /usr/bin/chromium ]] || missing+=(chromium)
[[ -x /usr/bin/chromedriver ]] || missing+=(chromium-driver)
command -v node >/dev/null || missing+=(nodejs)

((${#missing[@]})) || exit 0
if [[ "${1:-}" == --check ]]; then
    echo "missing system packages: ${missing[*]} (install: sudo apt-get install -y ${missing[*]})" >&2
    exit 1
fi
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "missing system packages: ${missing[*]}; run as root on Debian/Ubuntu, or: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
echo "--- apt-get install ${missing[*]}"
apt-get update -q
apt-get install -y -q "${missing[@]}"
