#!/usr/bin/env bash
# Create (or keep) the Secret tensorbus-nats-credentials: one password per role,
# keys gateway, scheduler, worker, telemetry, batch, deploy, client. The NATS server
# (helm-values.yaml) and every tensorbus pod read it; each pod only its own key.
#
#   deploy/k8s/make-secrets.sh [NAMESPACE]        (default: tensorbus)
#
# An existing Secret is left alone, so re-running never rotates passwords under
# running pods. To rotate: delete it, re-run, `helm upgrade` nats, restart pods.
set -euo pipefail
ns=${1:-tensorbus}
name=tensorbus-nats-credentials
here=$(cd "$(dirname "$0")" && pwd)

if kubectl -n "$ns" get secret "$name" >/dev/null 2>&1; then
  echo "secret $ns/$name exists; leaving it as it is"
  exit 0
fi
kubectl get namespace "$ns" >/dev/null 2>&1 || kubectl create namespace "$ns"
args=()
while IFS='=' read -r var value; do
  role=${var#TENSORBUS_NATS_PASS_}
  args+=("--from-literal=${role,,}=$value")
done < <("$here/../nats/make-passwords.sh")
kubectl -n "$ns" create secret generic "$name" "${args[@]}"
echo "created secret $ns/$name"
