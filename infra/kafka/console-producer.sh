#!/usr/bin/env bash
# Kafka's console producer, as the release tarball's bin/kafka-console-producer.sh runs it
# (org.apache.kafka.tools.ConsoleProducer from the kafka-tools jar), on the jars `make kafka-jars` fetched.
# Every argument goes to the tool; see `infra/kafka/console-producer.sh --help` and docs/producing.md:
#
#   infra/kafka/console-producer.sh --bootstrap-server 127.0.0.1:9092 --topic apportion.submissions \
#       --property parse.key=true --property key.separator='|' < jobs.txt     # one "job_id|{json}" per line
#
# Tool logs (WARN and above) go to stderr. KAFKA_HEAP_OPTS overrides the heap (default 64-256 MB).
# APPORTION_KAFKA_TOOL names another main class of the same jars (console-consumer.sh sets it).
#
# TLS (docs/security.md): with APPORTION_TLS_CA set (the CA file of stack.env; the test fixtures set it), the
# tool trusts that CA (ssl.truststore.type=PEM) and verifies the broker's host name, as every apportion client
# does. Sign in with a properties file (--producer.config / --consumer.config FILE) holding
# security.protocol=SASL_SSL, sasl.mechanism=SCRAM-SHA-512 and sasl.jaas.config (the password stays in the
# file, never on a command line).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/pom.xml")"
# a lib/ fetched before the pom listed kafka-tools is fetched again (as start.sh fetches a missing lib/)
[[ -f "$here/lib/kafka-tools-${version}.jar" ]] || "$here/fetch.sh" >&2
command -v java >/dev/null || { echo "console-producer.sh: Java 17+ is required" >&2; exit 1; }
tool="${APPORTION_KAFKA_TOOL:-org.apache.kafka.tools.ConsoleProducer}"
trust=()
if [[ -n "${APPORTION_TLS_CA:-}" ]]; then
    flag=--producer-property
    if [[ "$tool" == *ConsoleConsumer ]]; then flag=--consumer-property; fi
    trust=("$flag" ssl.truststore.type=PEM "$flag" "ssl.truststore.location=$APPORTION_TLS_CA")
fi
# shellcheck disable=SC2086  # KAFKA_HEAP_OPTS is a list of JVM options
exec java ${KAFKA_HEAP_OPTS:--Xms64m -Xmx256m} -XX:+UseSerialGC -XX:TieredStopAtLevel=1 \
    -Dlog4j2.configurationFile="$here/tools-log4j2.properties" \
    -cp "$here/lib/*" "$tool" "$@" "${trust[@]}"
