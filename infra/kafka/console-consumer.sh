#!/usr/bin/env bash
# Kafka's console consumer, as the release tarball's bin/kafka-console-consumer.sh runs it
# (org.apache.kafka.tools.consumer.ConsoleConsumer from the kafka-tools jar), on the jars `make kafka-jars` fetched.
# Every argument goes to the tool; docs/producing.md shows how to read a job's verdict with it:
#
#   infra/kafka/console-consumer.sh --bootstrap-server 127.0.0.1:9092 --topic apportion.jobs \
#       --from-beginning --isolation-level read_committed --property print.key=true --timeout-ms 5000
#
# (read_committed: the dispatcher writes in transactions; a deposed leader's aborted records stay in the log)
#
# Tool logs (WARN and above) go to stderr. KAFKA_HEAP_OPTS overrides the heap (default 64-256 MB).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec env APPORTION_KAFKA_TOOL=org.apache.kafka.tools.consumer.ConsoleConsumer "$here/console-producer.sh" "$@"
