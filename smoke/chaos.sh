# The chaos scenarios of `smoke/imp-smoke.sh --local --chaos` (issue 18). Sourced by imp-smoke.sh in its
# --inside stages, after the lifecycle stages: it uses their functions and variables (kubectl, wait_for,
# pass, fail, seen, invariants, start_agent, start_runtime, start_operator, $sim, $work, $op_port,
# jobs_queued, jits, captured, ...). Not a script of its own.
#
# Each scenario injects one fault, then settles (every job it queued completed, no VM being deleted, an
# idle runner started again) and checks `invariants --settled` (imp-chaos-check, testkit/src/chaos):
# every registration, JIT Secret, IP allocation and TAP belongs to a live VM, each job was served by a
# runner of its own, no JIT config in any log. Its PASS line says what happened and how long it took.
# After the pool is deleted, imp-smoke.sh runs `invariants` once more: nothing of any scenario is left.
#
# The handoff phases are held with the Firecracker simulator's test-only knobs (IMP_SIM_BEHAVIOUR,
# testkit/src/firecracker/sim.rs): while $chaos_hold_boot exists a new VM's guest does not start (bound,
# no Hello: before Sent); while $chaos_hold_started exists a guest's `started` answer is held (between
# Sent and Started). A runner that never comes online is the GitHub simulator's
# `POST /_admin/runner-faults {"never_online": N}`.
#
# IMP_CHAOS_SOAK=N runs the scenario list N times in a random order; IMP_CHAOS_SEED (printed) replays an
# order. IMP_CHAOS_ONLY="name ..." runs only those scenarios (names as in chaos_scenarios below).

