#!/usr/bin/env bash
# Fetch the Apache Kafka broker and console-tool jars from Maven Central into infra/kafka/lib/.
# Idempotent: does nothing when lib/ already holds the version the pom names.
# Needs Maven (apt-get install maven) and Java 17+.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' pom.xml)"
# the broker and the console tools (kafka-tools, added later: an older lib/ without it is fetched again)
if [[ -f "lib/kafka_2.13-${version}.jar" && -f "lib/kafka-tools-${version}.jar" && -f lib/.complete ]]; then
    echo "kafka ${version} jars already in ${here}/lib"
    exit 0
fi
command -v mvn >/dev/null || { echo "fetch.sh: Maven (mvn) is required: apt-get install maven" >&2; exit 1; }

rm -rf lib
mvn -q -B -Dstyle.color=never dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory=lib
touch lib/.complete
echo "kafka ${version}: $(ls lib/*.jar | wc -l) jars in ${here}/lib"
