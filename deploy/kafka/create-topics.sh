#!/usr/bin/env bash
# Creates surge's topics (DESIGN.md "Topics") if they do not exist. Idempotent; run once per cluster
# before the workers start (compose's `topics` service runs it; deploy/k8s/topics-job.yaml runs the
# same commands). Faust creates its changelog topics itself.
#   BOOTSTRAP   broker address, host:port                 (default kafka:9092)
#   PREFIX      topic prefix, must equal SURGE_TOPIC_PREFIX (default surge.)
#   PARTITIONS  partitions per topic, must equal SURGE_PARTITIONS (default 8)
#   REPLICATION replication factor                         (default 1)
#   COMMAND_CONFIG  client properties of a secured cluster (security.protocol, sasl.*, ssl.*), optional
set -euo pipefail
BOOTSTRAP="${BOOTSTRAP:-kafka:9092}"
PREFIX="${PREFIX:-surge.}"
PARTITIONS="${PARTITIONS:-8}"
REPLICATION="${REPLICATION:-1}"
KAFKA_TOPICS="${KAFKA_TOPICS:-/opt/kafka/bin/kafka-topics.sh}"
AUTH=()
if [[ -n "${COMMAND_CONFIG:-}" ]]; then
  AUTH=(--command-config "$COMMAND_CONFIG")
fi

create() {  # create NAME [--config k=v ...]
  local name="$1"
  shift
  "$KAFKA_TOPICS" --bootstrap-server "$BOOTSTRAP" "${AUTH[@]}" --create --if-not-exists \
    --topic "${PREFIX}${name}" --partitions "$PARTITIONS" --replication-factor "$REPLICATION" "$@"
}

# retention: requests and work 1 day, replies 1 day, dead letters 14 days, risk 7 days
create requests          --config retention.ms=86400000 --config message.timestamp.type=LogAppendTime --config compression.type=uncompressed
create work.realtime     --config retention.ms=86400000
create work.interactive  --config retention.ms=86400000
create work.batch        --config retention.ms=86400000
create work.offline      --config retention.ms=86400000
create replies           --config retention.ms=86400000
create deadletter        --config retention.ms=1209600000
create risk.events       --config retention.ms=604800000 --config compression.type=uncompressed
create risk.decisions    --config retention.ms=604800000
create risk.late         --config retention.ms=604800000
create risk.rules        --config cleanup.policy=compact

"$KAFKA_TOPICS" --bootstrap-server "$BOOTSTRAP" "${AUTH[@]}" --list | grep -F "$PREFIX" || true