capture_jits() {
  local s v
  for s in $(kubectl get secret -l imp.dev/secret-kind=jitconfig -o name 2>/dev/null); do
    [[ " ${captured[*]} " == *" $s "* ]] && continue
    v=$(kubectl get "$s" -o jsonpath='{.data.jitconfig}' 2>/dev/null | base64 -d) || continue
    [[ -n "$v" ]] && captured+=("$s") && jits+=("$v")
  done
  return 0
}
queue_job() { curl -sf -X POST -H 'content-type: application/json' -d '{"labels":["self-hosted","imp"]}' "$sim/_admin/jobs" | jq -r .id; }
pool_vms() { kubectl get impvm -l imp.dev/runner-pool=imp -o json; }
idle_runner() {
  pool_vms | jq -er '[.items[] | select(.metadata.deletionTimestamp == null and .status.runner.handoff == "Started")][0].metadata.name'
}
# vm_at HANDOFF: a bound pool VM, not being deleted, at that handoff ("none": not yet Sent).
vm_at() {
  pool_vms | jq -er --arg h "$1" '[.items[] | select(.metadata.deletionTimestamp == null and .spec.nodeName != null
    and ((.status.runner.handoff // "none") == $h))][0].metadata.name'
}
completed() { local j; for j; do [[ "$(curl -sf "$sim/_admin/jobs/$j" | jq -r .status)" == completed ]] || return 1; done; }
none_deleting() { kubectl get impvm -o json | jq -e '[.items[] | select(.metadata.deletionTimestamp != null)] | length == 0'; }
# settle SECS JOB...: the jobs completed, no VM being deleted, and an idle runner started again.
settle() {
  local until=$((SECONDS + $1)); shift
  jobs_queued+=("$@")
  until capture_jits; completed "$@" && none_deleting >/dev/null 2>&1 && idle_runner >/dev/null 2>&1; do
    ((SECONDS < until)) || return 1
    sleep 0.5
  done
}
metric_at_least() { curl -sf "http://127.0.0.1:$1/metrics" | awk -v m="$2" -v n="$3" '$1 == m && $2 >= n {ok=1} END {exit !ok}'; }
sim_fault() { curl -sf -X POST -H 'content-type: application/json' -d "$2" "$sim/_admin/$1" >/dev/null; }
why() { echo "jobs $(curl -sf "$sim/_admin/jobs" | jq -c '[.[] | {id, status}]'); VMs $(kubectl get impvm -o jsonpath='{range .items[*]}{.metadata.name}={.status.phase}/{.status.reason}/{.status.runner.handoff} {end}')"; }
# What the API server recorded of VM $1: its distinct phase/reason/handoff versions, in order.
history() {
  jq -r --arg n "$1" 'select(.object.metadata.name == $n) | .object.status // {} |
    "\(.phase // "-")/\(.reason // "-")/\(.runner.handoff // "-")"' "$work/impvms.jsonl" | uniq | paste -sd '>' -
}
chaos_results=()
# After every scenario: the settled-state invariants (whatever exists belongs to a live VM).
settled() {
  local took=$((SECONDS - t0))
  invariants --settled >"$work/check.out" 2>&1 || fail "chaos $1: invariants broken: $(cat "$work/check.out")"
  local stray
  stray=$(stray_jails)
  [[ -z "$stray" ]] || fail "chaos $1: jails of no live VM: $stray"
  printf 'PASS  chaos: %s (settled in %ss; invariants hold)\n' "$1" "$took"
  chaos_results+=("$took s  $1")
}
kill9() { kill -KILL "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }
# kill -9 of imp-$1, a second down, then started again.
crash() {
  case $1 in
    agent) kill9 "$agent_pid"; sleep 1; start_agent ;;
    runtime) kill9 "$runtime_pid"; sleep 1; start_runtime ;;
    operator) kill9 "$operator_pid"; sleep 1; start_operator ;;
  esac
}
# Every process of the node's VMs with all its descendants: what names the runtime's state dir, and
# the jailed simulators (their command lines name only paths in their jails: found by their root, a
# jail's by inode).
vm_process_tree() {
  local f pid roots
  roots=$(stat -c %d:%i "$IMP_SMOKE_JAIL_BASE"/*/*/root 2>/dev/null || true)
  for f in /proc/[0-9]*; do
    pid=${f#/proc/}
    grep -qF "$work/node-state" "$f/cmdline" 2>/dev/null \
      || { [[ -n $roots ]] && grep -qxF "$(stat -L -c %d:%i "$f/root" 2>/dev/null)" <<<"$roots"; } || continue
    echo "$pid"
    descendants "$pid"
  done
}
# Settled: every jail is a live VM's (imp-chaos-check sees the VM directories; the jails are the
# jailer's, named by the VM's uid). Prints the others.
stray_jails() {
  local live d
  live=" $(kubectl get impvm -o jsonpath='{.items[*].metadata.uid}') "
  for d in "$IMP_SMOKE_JAIL_BASE"/*/*/; do
    [[ -d "$d" ]] || continue
    d=${d%/}
    [[ "$live" == *" ${d##*/} "* ]] || echo "$d"
  done
}
descendants() { local p; for p in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$p"; descendants "$p"; done; }

# In $work/sim, which imp-smoke.sh binds read-only into each jail: the jailed simulator reads the
# behaviour file and looks for the hold files there.
chaos_hold_boot="$work/sim/hold-boot"
chaos_hold_started="$work/sim/hold-started"
printf '{"*": {"hold_boot_while": "%s", "hold_started_while": "%s"}}\n' "$chaos_hold_boot" "$chaos_hold_started" \
  >"$work/sim/behaviour.json"
# Inherited by the restarts below: the simulator's hold knobs, a short runner-online deadline (5 min
# in production), and one operator identity, so a restarted operator takes its own Lease back at once
# like a restarted container of the same pod (a new identity waits out the 15 s Lease).
export IMP_SIM_BEHAVIOUR="$work/sim/behaviour.json" IMP_RUNNER_ONLINE_DEADLINE=8s IMP_POD_NAME=smoke-operator

# --- the scenarios ---------------------------------------------------------------------------------

chaos_forged_webhook() {
  t0=$SECONDS
  local code vms_before
  vms_before=$(kubectl get impvm -o name | wc -l)
  code=$(curl -s -o /dev/null -w '%{http_code}' -X POST -H 'content-type: application/json' -H 'x-github-event: workflow_job' \
    -H "x-github-delivery: smoke-forged-$RANDOM" -H 'x-hub-signature-256: sha256=0000000000000000000000000000000000000000000000000000000000000000' \
    -d '{"action":"queued","workflow_job":{"id":4242,"labels":["self-hosted","imp"],"status":"queued"},"repository":{"full_name":"acme/app"}}' \
    "http://127.0.0.1:$op_port/webhooks/github")
  [[ $code == 401 ]] || fail "chaos forged webhook: answered $code, not 401"
  wait_for 5 metric_at_least "$op_port" 'imp_webhook_deliveries_total{result="bad_signature"}' 1 || fail "chaos forged webhook: not counted as bad_signature"
  sleep 2
  [[ $(kubectl get impvm -o name | wc -l) == "$vms_before" ]] || fail "chaos forged webhook: the pool changed its VMs ($(why))"
  settled "forged webhook (bad signature): 401, counted, no VM created"
}

chaos_duplicated_webhook() {
  t0=$SECONDS; sim_fault webhook-faults '{"fault":"duplicate","count":1}'; local j; j=$(queue_job)
  settle 90 "$j" || fail "chaos duplicated webhook: not settled: $(why)"
  metric_at_least "$op_port" 'imp_webhook_deliveries_total{result="duplicate"}' 1 || fail "chaos duplicated webhook: the duplicate was not recognised"
  settled "duplicated webhook: job $j served once, the duplicate delivery counted as duplicate"
}

chaos_lost_webhook() {
  t0=$SECONDS; sim_fault webhook-faults '{"fault":"drop","count":1}'; local j; j=$(queue_job)
  settle 90 "$j" || fail "chaos lost webhook: not settled: $(why)"
  settled "lost webhook: job $j served by the warm runner anyway"
}

chaos_reordered_webhooks() {
  t0=$SECONDS; sim_fault webhook-faults '{"fault":"reorder","count":1}'; local j1 j2; j1=$(queue_job); j2=$(queue_job)
  settle 120 "$j1" "$j2" || fail "chaos reordered webhooks: not settled: $(why)"
  settled "reordered webhooks: jobs $j1 and $j2 both served"
}

chaos_github_5xx() {
  t0=$SECONDS; sim_fault faults '{"fault":{"kind":"server_error","status":503},"count":3,"path_contains":"generate-jitconfig"}'; local j; j=$(queue_job)
  settle 120 "$j" || fail "chaos GitHub 5xx burst: not settled: $(why)"
  settled "GitHub 503 burst on generate-jitconfig (3 calls): job $j served, the replacement minted after the burst"
}

chaos_github_429() {
  t0=$SECONDS; sim_fault faults '{"fault":{"kind":"rate_limit","retry_after_secs":1},"count":3}'; local j; j=$(queue_job)
  settle 120 "$j" || fail "chaos GitHub 429 burst: not settled: $(why)"
  settled "GitHub 429 burst (3 calls, Retry-After 1): job $j served"
}

# kill_at PHASE TARGET: kill -9 imp-TARGET while a runner VM is at PHASE of its handoff (before-sent:
# bound, its guest held before the Hello; sent: Sent recorded, the guest's Started answer held; started:
# the idle runner Started), start it again, release the hold; the job queued is served and the pool
# settles. The held VM's recorded history goes into the PASS line.
kill_at() {
  local phase=$1 target=$2 hold="" want vm j what
  t0=$SECONDS
  case $phase in
    before-sent) hold=$chaos_hold_boot want=none ;;
    sent) hold=$chaos_hold_started want=Sent ;;
    started) want=Started ;;
  esac
  what="kill -9 imp-$target at handoff $phase"
  if [[ -n $hold ]]; then
    # The warm runner takes the job; its replacement is held at the phase.
    : >"$hold"
    j=$(queue_job)
    wait_for 60 vm_at "$want" || { rm -f "$hold"; fail "chaos $what: no runner VM reached $want: $(why)"; }
    vm=$(vm_at "$want")
    crash "$target"
    sleep 1
    rm -f "$hold"
  else
    wait_for 60 vm_at "$want" || fail "chaos $what: no idle started runner: $(why)"
    vm=$(vm_at "$want")
    crash "$target"
    j=$(queue_job)
  fi
  settle 120 "$j" || fail "chaos $what: not settled: $(why); held VM $vm: $(history "$vm")"
  settled "$what, restarted: job $j served; VM $vm went $(history "$vm")"
}

