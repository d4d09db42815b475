#!/bin/sh
# Entry point of a prefill pod: runs prefill_worker as one pipeline stage of
# its group, with --stage and, for stage 0, --peers (the names of stages
# 1..S-1). Extra arguments go to prefill_worker as they are.
#
# In a LeaderWorkerSet (deploy/kubernetes/base/prefill.yaml) the controller
# sets LWS_WORKER_INDEX (the stage: 0 on the leader) and LWS_LEADER_ADDRESS
# (prefill-<g>.prefill.<namespace>); stage i of group g is then
# prefill-<g>-<i>.<service>. Elsewhere (a StatefulSet per group) the stage is
# the ordinal ending $HOSTNAME and the peers <statefulset>-<i>.<service>.
#
#   PREFILL_STAGES       S, the group's stage count (required)
#   PDSERVE_STAGE        stage index (overrides both)
#   PREFILL_SERVICE      headless Service of the stages (default prefill)
#   PREFILL_STATEFULSET  StatefulSet name without LWS (default prefill)
#   PREFILL_PORT         every stage's gRPC port (default 50051)
#   PDSERVE_PEERS        stage 0's --peers, overriding the names (tests map
#                        them to loopback)
#   PDSERVE_BIN_DIR      where prefill_worker is (default: this script's
#                        folder, as in the image)
set -eu
stages="${PREFILL_STAGES:?PREFILL_STAGES is required}"
svc="${PREFILL_SERVICE:-prefill}"
port="${PREFILL_PORT:-50051}"
bin="${PDSERVE_BIN_DIR:-$(dirname "$0")}/prefill_worker"
if [ -n "${LWS_WORKER_INDEX:-}" ]; then
  stage="${PDSERVE_STAGE:-$LWS_WORKER_INDEX}"
  # The leader's own host name: prefill-<g>.
  prefix="${LWS_LEADER_ADDRESS%%.*}"
else
  stage="${PDSERVE_STAGE:-${HOSTNAME##*-}}"
  prefix="${PREFILL_STATEFULSET:-prefill}"
fi
if [ "$stage" = 0 ] && [ "$stages" -gt 1 ]; then
  peers="${PDSERVE_PEERS:-}"
  if [ -z "$peers" ]; then
    i=1
    while [ "$i" -lt "$stages" ]; do
      peers="${peers:+$peers,}${prefix}-${i}.${svc}:${port}"
      i=$((i + 1))
    done
  fi
  exec "$bin" --stage "$stage" --stages "$stages" --peers "$peers" "$@"
fi
exec "$bin" --stage "$stage" --stages "$stages" "$@"
