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
passed=0
# Logs (operator, agent, runtime, registry, GitHub simulator) are kept when a stage fails.
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ $passed == 1 ]]; then rm -rf "$work"; else echo "imp-smoke: logs kept in $work" >&2; fi
}
trap cleanup EXIT
# Runs "$@" every 0.5 s until it succeeds, for at most $1 seconds.
wait_for() { local secs=$1; shift; for _ in $(seq 1 $((secs * 2))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done; return 1; }
# IMP_SMOKE_TARGETS_DIR (helm/monitoring-test.py): each process's metrics endpoint is written there as a
# Prometheus file_sd target before it starts, and the processes stay up until a file `release` appears.
target() {
  [[ -n "${IMP_SMOKE_TARGETS_DIR:-}" ]] || return 0
  printf '[{"targets":["%s"],"labels":{"job":"%s","namespace":"imp-system"%s}}]\n' "$2" "$1" "${3:+,\"node\":\"$3\"}" \
    >"$IMP_SMOKE_TARGETS_DIR/.$1" && mv "$IMP_SMOKE_TARGETS_DIR/.$1" "$IMP_SMOKE_TARGETS_DIR/$1.json"
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

"$repo/testenv/build.sh" >/dev/null || fail "testenv build (testenv/build.sh)"
(cd "$repo" && cargo build -q -p imp-operator -p imp-node -p imp-testkit -p imp-guest --bins) || fail "cargo build"
bin="${CARGO_TARGET_DIR:-$repo/target}/debug"
pass "binaries built"

"$bin/imp-testenv" up --dir "$work/cp" >"$work/testenv.out" 2>"$work/testenv.err" &
pids+=($!)
wait_for 60 grep -q '^KUBECONFIG=' "$work/testenv.out" || fail "control plane did not start: $(tail -5 "$work/testenv.err")"
export KUBECONFIG="$work/cp/kubeconfig"
kubectl() { "$repo/testenv/bin/kubectl" "$@"; }
pass "control plane up (etcd, kube-apiserver, kube-controller-manager) with Imp's CRDs"

op_port=$(free_port)
target imp-operator "127.0.0.1:$op_port"
"$bin/github-sim" --org acme --repo acme/app --secret-dir "$work/app" --webhook-url "http://127.0.0.1:$op_port/webhooks/github" \
  >"$work/sim.out" 2>"$work/sim.err" &
pids+=($!)
wait_for 20 grep -q '^http' "$work/sim.out" || fail "GitHub simulator did not start: $(tail -3 "$work/sim.err")"
sim=$(head -1 "$work/sim.out")
pass "GitHub simulator at $sim (App key and ids written for the Secret)"

kubectl create secret generic imp-github-app --from-file="$work/app/app-id" \
  --from-file="$work/app/installation-id" --from-file="$work/app/private-key" >/dev/null
kubectl create secret generic imp-webhook --from-literal=webhook-secret=imp-sim-webhook-secret >/dev/null
# The pool's images, served by a local registry (Debian's docker-registry) for imp-runtime's rootfs cache.
command -v docker-registry >/dev/null || fail "docker-registry not on PATH (Debian package docker-registry)"
reg_port=$(free_port)
printf 'version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: 127.0.0.1:%s\n' \
  "$work/registry" "$reg_port" >"$work/registry.yml"
docker-registry serve "$work/registry.yml" >"$work/registry.log" 2>&1 &
pids+=($!)
wait_for 15 curl -sf "http://127.0.0.1:$reg_port/v2/" || fail "docker-registry did not start: $(tail -3 "$work/registry.log")"
base_img=$("$bin/imp-push-image" "127.0.0.1:$reg_port" imp-dev/runner-base:smoke etc/imp-smoke=base) \
  || fail "pushing the base image to the local registry: $(tail -3 "$work/registry.log")"
runner_img=$("$bin/imp-push-image" "127.0.0.1:$reg_port" imp-dev/actions-runner:smoke opt/runner/VERSION=smoke) \
  || fail "pushing the runner image to the local registry"
pass "images pushed to a local registry ($base_img, $runner_img)"
sed -e "s#ghcr.io/imp-dev/runner-base:ubuntu-24.04#$base_img#" -e "s#ghcr.io/imp-dev/actions-runner:2#$runner_img#" \
  "$repo/smoke/manifests/runner-pool.yaml" >"$work/runner-pool.yaml"
kubectl apply -f "$work/runner-pool.yaml" >/dev/null || fail "applying smoke/manifests/runner-pool.yaml (images pointed at the local registry)"
pass "GitHub App Secret, webhook Secret, class, network and runner pool accepted by the API server"

IMP_HTTP_ADDR="127.0.0.1:$op_port" IMP_NAMESPACE=default IMP_WEBHOOK_SECRET_NAME=imp-webhook \
  IMP_GITHUB_API_URL="$sim" "$bin/imp-operator" >"$work/operator.log" 2>&1 &
pids+=($!); operator_pid=$!
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

# The node's two processes: imp-runtime (Firecracker simulator: imp-guest runs as a host process, so the
# runner command is a host binary) and imp-agent, whose runner is imp-fake-runner against the GitHub simulator.
: >"$work/vmlinux"
runtime_metrics="127.0.0.1:$(free_port)" agent_port=$(free_port)
target imp-runtime "$runtime_metrics" smoke-node
target imp-agent "127.0.0.1:$agent_port" smoke-node
IMP_RUNTIME_SOCKET="$work/runtime.sock" IMP_STATE_DIR="$work/node-state" IMP_KERNEL="$work/vmlinux" \
  IMP_FIRECRACKER_BIN="$bin/imp-firecracker-sim" IMP_GUEST_BIN="$bin/imp-guest" IMP_METRICS_ADDR="$runtime_metrics" \
  IMP_INSECURE_REGISTRIES="127.0.0.1:$reg_port" "$bin/imp-runtime" >"$work/runtime.log" 2>&1 &
pids+=($!); runtime_pid=$!
wait_for 20 curl -sf --unix-socket "$work/runtime.sock" http://imp/healthz || fail "imp-runtime not healthy: $(tail -3 "$work/runtime.log")"
IMP_NODE_NAME=smoke-node IMP_NAMESPACE=default IMP_RUNTIME_SOCKET="$work/runtime.sock" IMP_HEARTBEAT_INTERVAL=2s \
  IMP_POLL_INTERVAL=1s IMP_SWEEP_INTERVAL=2s IMP_HTTP_ADDR="127.0.0.1:$agent_port" IMP_RUNNER_COMMAND="$bin/imp-fake-runner" \
  "$bin/imp-agent" >"$work/agent.log" 2>&1 &
pids+=($!); agent_pid=$!
wait_for 20 curl -sf "http://127.0.0.1:$agent_port/healthz" || fail "imp-agent not healthy: $(tail -3 "$work/agent.log")"
pass "imp-runtime (Firecracker simulator) and imp-agent started for smoke-node"

vm_uid=$(kubectl get impvm "$vm" -o jsonpath='{.metadata.uid}')
phase_is() { [[ "$(kubectl get impvm "$vm" -o jsonpath='{.status.phase}')" == "$1" ]]; }
# The agent's log is the record here: the pool deletes a finished VM within moments.
started() { grep -q "runner Started recorded vm=$vm " "$work/agent.log"; }
wait_for 60 started || fail "runner VM $vm: no handoff Started (phase $(kubectl get impvm "$vm" -o jsonpath='{.status.phase}/{.status.reason}: {.status.message}' 2>/dev/null)): $(tail -3 "$work/agent.log")"
pass "runner VM $vm booted (rootfs built from the registry images) and handed its JIT config: handoff Started"
secret_gone() { ! kubectl get secret "$secret" >/dev/null 2>&1; }
wait_for 10 secret_gone || fail "JIT Secret $secret still exists after the handoff"
pass "JIT Secret $secret deleted after Started"
exited_ok() { grep -q "runner exited vm=$vm code=Some(0) " "$work/agent.log"; }
wait_for 90 exited_ok || fail "the runner did not exit 0 (phase $(kubectl get impvm "$vm" -o jsonpath='{.status.phase}/{.status.reason}' 2>/dev/null)): $(tail -3 "$work/agent.log")"
pass "imp-fake-runner took the job, completed it and exited 0: VM Succeeded"
gone() { ! kubectl get impvm "$vm" >/dev/null 2>&1; }
wait_for 60 gone || fail "runner VM $vm not deleted after success (TornDown: $(kubectl get impvm "$vm" -o jsonpath='{.status.conditions[?(@.type=="TornDown")].status}'))"
curl -sf --unix-socket "$work/runtime.sock" http://imp/v1/vms | grep -q "$vm_uid" && fail "imp-runtime still holds $vm_uid after teardown"
pass "runner VM $vm deleted by the pool after TornDown; imp-runtime released it"
replaced() { kubectl get impvm -l imp.dev/runner-pool=imp -o jsonpath='{.items[*].metadata.name}' | tr ' ' '\n' | grep -v "^$vm\$" | grep -q .; }
wait_for 30 replaced || fail "the pool did not replace the finished runner VM"
pass "the pool replaced the runner (minIdle 1)"
if [[ -n "${IMP_SMOKE_TARGETS_DIR:-}" ]]; then
  : >"$IMP_SMOKE_TARGETS_DIR/holding"
  wait_for 600 test -e "$IMP_SMOKE_TARGETS_DIR/release" || fail "no $IMP_SMOKE_TARGETS_DIR/release within 10 min"
fi
# SIGTERM is what the kubelet sends: each binary stops gracefully (exit 0, its "stopped" line), and its
# log file, not a terminal, holds no ANSI escape codes.
for name in agent runtime operator; do
  pid_var="${name}_pid"; pid=${!pid_var}; log="$work/$name.log"
  kill -TERM "$pid"; code=0; wait "$pid" || code=$?
  [[ $code == 0 ]] || fail "imp-$name exited $code on SIGTERM: $(tail -3 "$log")"
  grep -q "imp-$name stopped" "$log" || fail "imp-$name logged no graceful stop: $(tail -3 "$log")"
  if grep -q $'\x1b\[' "$log"; then fail "imp-$name wrote ANSI escape codes into $log"; fi
done
pass "imp-agent, imp-runtime and imp-operator stopped on SIGTERM with exit 0; their logs hold no escape codes"
passed=1
echo "imp-smoke --local: all stages passed"