# node_loss: the node goes with an idle Started runner; node_loss_booting: with a VM held before its
# Hello (bound, address allocated, VMM started).
chaos_node_loss_booting() { chaos_node_loss booting; }
chaos_node_loss() {
  t0=$SECONDS
  local vms tree v j j0="" what="an idle runner"
  if [[ ${1:-} == booting ]]; then
    what="a VM booting before its Hello"
    : >"$chaos_hold_boot"
    j0=$(queue_job)
    wait_for 60 vm_at none || { rm -f "$chaos_hold_boot"; fail "chaos node loss: no VM held before its Hello: $(why)"; }
  fi
  if [[ -n $j0 ]]; then
    vms=$(vm_at none)
  else
    vms=$(pool_vms | jq -r '[.items[] | select(.metadata.deletionTimestamp == null and .spec.nodeName != null) | .metadata.name] | join(" ")')
  fi
  [[ -n $vms ]] || fail "chaos node loss: no bound VM to lose: $(why)"
  # The node goes: its agent, its runtime and every VM process with it (TAPs, nft rules and VM
  # directories stay behind, as after a power cut).
  tree=$(vm_process_tree)
  kill9 "$agent_pid"; kill9 "$runtime_pid"
  for v in $tree; do kill -KILL "$v" 2>/dev/null || true; done
  # Its heartbeat stale at once, instead of after the operator's 40 s.
  kubectl patch lease imp-node-smoke-node --type=merge -p '{"spec":{"renewTime":"2020-01-01T00:00:00.000000Z"}}' >/dev/null
  lost() { local v; for v in $vms; do seen "$v" status.reason NodeLost || return 1; done; }
  wait_for 60 lost || fail "chaos node loss: VMs $vms not NodeLost: $(why)"
  j=$(queue_job)
  sleep 2
  rm -f "$chaos_hold_boot"
  # The node comes back (a reboot): the runtime finds what its VMs left, the agent finishes their
  # teardown, the replacements schedule and serve the job queued meanwhile.
  start_runtime; start_agent
  # 40 s: a lost VM's scheduling reservation once kept the next runner waiting 60 s.
  settle 40 $j0 "$j" || fail "chaos node loss: not settled within 40 s after the node came back: $(why)"
  settled "node loss with $what (agent, runtime and VM processes killed, Lease stale): VMs $vms NodeLost; node back: job $j served"
}

