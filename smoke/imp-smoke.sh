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
# Runs "$@" every 0.5 s until it succeeds, for at most $1 seconds.
wait_for() { local secs=$1; shift; for _ in $(seq 1 $((secs * 2))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done; return 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

"$repo/testenv/build.sh" >/dev/null || fail "testenv build (testenv/build.sh)"
(cd "$repo" && cargo build -q -p imp-operator -p imp-node -p imp-testkit --bins) || fail "cargo build"
bin="${CARGO_TARGET_DIR:-$repo/target}/debug"
pass "binaries built"

"$bin/imp-testenv" up --dir "$work/cp" >"$work/testenv.out" 2>"$work/testenv.err" &
pids+=($!)
wait_for 60 grep -q '^KUBECONFIG=' "$work/testenv.out" || fail "control plane did not start: $(tail -5 "$work/testenv.err")"
export KUBECONFIG="$work/cp/kubeconfig"
kubectl() { "$repo/testenv/bin/kubectl" "$@"; }
pass "control plane up (etcd, kube-apiserver, kube-controller-manager) with Imp's CRDs"

op_port=$(free_port)
"$bin/github-sim" --org acme --repo acme/app --secret-dir "$work/app" --webhook-url "http://127.0.0.1:$op_port/webhooks/github" \
  >"$work/sim.out" 2>"$work/sim.err" &
pids+=($!)
wait_for 20 grep -q '^http' "$work/sim.out" || fail "GitHub simulator did not start: $(tail -3 "$work/sim.err")"
sim=$(head -1 "$work/sim.out")
pass "GitHub simulator at $sim (App key and ids written for the Secret)"

kubectl create secret generic imp-github-app --from-file="$work/app/app-id" \
  --from-file="$work/app/installation-id" --from-file="$work/app/private-key" >/dev/null
kubectl create secret generic imp-webhook --from-literal=webhook-secret=imp-sim-webhook-secret >/dev/null
kubectl apply -f "$repo/smoke/manifests/runner-pool.yaml" >/dev/null || fail "applying smoke/manifests/runner-pool.yaml"
pass "GitHub App Secret, webhook Secret, class, network and runner pool accepted by the API server"

IMP_HTTP_ADDR="127.0.0.1:$op_port" IMP_NAMESPACE=default IMP_WEBHOOK_SECRET_NAME=imp-webhook \
  IMP_GITHUB_API_URL="$sim" "$bin/imp-operator" >"$work/operator.log" 2>&1 &
pids+=($!)
wait_for 30 curl -sf "http://127.0.0.1:$op_port/readyz" || fail "imp-operator not ready: $(tail -3 "$work/operator.log")"
pass "imp-operator ready (ImpVM controller, runner-pool controller, webhook receiver)"

# minIdle 1: one runner VM with a one-time JIT config Secret owned by it, registered at the simulator.
minted_vm() { kubectl get impvm -l imp.dev/runner-pool=imp -o jsonpath='{.items[?(@.spec.runnerConfigSecret)].metadata.name}' | grep -q .; }
wait_for 30 minted_vm || fail "no runner VM with a JIT Secret: $(kubectl describe imprp imp | tail -5)"
vm=$(kubectl get impvm -l imp.dev/runner-pool=imp -o jsonpath='{.items[?(@.spec.runnerConfigSecret)].metadata.name}' | cut -d' ' -f1)
secret=$(kubectl get impvm "$vm" -o jsonpath='{.spec.runnerConfigSecret}')
owner=$(kubectl get secret "$secret" -o jsonpath='{.metadata.ownerReferences[0].name}')
[[ "$owner" == "$vm" ]] || fail "JIT Secret $secret is owned by '$owner', not by $vm"
curl -sf "$sim/_admin/runners" | grep -q '"name"' || fail "no runner registered at the GitHub simulator"
pass "runner VM $vm with JIT Secret $secret (owned by the VM; runner registered at GitHub)"

curl -sf -X POST -H 'content-type: application/json' -d '{"labels":["self-hosted","imp"]}' "$sim/_admin/jobs" >/dev/null \
  || fail "queueing a job at the simulator"
accepted() { curl -sf "http://127.0.0.1:$op_port/metrics" | grep -E '^imp_webhook_deliveries_total\{result="accepted"\} [1-9]'; }
wait_for 20 accepted || fail "the queued workflow_job webhook was not accepted: $(grep -i webhook "$work/operator.log" | tail -3)"
pass "job queued with labels [self-hosted, imp]; signed workflow_job webhook accepted by the operator"

# A node as the scheduler sees it: labelled, Ready, untainted, with a fresh agent heartbeat Lease.
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
kubectl apply -f - >/dev/null <<NODE
apiVersion: v1
kind: Node
metadata:
  name: smoke-node
  labels: {imp/enabled: "true"}
---
apiVersion: coordination.k8s.io/v1
kind: Lease
metadata:
  name: imp-node-smoke-node
spec:
  holderIdentity: smoke-node
  renewTime: "$(date -u +%Y-%m-%dT%H:%M:%S.000000Z)"
NODE
kubectl patch node smoke-node --type=json -p '[{"op":"replace","path":"/spec/taints","value":[]}]' >/dev/null
kubectl patch node smoke-node --subresource=status --type=merge -p '{"status":{"allocatable":{"cpu":"8","memory":"16Gi"},"capacity":{"cpu":"8","memory":"16Gi"},"conditions":[{"type":"Ready","status":"True","reason":"KubeletReady","message":"smoke","lastHeartbeatTime":"'"$now"'","lastTransitionTime":"'"$now"'"}]}}' >/dev/null
bound() { [[ "$(kubectl get impvm "$vm" -o jsonpath='{.spec.nodeName}')" == smoke-node ]]; }
wait_for 30 bound || fail "runner VM $vm not scheduled: $(kubectl get impvm "$vm" -o jsonpath='{.status.conditions}')"
pass "runner VM $vm scheduled onto smoke-node (phase $(kubectl get impvm "$vm" -o jsonpath='{.status.phase}'))"

fail "the next stage needs imp-agent, which is not built: nothing boots $vm on the node and hands it its runner config (imp-runtime and the Firecracker simulator exist: docs/runtime.md)"
