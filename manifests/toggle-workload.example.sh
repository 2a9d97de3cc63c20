#!/usr/bin/env bash
# Toggle disaggregation for ONE workload in production, two ways. An example: read it,
# set the variables, run the part you need. Needs kubectl; the second way also jq and yq (v4).
set -euo pipefail

NAMESPACE=${NAMESPACE:-default}
SERVICE=${SERVICE:-pdcluster-serve}   # rayservice.yaml's serveService
WORKLOAD=${WORKLOAD:-rag}

# --- 1. Live, through the admin API (any router replica; all routers have it within 2 s) --
# No restart, no dropped requests. Lasts until the next Serve config update: do step 2 too
# if the change should stay.
ADMIN_TOKEN=$(kubectl -n "$NAMESPACE" get secret pdcluster-secrets -o jsonpath='{.data.admin-token}' | base64 -d)
kubectl -n "$NAMESPACE" port-forward "svc/$SERVICE" 8000:8000 >/dev/null 2>&1 &
FORWARD_PID=$!
trap 'kill "$FORWARD_PID"' EXIT
sleep 2

curl -fsS -H "Authorization: Bearer $ADMIN_TOKEN" http://127.0.0.1:8000/admin/workloads

# A PUT replaces the whole profile: send every field.
curl -fsS -X PUT "http://127.0.0.1:8000/admin/workloads/$WORKLOAD" \
  -H "Authorization: Bearer $ADMIN_TOKEN" -H "Content-Type: application/json" \
  -d '{"mode": "local", "min_remote_prefill_tokens": 0, "max_prefill_queue": 8, "allow_client_override": false}'

# Check: new requests of this workload now answer x-pd-route: local, x-pd-reason: profile.
curl -sS -o /dev/null -D - http://127.0.0.1:8000/v1/completions -H "x-workload: $WORKLOAD" \
  -H "Content-Type: application/json" -d '{"model": "served-model", "prompt": "hello", "max_tokens": 4}' \
  | grep -i '^x-pd-'

# --- 2. Declaratively, through the RayService's serveConfigV2 ---------------------------
# Only the ControlPlane's user_config changes, which Serve applies in place by calling
# ControlPlane.reconfigure: a lightweight update, no replica restarts. (Changing `args`
# would roll every replica.) Commit the same edit to manifests/rayservice.yaml.
kubectl -n "$NAMESPACE" get rayservice pdcluster -o jsonpath='{.spec.serveConfigV2}' > /tmp/serve-config.yaml
yq -i "(.applications[0].deployments[] | select(.name == \"ControlPlane\") | .user_config.workloads.$WORKLOAD.mode) = \"local\"" /tmp/serve-config.yaml
kubectl -n "$NAMESPACE" patch rayservice pdcluster --type merge \
  -p "$(jq -n --rawfile config /tmp/serve-config.yaml '{spec: {serveConfigV2: $config}}')"
# KubeRay sends the new config to the running cluster; watch it apply:
kubectl -n "$NAMESPACE" describe rayservice pdcluster | grep -A3 -i 'ControlPlane'