chaos_runtime_down() {
  t0=$SECONDS
  local j vm
  vm=$(idle_runner) || fail "chaos runtime down: no idle runner: $(why)"
  kill9 "$runtime_pid"
  j=$(queue_job)
  # The Lease stays fresh: the started runner serves the job without the runtime.
  wait_for 30 completed "$j" || fail "chaos runtime down: job $j not served by $vm with imp-runtime down: $(why)"
  sleep 3
  kill -0 "$agent_pid" || fail "chaos runtime down: imp-agent died with the runtime"
  start_runtime
  settle 120 "$j" || fail "chaos runtime down: not settled after imp-runtime came back: $(why)"
  settled "imp-runtime down (Lease fresh) ~5 s: job $j served by $vm meanwhile; teardown and replacement once it was back"
}

chaos_two_operators() {
  t0=$SECONDS
  local port2 op2 j1 j2 holder
  port2=$(free_port)
  IMP_REAP_INTERVAL=10s IMP_HTTP_ADDR="127.0.0.1:$port2" IMP_NAMESPACE=default IMP_WEBHOOK_SECRET_NAME=imp-webhook \
    IMP_GITHUB_API_URL="$sim" IMP_POD_NAME=smoke-operator-2 "$bin/imp-operator" >>"$work/operator2.log" 2>&1 &
  op2=$!; pids+=("$op2")
  wait_for 20 curl -sf "http://127.0.0.1:$port2/healthz" || fail "chaos two operators: the second imp-operator not healthy: $(tail -3 "$work/operator2.log")"
  # Only the leader acts: the second one is not Ready and leaves the Lease alone.
  curl -sf "http://127.0.0.1:$port2/readyz" >/dev/null && fail "chaos two operators: the second operator is Ready next to the leader"
  j1=$(queue_job)
  settle 120 "$j1" || fail "chaos two operators: not settled with two operators: $(why)"
  holder=$(kubectl get lease imp-operator-leader -o jsonpath='{.spec.holderIdentity}')
  [[ $holder == smoke-operator ]] || fail "chaos two operators: the Lease moved to $holder"
  # The leader dies: the standby takes over once the Lease expires and serves the next job (its
  # webhook goes to the dead leader's port: lost, the warm runner and the sweep cover it).
  kill9 "$operator_pid"
  j2=$(queue_job)
  wait_for 40 curl -sf "http://127.0.0.1:$port2/readyz" || fail "chaos two operators: the standby did not take over: $(tail -3 "$work/operator2.log")"
  settle 120 "$j2" || fail "chaos two operators: not settled after the takeover: $(why)"
  # The standby hands back gracefully (SIGTERM releases the Lease) and the first one leads again.
  kill -TERM "$op2"; wait "$op2" 2>/dev/null || true
  start_operator
  settle 60 || fail "chaos two operators: not settled after the hand-back: $(why)"
  settled "two operators: the standby not Ready while the leader served job $j1; leader kill -9: the standby took over and served job $j2; hand-back"
}

