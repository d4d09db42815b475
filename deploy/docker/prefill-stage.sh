#!/bin/sh
# Entry point of a prefill StatefulSet pod: the pod ordinal is the stage
# index, and stage 0 chains the group through the headless Service's stable
# names of stages 1..S-1 (prefill-1.prefill:50051, ...). Extra arguments go
# to prefill_worker as they are.
#
#   PDSERVE_STAGE        stage index (default: the ordinal ending $HOSTNAME)
#   PREFILL_STAGES       S, the group's stage count (required)
#   PREFILL_STATEFULSET  StatefulSet name (default prefill)
#   PREFILL_SERVICE      headless Service name (default prefill)
#   PREFILL_PORT         every stage's gRPC port (default 50051)
#   PDSERVE_PEERS        stage 0's --peers, overriding the DNS names (tests
#                        map them to loopback)
#   PDSERVE_BIN_DIR      where prefill_worker is (default: this script's
#                        folder, as in the image)
set -eu
stage="${PDSERVE_STAGE:-${HOSTNAME##*-}}"
stages="${PREFILL_STAGES:?PREFILL_STAGES is required}"
sts="${PREFILL_STATEFULSET:-prefill}"
svc="${PREFILL_SERVICE:-prefill}"
port="${PREFILL_PORT:-50051}"
bin="${PDSERVE_BIN_DIR:-$(dirname "$0")}/prefill_worker"
if [ "$stage" = 0 ] && [ "$stages" -gt 1 ]; then
  peers="${PDSERVE_PEERS:-}"
  if [ -z "$peers" ]; then
    i=1
    while [ "$i" -lt "$stages" ]; do
      peers="${peers:+$peers,}${sts}-${i}.${svc}:${port}"
      i=$((i + 1))
    done
  fi
  exec "$bin" --stage "$stage" --stages "$stages" --peers "$peers" "$@"
fi
exec "$bin" --stage "$stage" --stages "$stages" "$@"
