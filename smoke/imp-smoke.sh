#!/usr/bin/env bash
# Imp smoke test for a harmless job.
#
#   smoke/imp-smoke.sh --local
#       The whole runner lifecycle on this machine: a real API server (testenv), the GitHub simulator,
#       the Firecracker simulator, and Imp's own binaries. Each stage prints PASS or FAIL with the reason.
#   smoke/imp-smoke.sh --cluster [--namespace imp-system] [--pool-namespace default --pool imp]
#       Checks an installation on the current kubectl context: CRDs, operator, node agents, the pool's
#       conditions. Then run smoke/workflow.yaml in a repository the pool serves.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mode="" namespace="imp-system" pool_ns="default" pool="imp"
while (($#)); do
  case "$1" in
    --local) mode=local ;;
    --cluster) mode=cluster ;;
    --namespace) namespace="$2"; shift ;;
    --pool-namespace) pool_ns="$2"; shift ;;
    --pool) pool="$2"; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "imp-smoke: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$mode" ]] || { echo "imp-smoke: choose --local or --cluster (see --help)" >&2; exit 2; }

pass() { printf 'PASS  %s\n' "$*"; }
fail() { printf 'FAIL  %s\n' "$*" >&2; exit 1; }

if [[ "$mode" == cluster ]]; then
  kubectl version >/dev/null 2>&1 || fail "kubectl cannot reach the cluster of the current context"
  for crd in impvmclasses impnetworks impvms impvmrunnerpools; do
    kubectl get crd "$crd.imp.dev" >/dev/null 2>&1 || fail "CRD $crd.imp.dev missing: helm install the chart"
  done
  pass "CRDs installed"
  kubectl -n "$namespace" rollout status deploy -l app.kubernetes.io/component=operator --timeout=60s >/dev/null \
    || fail "operator Deployment in $namespace is not available"
  pass "operator available"
  ready=$(kubectl -n "$namespace" get ds -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].status.numberReady}')
  [[ "${ready:-0}" -gt 0 ]] || fail "no node agent is ready: label nodes imp/enabled=true"
  pass "$ready node agent(s) ready"
  cond=$(kubectl -n "$pool_ns" get imprp "$pool" -o jsonpath='{.status.conditions[?(@.type=="CredentialsValid")].status}' 2>/dev/null || true)
  [[ "$cond" == True ]] || fail "pool $pool_ns/$pool: CredentialsValid is '${cond:-unset}' (kubectl describe imprp $pool)"
  pass "pool $pool_ns/$pool has valid GitHub credentials"
  echo "Now run smoke/workflow.yaml (workflow_dispatch) in a repository the pool serves and watch: kubectl -n $pool_ns get impvm -w"
  exit 0
fi

# --local
work="$(mktemp -d /tmp/imp-smoke.XXXXXX)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

"$repo/testenv/build.sh" >/dev/null || fail "testenv build (testenv/build.sh)"
(cd "$repo" && cargo build -q -p imp-operator -p imp-node -p imp-testkit --bins) || fail "cargo build"
bin="${CARGO_TARGET_DIR:-$repo/target}/debug"
pass "binaries built"

"$bin/imp-testenv" up --dir "$work/cp" >"$work/testenv.out" 2>"$work/testenv.err" &
pids+=($!)
for _ in $(seq 1 300); do grep -q '^KUBECONFIG=' "$work/testenv.out" 2>/dev/null && break; sleep 0.2; done
grep -q '^KUBECONFIG=' "$work/testenv.out" || fail "control plane did not start: $(tail -5 "$work/testenv.err")"
export KUBECONFIG="$work/cp/kubeconfig"
kubectl() { "$repo/testenv/bin/kubectl" "$@"; }
pass "control plane up (etcd, kube-apiserver, kube-controller-manager) with Imp's CRDs"

kubectl apply -f "$repo/smoke/manifests/runner-pool.yaml" >/dev/null || fail "applying smoke/manifests/runner-pool.yaml"
pass "runner pool, class and network accepted by the API server"

IMP_HTTP_ADDR=127.0.0.1:0 IMP_NAMESPACE=default "$bin/imp-operator" >"$work/operator.log" 2>&1 &
op=$!
pids+=("$op")
sleep 2
if ! kill -0 "$op" 2>/dev/null; then
  fail "imp-operator exited: $(tail -3 "$work/operator.log")"
fi
fail "the operator runs, but the runner lifecycle stages (GitHub simulator job, runner VM boot, handoff, cleanup) are not wired into this smoke yet"