chaos_never_online() {
  t0=$SECONDS
  local j n0
  n0=$(grep -c '"reason": *"RunnerNeverOnline"' "$work/events.jsonl" || true)
  sim_fault runner-faults '{"never_online":1}'
  j=$(queue_job)
  replaced() { (($(grep -c '"reason": *"RunnerNeverOnline"' "$work/events.jsonl" || true) > n0)); }
  wait_for 60 replaced || fail "chaos runner never online: no RunnerNeverOnline within 60 s (deadline $IMP_RUNNER_ONLINE_DEADLINE): $(why)"
  settle 120 "$j" || fail "chaos runner never online: not settled: $(why)"
  settled "a runner that never comes online: replaced after the $IMP_RUNNER_ONLINE_DEADLINE online deadline (RunnerNeverOnline); job $j served"
}

chaos_scenarios=(
  forged_webhook duplicated_webhook lost_webhook reordered_webhooks github_5xx github_429
  kill_agent_before_sent kill_agent_sent kill_agent_started
  kill_runtime_before_sent kill_runtime_sent kill_runtime_started
  kill_operator_before_sent kill_operator_sent kill_operator_started
  runtime_down node_loss node_loss_booting two_operators never_online
)
run_scenario() {
  case $1 in
    kill_*_before_sent) local t=${1#kill_}; kill_at before-sent "${t%_before_sent}" ;;
    kill_*_sent) local t=${1#kill_}; kill_at sent "${t%_sent}" ;;
    kill_*_started) local t=${1#kill_}; kill_at started "${t%_started}" ;;
    *) "chaos_$1" ;;
  esac
}

# The runtime and the operator restart once first, so every later VM and operator has the knobs.
t0=$SECONDS
crash runtime
crash operator
settle 120 || fail "chaos: not settled after restarting imp-runtime and imp-operator with the chaos knobs: $(why)"
settled "kill -9 imp-runtime and imp-operator with a Started runner, restarted with the chaos knobs"

chaos_list=("${chaos_scenarios[@]}")
if [[ -n "${IMP_CHAOS_ONLY:-}" ]]; then read -ra chaos_list <<<"$IMP_CHAOS_ONLY"; fi
rounds=${IMP_CHAOS_SOAK:-1}
if ((rounds > 1)); then
  chaos_seed=${IMP_CHAOS_SEED:-$((RANDOM * 32768 + RANDOM))}
  echo "imp-smoke: chaos soak: $rounds rounds in a random order, IMP_CHAOS_SEED=$chaos_seed replays it"
  RANDOM=$chaos_seed
fi
chaos_started=$SECONDS
for ((round = 1; round <= rounds; round++)); do
  order=("${chaos_list[@]}")
  if ((rounds > 1)); then
    # Fisher-Yates with bash's seeded RANDOM.
    for ((i = ${#order[@]} - 1; i > 0; i--)); do
      k=$((RANDOM % (i + 1))); tmp=${order[i]}; order[i]=${order[k]}; order[k]=$tmp
    done
    echo "imp-smoke: chaos round $round/$rounds: ${order[*]}"
  fi
  for s in "${order[@]}"; do run_scenario "$s"; done
done
pass "chaos: ${#chaos_results[@]} scenario run(s) in $((SECONDS - chaos_started)) s, invariants held after each"
