#!/usr/bin/env bash
# Start one Kafka node inside the official apache/kafka image the way start.sh starts it natively:
# server.properties.template + security.properties.template (SASL_SSL: TLS with SCRAM-SHA-512, ACLs with
# KRaft's StandardAuthorizer, admin and controller super users), formatted once with admin's SCRAM credential,
# then listeners for the container network, every one SASL_SSL.  Used by docker-compose.yml (three nodes) and by the
# testcontainers fixture (apportion.bus.containers, one node); mounted read-only with infra/kafka at
# /opt/apportion/kafka.  Not run on the development machines (no Docker engine): tests/unit/test_compose.py
# and tests/unit/test_containers.py render and check what it writes (KAFKA_RENDER_ONLY=1).
#
# Environment:
#   KAFKA_NODE_ID            this node's id (default 1)
#   KAFKA_QUORUM_VOTERS      id@host:9093,... (default 1@localhost:9093)
#   KAFKA_REPLICATION        replicas of the internal topics and by default (min.insync.replicas one less)
#   KAFKA_CLUSTER_ID         the cluster id (base64 UUID; the same on every node)
#   KAFKA_ADVERTISED         host:port other containers reach this node at (default localhost:9092)
#   KAFKA_HOST_ADVERTISED    host:port the host reaches the HOST listener (:29092) at; empty: no HOST listener
#   KAFKA_ADMIN_PASSWORD_FILE, KAFKA_CONTROLLER_PASSWORD_FILE   the super users' passwords (secrets)
#   KAFKA_TLS_KEYSTORE_FILE  the server's key and certificate chain, PEM (apportion.bus.tls's keystore.pem)
#   KAFKA_TLS_CA_FILE        the CA the nodes verify each other with (ca.pem)
#   KAFKA_DATA_DIR           log dirs (default /var/lib/kafka/data); KAFKA_CONFIG the file written
#                            (default /tmp/apportion-server.properties, mode 0600)
#   KAFKA_RENDER_ONLY=1      write the configuration and stop (the tests)
set -euo pipefail
umask 077  # the configuration holds the super users' passwords
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
kafka_home="${KAFKA_HOME:-/opt/kafka}"
node_id="${KAFKA_NODE_ID:-1}"
voters="${KAFKA_QUORUM_VOTERS:-1@localhost:9093}"
rf="${KAFKA_REPLICATION:-1}"
min_isr=$(( rf > 1 ? rf - 1 : 1 ))
data="${KAFKA_DATA_DIR:-/var/lib/kafka/data}"
props="${KAFKA_CONFIG:-/tmp/apportion-server.properties}"
advertised="${KAFKA_ADVERTISED:-localhost:9092}"
: "${KAFKA_CLUSTER_ID:?set KAFKA_CLUSTER_ID (a base64 UUID, the same on every node)}"
admin_pw="$(cat "${KAFKA_ADMIN_PASSWORD_FILE:?set KAFKA_ADMIN_PASSWORD_FILE}")"
controller_pw="$(cat "${KAFKA_CONTROLLER_PASSWORD_FILE:?set KAFKA_CONTROLLER_PASSWORD_FILE}")"
keystore="${KAFKA_TLS_KEYSTORE_FILE:?set KAFKA_TLS_KEYSTORE_FILE}"
ca="${KAFKA_TLS_CA_FILE:?set KAFKA_TLS_CA_FILE}"

listeners="SASL_SSL://0.0.0.0:9092,CONTROLLER://0.0.0.0:9093"
adv="SASL_SSL://$advertised"
protocols="CONTROLLER:SASL_SSL,SASL_SSL:SASL_SSL"
if [[ -n "${KAFKA_HOST_ADVERTISED:-}" ]]; then
    listeners+=",HOST://0.0.0.0:29092"
    adv+=",HOST://$KAFKA_HOST_ADVERTISED"
    protocols+=",HOST:SASL_SSL"
fi
(
    sed -e "s|@PORT@|9092|g" -e "s|@CONTROLLER_PORT@|9093|g" -e "s|@LOG_DIR@|$data|g" \
        -e "s|@NODE_ID@|$node_id|g" -e "s|@VOTERS@|$voters|g" -e "s|@RF@|$rf|g" -e "s|@MIN_ISR@|$min_isr|g" \
        "$here/server.properties.template"
    sed -e "s|@PORT@|9092|g" -e "s|@CONTROLLER_PORT@|9093|g" -e "s|@ADMIN_PASSWORD@|$admin_pw|g" \
        -e "s|@CONTROLLER_PASSWORD@|$controller_pw|g" -e "s|@TLS_KEYSTORE@|$keystore|g" -e "s|@TLS_CA@|$ca|g" \
        "$here/security.properties.template"
    echo
    echo "# The container's listeners (container-start.sh): every one SASL_SSL; later lines win."
    echo "listeners=$listeners"
    echo "advertised.listeners=$adv"
    echo "listener.security.protocol.map=$protocols"
    if [[ -n "${KAFKA_HOST_ADVERTISED:-}" ]]; then
        echo "listener.name.host.sasl.enabled.mechanisms=SCRAM-SHA-512"
        echo "listener.name.host.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;"
    fi
) > "$props"
# what the healthcheck connects with (kafka-broker-api-versions.sh --command-config)
(
    echo "security.protocol=SASL_SSL"
    echo "ssl.truststore.type=PEM"
    echo "ssl.truststore.location=$ca"
    echo "sasl.mechanism=SCRAM-SHA-512"
    echo "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username=\"admin\" password=\"$admin_pw\";"
) > "${props%.properties}-admin-client.properties"
if [[ "${KAFKA_RENDER_ONLY:-}" == 1 ]]; then
    exit 0
fi
"$kafka_home/bin/kafka-storage.sh" format --cluster-id="$KAFKA_CLUSTER_ID" --config="$props" --ignore-formatted \
    --add-scram "SCRAM-SHA-512=[name=admin,password=$admin_pw]"
exec "$kafka_home/bin/kafka-server-start.sh" "$props"
