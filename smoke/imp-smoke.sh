#!/usr/bin/env bash
# Imp smoke test for a harmless job.
#
#   smoke/imp-smoke.sh --local [--guest auto|qemu|simulated] [--chaos] [--record FILE] [--report FILE]
#       The whole runner lifecycle on this machine (root): a real API server (testenv), the GitHub
#       simulator, a local registry, imp-runtime, imp-agent and imp-operator, in network namespaces
#       the smoke creates (TEST-NET addresses only): the node's, and the simulator's "internet"
#       (198.51.100.1, reachable from the node only by routing). --guest qemu: imp-runtime's QEMU
#       backend boots each runner VM (Debian's cloud kernel, Imp's initrd with the static imp-guest,
#       a rootfs built from the images the smoke pushes, one of them carrying the static
#       imp-fake-runner), and the runner reaches the simulator over the VM's own network (ImpNetwork
#       bridge, NAT). --guest simulated: the Firecracker simulator, imp-guest and the fake runner as
#       processes in the node namespace, no kernel boots; each VM's simulator runs jailed, through
#       testkit's jailer double as imp-runtime's --jailer-path (chroot under a short /tmp/impj.*
#       base, mount and PID namespaces of its own, per-VM cgroups). auto (default): qemu when
#       qemu-system-x86_64, a /boot/vmlinuz-*-cloud-amd64 with its modules, a static busybox, cpio,
#       skopeo and vhost-device-vsock are there, else simulated; the first line says which and why
#       (IMP_REQUIRE_REAL_GUEST=1, set by .ci/run, makes the fallback a failure). First of all,
#       testenv/preflight.sh installs what the run needs (IMP_INSTALL_DEPS=0: fails naming it).
#       Each stage prints PASS or FAIL; then a
#       per-phase timeline read from the ImpVM's status fields, Events, the simulator's job record and
#       metrics (JSON report: --report, default target/imp-smoke/report.json). The run ends by checking
#       that nothing of its own is left (processes, links, nft tables, VM files, jails, files of the
#       per-VM uids, VM cgroups, ImpVMs, JIT Secrets, IP allocations, GitHub registrations) and fails
#       if anything is.
#       --record FILE also writes the run as an asciicast v2 file (asciinema play FILE).
#       --chaos adds the chaos scenarios of smoke/chaos.sh, on the (jailed) simulated path (after a
#       real-guest lifecycle the node switches to the Firecracker simulator): forged, duplicated, lost and
#       reordered webhooks; GitHub 5xx and 429 bursts; kill -9 of imp-agent, imp-runtime and
#       imp-operator before Sent, between Sent and Started and after Started; imp-runtime down with a
#       fresh Lease; node loss; two operators; a runner that never comes online. After each, the
#       settled invariants (imp-chaos-check, testkit/src/chaos). IMP_CHAOS_SOAK=N repeats the list N
#       times in a shuffled order (IMP_CHAOS_SEED replays one, IMP_CHAOS_ONLY="name ..." a subset).
#   smoke/imp-smoke.sh --cluster --repo OWNER/REPO [--context CTX] [--github-api URL] [--token-file F] ...
#       One job through an installed Imp (smoke/cluster.py; --cluster --help lists its options): ensures
#       the pool, dispatches smoke/workflow.yaml (workflow_dispatch), follows the job through the GitHub
#       API and the cluster, prints the same timeline, and fails naming the phase that failed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
self="$repo/smoke/imp-smoke.sh"
mode="" namespace="imp-system" pool_ns="default" pool="imp" record="" report="" work="" chaos=0 guest=auto
passthru=()
# --cluster is smoke/cluster.py, with every argument (its own options).
for arg; do [[ "$arg" == --cluster ]] && exec python3 "$repo/smoke/cluster.py" "$@"; done
while (($#)); do
  case "$1" in
    --local) mode=local; passthru+=("$1") ;;
    --namespace) namespace="$2"; passthru+=("$1" "$2"); shift ;;
    --pool-namespace) pool_ns="$2"; passthru+=("$1" "$2"); shift ;;
    --pool) pool="$2"; passthru+=("$1" "$2"); shift ;;
    --record) record="$2"; shift ;;
    --chaos) chaos=1; passthru+=("$1") ;;
    --guest) guest="$2"; passthru+=("$1" "$2"); shift ;;
    --report) report="$2"; passthru+=("$1" "$2"); shift ;;
    --inside) mode=inside; work="$2"; shift ;; # internal: the stages, run inside the smoke's netns
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "imp-smoke: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$mode" ]] || { echo "imp-smoke: choose --local or --cluster (see --help)" >&2; exit 2; }
[[ "$guest" =~ ^(auto|qemu|simulated)$ ]] || { echo "imp-smoke: --guest is auto, qemu or simulated, not $guest" >&2; exit 2; }
if [[ -n "$record" && -z "${IMP_SMOKE_RECORDING:-}" ]]; then
  export IMP_SMOKE_RECORDING=1
  exec python3 "$repo/smoke/asciicast.py" "$record" "$self" "${passthru[@]}"
fi

pass() { printf 'PASS  %s\n' "$*"; }
fail() { printf 'FAIL  %s\n' "$*" >&2; exit 1; }
# Runs "$@" every 0.2 s until it succeeds, for at most $1 seconds.
wait_for() { local until=$((SECONDS + $1)); shift; until "$@" >/dev/null 2>&1; do ((SECONDS < until)) || return 1; sleep 0.2; done; }

bin="${CARGO_TARGET_DIR:-$repo/target}/debug"
static_dir="${CARGO_TARGET_DIR:-$repo/target}/x86_64-unknown-linux-gnu/release"
report="${report:-${CARGO_TARGET_DIR:-$repo/target}/imp-smoke/report.json}"

if [[ "$mode" == local ]]; then
  [[ $EUID == 0 ]] || fail "the local smoke needs root (network namespaces, imp-runtime's bridge, TAPs and nft tables)"
  # Everything the run needs, before anything long (testenv/preflight.sh): installed when missing
  # unless IMP_INSTALL_DEPS=0, which makes a missing package fail here, naming it and the command.
  # Its lines go to stderr: the path statement below stays the first line of stdout.
  "$repo/testenv/preflight.sh" "$([[ $guest == simulated ]] && echo smoke-simulated || echo smoke)" >&2 \
    || fail "testenv/preflight.sh (above)$([[ $guest == auto ]] && echo '; --guest simulated needs fewer packages')"
  static_busybox() { [[ -x /bin/busybox ]] && ! readelf -d /bin/busybox 2>/dev/null | grep -q NEEDED; }
  # The real-guest path when this host has everything for it; else why not.
  why_not=""
  if [[ $guest != simulated ]]; then
    kernel=$(compgen -G '/boot/vmlinuz-*-cloud-amd64' | sort -V | tail -1 || true)
    kver=${kernel#/boot/vmlinuz-}
    if ! command -v qemu-system-x86_64 >/dev/null; then why_not="no qemu-system-x86_64 (Debian: qemu-system-x86)"
    elif [[ -z "$kernel" ]]; then why_not="no /boot/vmlinuz-*-cloud-amd64 (Debian: linux-image-cloud-amd64)"
    elif ! modinfo -k "$kver" -F filename vmw_vsock_virtio_transport 2>/dev/null | grep -q '\.ko$'; then why_not="no vsock modules for $kver in /lib/modules"
    elif ! static_busybox; then why_not="no static /bin/busybox (Debian: busybox-static)"
    elif ! command -v cpio >/dev/null; then why_not="no cpio (for Imp's initrd)"
    elif ! command -v skopeo >/dev/null; then why_not="no skopeo (pushes the runner image)"
    elif ! command -v vhost-device-vsock >/dev/null; then why_not="no vhost-device-vsock (cargo install --locked vhost-device-vsock --version 0.3.0)"
    fi
  fi
  # KVM when /dev/kvm opens and a kernel actually starts under it (a nested /dev/kvm can open and
  # then hang the guest), else TCG (software emulation: slower boots, same path). IMP_QEMU_ACCEL
  # (kvm or tcg) decides instead.
  accel=${IMP_QEMU_ACCEL:-}
  if [[ -z "$accel" ]]; then
    accel=tcg
    if [[ -z "$why_not" && $guest != simulated ]] && python3 -c 'import os; os.close(os.open("/dev/kvm", os.O_RDWR))' 2>/dev/null \
      && { timeout 5 qemu-system-x86_64 -accel kvm -m 128 -display none -nodefaults -no-reboot -kernel "$kernel" \
        -append 'console=ttyS0 panic=-1' -serial stdio 2>/dev/null || true; } | grep -qm1 'Linux version'; then
      accel=kvm
    fi
  fi
  if [[ $guest == simulated ]]; then
    path=simulated
    echo "imp-smoke: SIMULATED guest path (--guest simulated): imp-runtime drives the Firecracker simulator JAILED through testkit's jailer double (--jailer-path: chroot, mount and PID namespaces, per-VM cgroups), imp-guest and the fake runner run as processes in each VM's jail, in the node's network namespace, no kernel boots"
  elif [[ -z "$why_not" ]]; then
    path=qemu
    echo "imp-smoke: REAL guest path: imp-runtime's QEMU backend ($accel) boots $kernel with Imp's initrd; the static imp-fake-runner runs inside the guest and reaches the GitHub simulator over the VM's network (NAT)"
  elif [[ $guest == qemu ]]; then
    fail "--guest qemu, but this host cannot run the real-guest path: $why_not"
  elif [[ "${IMP_REQUIRE_REAL_GUEST:-}" == 1 ]]; then
    fail "IMP_REQUIRE_REAL_GUEST=1, but this host cannot run the real-guest path: $why_not"
  else
    path=simulated
    echo "imp-smoke: SIMULATED guest path, because $why_not: imp-runtime drives the Firecracker simulator JAILED through testkit's jailer double (--jailer-path), imp-guest and the fake runner run as processes in each VM's jail, no kernel boots"
  fi
  work="$(mktemp -d /tmp/imp-smoke.XXXXXX)"
  ns="imp-smoke-$$" gh_ns="imp-smoke-$$-gh"
  passed=0
  jail_base="" cg_parent="" cg_hier=() cg_made=()
  # Whatever the stages left in the namespace is killed by pid (all of it is the smoke's own), then the
  # namespace goes, taking any link or nft table with it. Logs stay when anything failed.
  outer_cleanup() {
    local pid
    for pid in $(ip netns pids "$ns" 2>/dev/null) $(ip netns pids "$gh_ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
    ip netns del "$gh_ns" 2>/dev/null || true
    # Jails and VM cgroups go on failure too (their VMs' logs stay in $work/node-state/vms).
    [[ -z "$jail_base" ]] || rm -rf --one-file-system "$jail_base"
    ! declare -F remove_cgroups >/dev/null || remove_cgroups 2>/dev/null || echo "imp-smoke: cgroup directories left: $(vm_cgroups) ${cg_made[*]}" >&2
    # A run that failed before writing any log leaves no empty work dir behind.
    if [[ $passed == 1 ]]; then rm -rf "$work"; elif ! rmdir "$work" 2>/dev/null; then echo "imp-smoke: logs kept in $work" >&2; fi
  }
  trap outer_cleanup EXIT
  # The simulated path's jails (imp-runtime's --jailer-chroot-base-dir): a short base of their own,
  # because a jailed VM's sockets are <base>/imp-firecracker-sim/<vm uid>/root/vsock.sock_<port> and a
  # Unix socket path holds at most 107 bytes (under $work/node-state it would be 118). On /tmp, like
  # the state directory: drives are hard-linked into the jails.
  jail_base="$(mktemp -d /tmp/impj.XXXXXX)"
  longest_sock="$jail_base/imp-firecracker-sim/$(printf '%036d' 0)/root/vsock.sock_10001" # a VM uid is 36 bytes
  ((${#longest_sock} <= 107)) || fail "the jails' socket paths would be ${#longest_sock} bytes under $jail_base (at most 107)"
  # Per-VM cgroups on the simulated path (imp-runtime's --vm-cgroup-parent, made by the jailer): under
  # the smoke's own memory cgroup on cgroup v1 (the same path in the cpu and pids hierarchies, as
  # node/runtime/tests/jailer.rs does), at the root on v2 (a cgroup with processes cannot delegate
  # controllers). What the run makes is removed at the end; what the VMs leave is a leak.
  if grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
    cg_parent="imp-smoke-$$" cg_hier=(/sys/fs/cgroup)
  elif [[ -f /sys/fs/cgroup/memory/cgroup.procs && -f /sys/fs/cgroup/cpu/cgroup.procs && -f /sys/fs/cgroup/pids/cgroup.procs ]]; then
    own=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)
    own=${own#/}
    cg_parent="${own:+$own/}imp-smoke-$$" cg_hier=(/sys/fs/cgroup/memory /sys/fs/cgroup/cpu /sys/fs/cgroup/pids)
  elif [[ "${IMP_REQUIRE_CGROUP:-}" == 1 ]]; then
    fail "IMP_REQUIRE_CGROUP=1, but /sys/fs/cgroup has no memory, cpu and pids controllers for the VMs' cgroups"
  else
    echo "imp-smoke: no memory, cpu and pids cgroup controllers under /sys/fs/cgroup: the simulated VMs get no cgroups of their own" >&2
  fi
  for h in "${cg_hier[@]}"; do
    d=$h
    IFS=/ read -ra parts <<<"$cg_parent"
    for c in "${parts[@]}"; do d="$d/$c"; [[ -d "$d" ]] || cg_made+=("$d"); done
  done
  # VM cgroups left under the parent, in any hierarchy.
  vm_cgroups() { local h d; for h in "${cg_hier[@]}"; do for d in "$h/$cg_parent"/*/; do [[ -d "$d" ]] && echo "$d"; done; done; }
  # The cgroup directories the run made, deepest first (a VM's process may still be exiting: 5 s). The
  # parent (imp-smoke-<pid>) must go; an ancestor made for it may hold another run's cgroups by now.
  remove_cgroups() {
    local d i
    for d in $(vm_cgroups); do for _ in $(seq 1 10); do rmdir "$d" 2>/dev/null && break; sleep 0.5; done; done
    for ((i = ${#cg_made[@]} - 1; i >= 0; i--)); do
      d=${cg_made[i]}
      [[ ! -d "$d" ]] || rmdir "$d" 2>/dev/null || [[ "${d##*/}" != "imp-smoke-$$" ]] || return 1
    done
  }
  # Its progress lines go to stderr: the path statement above stays the first line of stdout.
  "$repo/testenv/build.sh" >&2 || fail "testenv build (testenv/build.sh)"
  (cd "$repo" && cargo build -q -p imp-operator -p imp-runtime -p imp-agent -p imp-testkit -p imp-guest -p imp-fake-runner -p kubectl-imp --bins) || fail "cargo build"
  if [[ $path == qemu ]]; then
    # The guest's two binaries, static (the rootfs has no libc for them): imp-guest as
    # guest/check-static.sh builds it (same artifacts), the slim imp-fake-runner the same way.
    for crate in imp-guest imp-fake-runner; do
      (cd "$repo" && RUSTFLAGS='-C target-feature=+crt-static' CARGO_PROFILE_RELEASE_STRIP=symbols \
        cargo build -q --release --target x86_64-unknown-linux-gnu -p "$crate") || fail "static build of $crate"
      readelf -d "$static_dir/$crate" | grep -q NEEDED && fail "$static_dir/$crate is not static"
    done
    # Imp's initrd: imp-guest as /init, the cloud kernel's virtio, overlay and vsock modules.
    "$repo/images/initrd/build.sh" --guest "$static_dir/imp-guest" --out "$work/initrd.gz" --kernel-version "$kver" --gzip \
      >"$work/initrd.log" 2>&1 || fail "images/initrd/build.sh: $(tail -3 "$work/initrd.log")"
    pass "binaries built; static imp-guest and imp-fake-runner; initrd for $kver ($(stat -c %s "$work/initrd.gz") bytes)"
  else
    pass "binaries built"
  fi
  # Two namespaces on a veth pair (TEST-NET-2): the node's (uplink0 198.51.100.2, its default
  # route, so imp-runtime's masquerade has an egress interface) and the "internet" where the
  # GitHub simulator listens (gh0 198.51.100.1). The simulator is reached by routing only (from a
  # guest: the ImpNetwork bridge, then NAT out of uplink0), never through a host address, and
  # nothing leaves the two namespaces.
  ip netns add "$ns" || fail "creating network namespace $ns"
  ip netns add "$gh_ns" || fail "creating network namespace $gh_ns"
  ip -n "$ns" link set lo up
  ip -n "$gh_ns" link set lo up
  ip -n "$ns" link add uplink0 type veth peer name gh0 netns "$gh_ns"
  ip -n "$ns" addr add 198.51.100.2/24 dev uplink0
  ip -n "$gh_ns" addr add 198.51.100.1/24 dev gh0
  ip -n "$gh_ns" link set gh0 up
  ip -n "$ns" link set uplink0 up
  ip -n "$ns" route add default via 198.51.100.1
  pass "network namespaces $ns (uplink0 198.51.100.2/24, default route via 198.51.100.1) and $gh_ns (gh0 198.51.100.1/24: the simulator's)"
  # IMP_SMOKE_TARGETS_DIR (helm/monitoring-test.py): the scraper runs inside this namespace (the smoke's
  # processes listen on its 127.0.0.1); it is told the name and the smoke waits until it is ready.
  if [[ -n "${IMP_SMOKE_TARGETS_DIR:-}" ]]; then
    echo "$ns" >"$IMP_SMOKE_TARGETS_DIR/netns"
    for _ in $(seq 1 120); do [[ -e "$IMP_SMOKE_TARGETS_DIR/scraper-ready" ]] && break; sleep 0.5; done
    [[ -e "$IMP_SMOKE_TARGETS_DIR/scraper-ready" ]] || fail "no $IMP_SMOKE_TARGETS_DIR/scraper-ready within 60 s"
  fi
  code=0
  # `ip netns exec`, not `nsenter --net`: it also mounts a sysfs of the namespace, and imp-runtime reads
  # links under /sys/class/net (under nsenter it saw the host's and skipped deleting its TAPs).
  inner=(--inside "$work" --report "$report" --guest "$path"); ((chaos)) && inner+=(--chaos)
  export IMP_SMOKE_GH_NS="$gh_ns" IMP_SMOKE_ACCEL="$accel" IMP_SMOKE_KERNEL="${kernel:-}" \
    IMP_SMOKE_JAIL_BASE="$jail_base" IMP_SMOKE_CGROUP_PARENT="$cg_parent"
  # `ip netns exec` mounts a sysfs of the namespace on /sys, without the cgroup hierarchies under it:
  # the stages mount the host's again there (their mount namespace only), from this list.
  awk '($3 == "cgroup" || $3 == "cgroup2") && $2 ~ "^/sys/fs/cgroup" {print $3, $2, $4}' /proc/self/mounts >"$work/host-cgroups"
  ip netns exec "$ns" "$self" "${inner[@]}" || code=$?

  # The leak check: everything below must be gone after the stages, on success and on failure.
  leaks=()
  # A process killed by the stages' cleanup may still be exiting (or a zombie until PID 1 reaps it):
  # up to 5 s for the namespace to empty before what is left counts as left behind.
  for _ in $(seq 1 10); do [[ -z "$(ip netns pids "$ns")$(ip netns pids "$gh_ns")" ]] && break; sleep 0.5; done
  # Processes (QEMU and vhost-device-vsock among them: the runtime starts them in the node's
  # namespace), links (TAPs, bridges) and nft tables.
  for n in "$ns" "$gh_ns"; do
    for pid in $(ip netns pids "$n"); do leaks+=("process $pid in $n: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) ($(awk '/^State:/{print $2, $3}' "/proc/$pid/status" 2>/dev/null))"); done
    for link in $(ip -n "$n" -o link show | awk -F': ' '{print $2}' | cut -d@ -f1); do
      [[ "$link" == lo || "$link" == uplink0 || "$link" == gh0 ]] || leaks+=("link $link in $n")
    done
    while read -r table; do [[ -n "$table" ]] && leaks+=("nft $table in $n"); done \
      < <(ip netns exec "$n" nft list tables)
  done
  for f in /proc/[0-9]*/cmdline; do
    grep -qF "$work" "$f" 2>/dev/null && leaks+=("process ${f//[^0-9]/} outside $ns: $(tr '\0' ' ' <"$f")")
  done
  # VM directories, and the jails (<jail base>/imp-firecracker-sim/<vm uid>): every one gone, then
  # the base itself.
  for d in "$work/node-state/vms" "$work/node-state/tmp" "$jail_base"/*; do
    [[ -d "$d" ]] && for f in "$d"/*; do [[ -e "$f" ]] && leaks+=("file $f"); done
  done
  # Anything still owned by a per-VM uid or gid (the confined VMMs' range, IMP_JAIL_UID_BASE/COUNT)
  # anywhere under the run's directories (state directory, logs, jails: VM directories, drives,
  # sockets, snapshots, device nodes), and any process running as one.
  uid_lo=${IMP_JAIL_UID_BASE:-900000}
  uid_hi=$((uid_lo + ${IMP_JAIL_UID_COUNT:-4096}))
  while read -r owned; do [[ -n "$owned" ]] && leaks+=("file of a VM uid: $owned"); done \
    < <(find "$work" "$jail_base" -xdev \( \( -uid +$((uid_lo - 1)) -uid -"$uid_hi" \) -o \( -gid +$((uid_lo - 1)) -gid -"$uid_hi" \) \) \
      -printf '%U:%G %p\n' 2>/dev/null)
  while read -r puid pid comm; do
    ((puid >= uid_lo && puid < uid_hi)) && leaks+=("process $pid ($comm) running as VM uid $puid")
  done < <(ps -e -o uid=,pid=,comm=)
  # The jail base goes: the runtime's <base>/<exec file name> directories (which it keeps, as a node
  # keeps /var/lib/imp/jailer/firecracker) must be empty by now, and what was in them is listed above.
  for d in "$jail_base"/*; do [[ ! -d "$d" ]] || rmdir "$d" 2>/dev/null || true; done
  rmdir "$jail_base" 2>/dev/null || leaks+=("jail base $jail_base not empty: $(ls -A "$jail_base" | tr '\n' ' ')")
  # Per-VM cgroups (the simulated path's parent, or IMP_VM_CGROUP_PARENT given to the real-guest
  # path's runtime), then the directories the run made.
  for d in $(vm_cgroups); do leaks+=("cgroup $d"); done
  if [[ -n "${IMP_VM_CGROUP_PARENT:-}" ]]; then
    cg_root=${IMP_VM_CGROUP_ROOT:-/sys/fs/cgroup}
    for d in "$cg_root/$IMP_VM_CGROUP_PARENT" "$cg_root"/{memory,cpu,pids}/"$IMP_VM_CGROUP_PARENT"; do
      [[ -d "$d" ]] && for f in "$d"/*/; do [[ -d "$f" ]] && leaks+=("cgroup $f"); done
    done
  fi
  ((${#leaks[@]} > 0)) || remove_cgroups || leaks+=("cgroup directories the run made: ${cg_made[*]}")
  for leak in "${leaks[@]}"; do printf 'LEAK  %s\n' "$leak" >&2; done
  ((code == 0)) || exit "$code"
  ((${#leaks[@]} == 0)) || fail "the smoke left ${#leaks[@]} thing(s) of its own behind (listed above)"
  pass "nothing left: no process, link, nft table, VM file, jail (base $jail_base removed), file or process of a VM uid, or VM cgroup ($([[ -n $cg_parent ]] && echo "parent $cg_parent removed" || echo none made)) of the smoke (ImpVMs, Secrets, registrations and IP allocations checked above)"
  passed=1
  echo "imp-smoke --local: all stages passed; timeline in $report"
  exit 0
fi

# --inside: the stages, in the smoke's network namespace.
pids=()
torn_down=0
runtime_sock="$work/runtime.sock"
# On any exit: delete the pool while operator, agent and runtime still run (so VMs, TAPs and
# registrations go the way they go in production), then DELETE what the runtime still holds, then stop
# every process this script started.
inner_cleanup() {
  local p uid
  if [[ $torn_down == 0 ]] && declare -F kubectl >/dev/null; then
    kubectl delete imprp imp --wait=false >/dev/null 2>&1 || true
    wait_for 30 no_vms || true
  fi
  if [[ -S "$runtime_sock" ]]; then
    for uid in $(curl -sf --unix-socket "$runtime_sock" http://imp/v1/vms | jq -r '.vms[].uid' 2>/dev/null); do
      curl -sf -X DELETE --unix-socket "$runtime_sock" "http://imp/v1/vms/$uid" >/dev/null || true
    done
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap inner_cleanup EXIT
# The host's cgroup hierarchies again under this namespace's /sys (see $work/host-cgroups): the memory,
# cpu and pids ones the VMs' cgroups are made in (same hierarchies, so the leak check outside sees
# them); this mount namespace only, gone with it.
if [[ -n "${IMP_SMOKE_CGROUP_PARENT:-}" ]]; then
  if grep -q '^cgroup2 /sys/fs/cgroup ' "$work/host-cgroups"; then
    mount -t cgroup2 cgroup2 /sys/fs/cgroup || fail "mounting cgroup2 on /sys/fs/cgroup in the smoke's namespace"
  else
    mount -t tmpfs -o mode=0755 imp-smoke-cgroups /sys/fs/cgroup || fail "mounting a tmpfs on /sys/fs/cgroup in the smoke's namespace"
    for c in memory cpu pids; do
      mp="" opts=""
      read -r mp opts < <(awk -v c="$c" '$1 == "cgroup" && ("," $3 ",") ~ ("," c ",") {print $2, $3; exit}' "$work/host-cgroups") || true
      [[ -n "$mp" ]] || fail "no $c cgroup hierarchy in $work/host-cgroups"
      if ! mountpoint -q "$mp"; then
        mkdir -p "$mp"
        mount -t cgroup -o "$opts" cgroup "$mp" || fail "mounting the $c cgroup hierarchy on $mp"
      fi
      [[ -e "/sys/fs/cgroup/$c" ]] || ln -s "$(basename "$mp")" "/sys/fs/cgroup/$c"
    done
  fi
fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# IMP_SMOKE_TARGETS_DIR (helm/monitoring-test.py): each process's metrics endpoint is written there as a
# Prometheus file_sd target before it starts, and the processes stay up until a file `release` appears.
target() {
  [[ -n "${IMP_SMOKE_TARGETS_DIR:-}" ]] || return 0
  printf '[{"targets":["%s"],"labels":{"job":"%s","namespace":"imp-system"%s}}]\n' "$2" "$1" "${3:+,\"node\":\"$3\"}" \
    >"$IMP_SMOKE_TARGETS_DIR/.$1" && mv "$IMP_SMOKE_TARGETS_DIR/.$1" "$IMP_SMOKE_TARGETS_DIR/$1.json"
}
timeline() { python3 "$repo/smoke/timeline.py" "$@"; }

"$bin/imp-testenv" up --dir "$work/cp" >"$work/testenv.out" 2>"$work/testenv.err" &
pids+=($!)
wait_for 60 grep -q '^KUBECONFIG=' "$work/testenv.out" || fail "control plane did not start: $(tail -5 "$work/testenv.err")"
export KUBECONFIG="$work/cp/kubeconfig"
kubectl() { "$repo/testenv/bin/kubectl" "$@"; }
no_vms() { [[ -z "$(kubectl get impvm -o name)" ]]; }
pass "control plane up (etcd, kube-apiserver, kube-controller-manager) with Imp's CRDs"
# Every version of every ImpVM and every Event, as the API server had them: the timeline's record.
timeline watch "$work/impvms.jsonl" -- "$repo/testenv/bin/kubectl" get --raw \
  '/apis/imp.dev/v1alpha1/namespaces/default/impvms?watch=1&timeoutSeconds=1800' 2>"$work/watch-impvms.err" &
pids+=($!)
timeline watch "$work/events.jsonl" -- "$repo/testenv/bin/kubectl" get --raw \
  '/apis/events.k8s.io/v1/namespaces/default/events?watch=1&timeoutSeconds=1800' 2>"$work/watch-events.err" &
pids+=($!)

op_port=$(free_port)
runtime_metrics="127.0.0.1:$(free_port)"
agent_port=$(free_port)
target imp-operator "127.0.0.1:$op_port"
target imp-runtime "$runtime_metrics" smoke-node
target imp-agent "127.0.0.1:$agent_port" smoke-node
# Prometheus applies discovered targets at most every 5 s: the processes start once it has all three,
# so their first samples precede anything they count.
if [[ -n "${IMP_SMOKE_TARGETS_DIR:-}" ]]; then
  wait_for 60 test -e "$IMP_SMOKE_TARGETS_DIR/targets-seen" || fail "no $IMP_SMOKE_TARGETS_DIR/targets-seen within 60 s"
fi
# The simulator in its own namespace: the operator (listening on the node's uplink address too)
# gets its webhooks, and the operator and the runners reach it, through the veth.
ip netns exec "$IMP_SMOKE_GH_NS" "$bin/github-sim" --listen 198.51.100.1:0 --org acme --repo acme/app --secret-dir "$work/app" \
  --webhook-url "http://198.51.100.2:$op_port/webhooks/github" >"$work/sim.out" 2>"$work/sim.err" &
pids+=($!)
wait_for 20 grep -q '^http' "$work/sim.out" || fail "GitHub simulator did not start: $(tail -3 "$work/sim.err")"
sim=$(head -1 "$work/sim.out")
pass "GitHub simulator at $sim in $IMP_SMOKE_GH_NS (App key and ids written for the Secret)"

kubectl create secret generic imp-github-app --from-file="$work/app/app-id" \
  --from-file="$work/app/installation-id" --from-file="$work/app/private-key" >/dev/null
kubectl create secret generic imp-webhook --from-literal=webhook-secret=imp-sim-webhook-secret >/dev/null
# The pool's images, served by a local registry (Debian's docker-registry) for imp-runtime's rootfs cache.
reg_port=$(free_port)
printf 'version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: 127.0.0.1:%s\n' \
  "$work/registry" "$reg_port" >"$work/registry.yml"
docker-registry serve "$work/registry.yml" >"$work/registry.log" 2>&1 &
pids+=($!)
wait_for 15 curl -sf "http://127.0.0.1:$reg_port/v2/" || fail "docker-registry did not start: $(tail -3 "$work/registry.log")"
if [[ $guest == qemu ]]; then
  # What the guest runs: a base with Debian's static busybox as /bin/sh (the runner image's
  # wrappers are shell scripts), and the runner image as images/runner/build.sh makes it, with the
  # static imp-fake-runner in place of actions/runner.
  base_img="127.0.0.1:$reg_port/imp-dev/runner-base:smoke"
  "$repo/images/busybox-base/build.sh" --out "$work/base-oci" --tag smoke --push "$base_img" >"$work/skopeo.log" 2>&1 \
    || fail "images/busybox-base/build.sh: $(tail -3 "$work/skopeo.log")"
  runner_img="127.0.0.1:$reg_port/imp-dev/actions-runner:smoke"
  "$repo/images/runner/build.sh" --fake-runner "$static_dir/imp-fake-runner" --out "$work/runner-oci" --tag smoke --push "$runner_img" \
    >"$work/runner-image.log" 2>&1 || fail "images/runner/build.sh: $(tail -3 "$work/runner-image.log")"
  pass "images pushed to a local registry: $base_img (static busybox), $runner_img (images/runner/build.sh, static imp-fake-runner)"
else
  base_img=$("$bin/imp-push-image" "127.0.0.1:$reg_port" imp-dev/runner-base:smoke etc/imp-smoke=base) \
    || fail "pushing the base image to the local registry: $(tail -3 "$work/registry.log")"
  runner_img=$("$bin/imp-push-image" "127.0.0.1:$reg_port" imp-dev/actions-runner:smoke opt/runner/VERSION=smoke) \
    || fail "pushing the runner image to the local registry"
  pass "images pushed to a local registry ($base_img, $runner_img)"
fi

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
pass "node smoke-node Ready with a fresh agent Lease"

# The node's two processes: imp-runtime and imp-agent, whose runner is imp-fake-runner against the
# GitHub simulator. On the qemu path imp-runtime's QEMU backend boots real guests and the runner
# command is the runner image's wrapper inside the guest; on the simulated path the Firecracker
# simulator runs imp-guest as a process here, so the runner command is a host binary.
: >"$work/vmlinux"
# The simulated path's Firecracker runs through testkit's jailer double, as production's runs through
# its jailer (--jailer-path): the jailer's command line and steps (chroot by pivot_root under
# $IMP_SMOKE_JAIL_BASE, mount and PID namespaces, the VM's cgroups, cleared environment, device nodes
# owned by the VM's uid). Its deviations for the simulator (testkit/src/bin/jailer-double.rs), as the
# real-node test uses them: the host's libraries, imp-guest, the fake runner and $work/sim (the chaos
# knobs' behaviour file and hold files) bound read-only into each jail; IMP_GUEST_BIN and
# IMP_SIM_BEHAVIOUR kept; and the simulator left root in its jail (KEEP_ROOT), because the simulated
# guest switches to the runner's user (uid 1001) as a real guest, root in its VM, does.
mkdir -p "$work/sim" "$work/node-state"
# imp-chaos-check looks for jails (files and jailed processes) at the runtime's default base,
# <state>/jailer: a link to this run's.
ln -s "$IMP_SMOKE_JAIL_BASE" "$work/node-state/jailer"
# /proc/meminfo and /proc/uptime alone (read-only file binds, not /proc, whose /proc/<pid>/root would
# lead out of the jail): the simulated guest's agent reports its memory and uptime from them, which the
# dashboard's guest panels show (helm/monitoring-test.py).
jail_binds=$(for b in /usr /bin /sbin /lib /lib64; do [[ -e $b ]] && printf '%s,' "$b"; done)"$bin/imp-guest,$bin/imp-fake-runner,$work/sim,/proc/meminfo,/proc/uptime"
backend_env() {
  if [[ $guest == qemu ]]; then
    echo IMP_VMM_BACKEND=qemu IMP_QEMU_BIN="$(command -v qemu-system-x86_64)" IMP_VHOST_VSOCK_BIN="$(command -v vhost-device-vsock)" \
      IMP_QEMU_ACCEL="$IMP_SMOKE_ACCEL" IMP_KERNEL="$IMP_SMOKE_KERNEL" IMP_INITRD="$work/initrd.gz" \
      IMP_GUEST_BIN="$static_dir/imp-guest" IMP_BOOT_TIMEOUT=240s
  else
    # The simulator through the jailer double (above), each VM in cgroups of its own.
    echo IMP_FIRECRACKER_BIN="$bin/imp-firecracker-sim" IMP_KERNEL="$work/vmlinux" IMP_GUEST_BIN="$bin/imp-guest" \
      IMP_JAILER_PATH="$bin/jailer-double" IMP_JAILER_CHROOT_BASE_DIR="$IMP_SMOKE_JAIL_BASE" \
      IMP_JAILER_DOUBLE_BIND="$jail_binds" IMP_JAILER_DOUBLE_KEEP_ENV=IMP_GUEST_BIN,IMP_SIM_BEHAVIOUR IMP_JAILER_DOUBLE_KEEP_ROOT=1 \
      ${IMP_SMOKE_CGROUP_PARENT:+IMP_VM_CGROUP_PARENT="$IMP_SMOKE_CGROUP_PARENT"}
  fi
}
runner_command() { if [[ $guest == qemu ]]; then echo /usr/local/bin/imp-runner; else echo "$bin/imp-fake-runner"; fi; }
# A real boot under TCG takes tens of seconds: the waits for a VM's phases scale with the path.
slow=1; [[ $guest == qemu ]] && slow=4
# Each process starts through its function, so a chaos scenario can start it again after a kill -9
# (logs append).
start_runtime() {
  # shellcheck disable=SC2046 # backend_env's words are NAME=value pairs without spaces
  env IMP_RUNTIME_SOCKET="$runtime_sock" IMP_STATE_DIR="$work/node-state" $(backend_env) IMP_METRICS_ADDR="$runtime_metrics" \
    IMP_INSECURE_REGISTRIES="127.0.0.1:$reg_port" IMP_NODE_LOCAL_REGISTRIES="127.0.0.1:$reg_port" "$bin/imp-runtime" >>"$work/runtime.log" 2>&1 &
  pids+=($!); runtime_pid=$!
  wait_for 20 curl -sf --unix-socket "$runtime_sock" http://imp/healthz || fail "imp-runtime not healthy: $(tail -3 "$work/runtime.log")"
  if [[ $guest == simulated ]]; then
    grep -q "Firecracker runs through its jailer" "$work/runtime.log" || fail "imp-runtime did not say Firecracker runs through its jailer: $(tail -3 "$work/runtime.log")"
  fi
}
start_agent() {
  IMP_NODE_NAME=smoke-node IMP_NAMESPACE=default IMP_RUNTIME_SOCKET="$runtime_sock" IMP_HEARTBEAT_INTERVAL=2s \
    IMP_POLL_INTERVAL=1s IMP_SWEEP_INTERVAL=2s IMP_GUEST_METRICS_INTERVAL=2s IMP_HTTP_ADDR="127.0.0.1:$agent_port" IMP_RUNNER_COMMAND="$(runner_command)" \
    "$bin/imp-agent" >>"$work/agent.log" 2>&1 &
  pids+=($!); agent_pid=$!
  wait_for 20 curl -sf "http://127.0.0.1:$agent_port/healthz" || fail "imp-agent not healthy: $(tail -3 "$work/agent.log")"
}
# IMP_REAP_INTERVAL=10s: an idle runner whose VM was deleted (the switch to the simulated path below
# deletes the real guest's) keeps its GitHub registration until the pool's orphan reaper runs, 2 min
# by default.
start_operator() {
  IMP_REAP_INTERVAL=10s IMP_HTTP_ADDR="0.0.0.0:$op_port" IMP_NAMESPACE=default IMP_WEBHOOK_SECRET_NAME=imp-webhook \
    IMP_GITHUB_API_URL="$sim" "$bin/imp-operator" >>"$work/operator.log" 2>&1 &
  pids+=($!); operator_pid=$!
  wait_for 30 curl -sf "http://127.0.0.1:$op_port/readyz" || fail "imp-operator not ready: $(tail -3 "$work/operator.log")"
}
start_runtime
start_agent
if [[ $guest == qemu ]]; then
  pass "imp-runtime (QEMU backend, $IMP_SMOKE_ACCEL, $IMP_SMOKE_KERNEL) and imp-agent started for smoke-node"
else
  pass "imp-runtime (Firecracker simulator through the jailer double, jails under $IMP_SMOKE_JAIL_BASE, VM cgroups under ${IMP_SMOKE_CGROUP_PARENT:-none}) and imp-agent started for smoke-node"
fi

# The manifest's network moves to TEST-NET-1 (the smoke's namespace routes nothing else).
sed -e "s#ghcr.io/imp-dev/runner-base:ubuntu-24.04#$base_img#" -e "s#ghcr.io/imp-dev/actions-runner:2#$runner_img#" \
  -e 's#subnet: 10.60.0.0/24#subnet: 192.0.2.0/24#' -e 's#gateway: 10.60.0.1#gateway: 192.0.2.1#' \
  -e 's#dns: \[1.1.1.1\]#dns: [203.0.113.53]#' "$repo/smoke/manifests/runner-pool.yaml" >"$work/runner-pool.yaml"
# A real guest on a shared CI host: one vCPU and 512 MiB are plenty for the fake runner.
[[ $guest == qemu ]] && sed -i -e 's#^  vcpu: 2$#  vcpu: 1#' -e 's#^  memoryMiB: 2048$#  memoryMiB: 512#' "$work/runner-pool.yaml"
grep -q 'subnet: 192.0.2.0/24' "$work/runner-pool.yaml" || fail "smoke/manifests/runner-pool.yaml: the network's subnet is no longer 10.60.0.0/24 (the smoke rewrites it to TEST-NET-1)"
kubectl apply -f "$work/runner-pool.yaml" >/dev/null || fail "applying smoke/manifests/runner-pool.yaml (images pointed at the local registry)"
pass "GitHub App Secret, webhook Secret, class, network (192.0.2.0/24) and runner pool accepted by the API server"

start_operator
pass "imp-operator ready (ImpVM controller, runner-pool controller, webhook receiver)"

# minIdle 1: one runner VM with a one-time JIT config Secret owned by it, registered at the simulator.
minted_vm() { kubectl get impvm -l imp.dev/runner-pool=imp -o jsonpath='{.items[?(@.spec.runnerConfigSecret)].metadata.name}' | grep -q .; }
wait_for 30 minted_vm || fail "no runner VM with a JIT Secret: $(kubectl describe imprp imp | tail -5)"
vm=$(kubectl get impvm -l imp.dev/runner-pool=imp -o jsonpath='{.items[?(@.spec.runnerConfigSecret)].metadata.name}' | cut -d' ' -f1)
secret=$(kubectl get impvm "$vm" -o jsonpath='{.spec.runnerConfigSecret}')
vm_uid=$(kubectl get impvm "$vm" -o jsonpath='{.metadata.uid}')
owner=$(kubectl get secret "$secret" -o jsonpath='{.metadata.ownerReferences[0].name}')
[[ "$owner" == "$vm" ]] || fail "JIT Secret $secret is owned by '$owner', not by $vm"
# Held in memory only, to prove at the end that no log of the run carries it.
jitconfig=$(kubectl get secret "$secret" -o jsonpath='{.data.jitconfig}' | base64 -d)
[[ -n "$jitconfig" ]] || fail "JIT Secret $secret has no jitconfig key"
curl -sf "$sim/_admin/runners" | jq -e 'length > 0' >/dev/null || fail "no runner registered at the GitHub simulator"
pass "runner VM $vm with JIT Secret $secret (owned by the VM; runner registered at GitHub)"

# What the jailer did to VM $1's simulator, from /proc (the details: node/runtime/tests/jailer.rs):
# its root is the VM's jail (pivot_root; compared by inode), with neither the host's /etc/shadow
# nor the state directory in it; a PID namespace of its own (pid 1 there) and a mount namespace
# of its own; the VM's memory cgroup. Sets $confined to what it saw.
confined_vmm() {
  local uid=$1 pid jail nspid cg
  pid=$(curl -sf --unix-socket "$runtime_sock" "http://imp/v1/vms/$uid" | jq -r '.pid // empty')
  jail="$IMP_SMOKE_JAIL_BASE/imp-firecracker-sim/$uid/root"
  [[ -n "$pid" && -d "$jail" ]] || { echo "no VMM pid or no jail $jail" >&2; return 1; }
  [[ "$(stat -L -c %d:%i "/proc/$pid/root")" == "$(stat -c %d:%i "$jail")" ]] || { echo "pid $pid: root is not $jail" >&2; return 1; }
  [[ ! -e "/proc/$pid/root/etc/shadow" && ! -e "/proc/$pid/root$work/node-state" ]] || { echo "pid $pid sees the host's files" >&2; return 1; }
  nspid=$(awk '/^NSpid:/ {print NF - 1, $NF}' "/proc/$pid/status")
  [[ "$nspid" == "2 1" ]] || { echo "pid $pid: not pid 1 of a PID namespace of its own (NSpid: $nspid)" >&2; return 1; }
  [[ "$(readlink "/proc/$pid/ns/mnt")" != "$(readlink /proc/self/ns/mnt)" ]] || { echo "pid $pid: the runtime's mount namespace" >&2; return 1; }
  confined="pid $pid, root $jail, PID and mount namespaces of its own"
  if [[ -n "${IMP_SMOKE_CGROUP_PARENT:-}" ]]; then
    cg=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {m = $3} $2 == "" {u = $3} END {print (m != "" ? m : u)}' "/proc/$pid/cgroup")
    [[ "$cg" == "/$IMP_SMOKE_CGROUP_PARENT/$uid" ]] || { echo "pid $pid: memory cgroup $cg, not /$IMP_SMOKE_CGROUP_PARENT/$uid" >&2; return 1; }
    confined+=", memory cgroup $cg"
  fi
}
# From here the ImpVM's recorded versions are the evidence: the pool deletes a finished VM within moments.
seen() { timeline field "$work/impvms.jsonl" "$@"; }
vm_state() { kubectl get impvm "$vm" -o jsonpath='{.status.phase}/{.status.reason}: {.status.message}' 2>/dev/null; }
wait_for 30 seen "$vm" status.scheduledTime || fail "runner VM $vm not scheduled: $(kubectl get impvm "$vm" -o jsonpath='{.status.conditions}')"
pass "runner VM $vm scheduled onto smoke-node"
wait_for $((60 * slow)) seen "$vm" status.bootCompleteTime || fail "runner VM $vm: no guest Hello ($(vm_state)): $(tail -3 "$work/agent.log")"
if [[ $guest == qemu ]]; then
  pass "runner VM $vm booted a real kernel under QEMU (rootfs built from the registry images): guest Hello at $(seen "$vm" status.bootCompleteTime)"
else
  pass "runner VM $vm booted (rootfs built from the registry images): guest Hello at $(seen "$vm" status.bootCompleteTime)"
  confined_vmm "$vm_uid" || fail "runner VM $vm: its VMM is not confined as the jailer confines it"
  pass "runner VM $vm's VMM jailed: $confined"
fi
wait_for $((30 * slow)) seen "$vm" status.runner.handoff Started || fail "runner VM $vm: no handoff Started ($(vm_state)): $(tail -3 "$work/agent.log")"
pass "runner VM $vm handed its JIT config: handoff Started (runner id $(seen "$vm" status.runner.runnerId))"
secret_gone() { ! kubectl get secret "$secret" >/dev/null 2>&1; }
wait_for 10 secret_gone || fail "JIT Secret $secret still exists after the handoff"
pass "JIT Secret $secret deleted after Started"

job=$(curl -sf -X POST -H 'content-type: application/json' -d '{"labels":["self-hosted","imp"]}' "$sim/_admin/jobs" | jq -r .id) \
  || fail "queueing a job at the simulator"
accepted() { curl -sf "http://127.0.0.1:$op_port/metrics" | grep -qE '^imp_webhook_deliveries_total\{result="accepted"\} [1-9]'; }
wait_for 20 accepted || fail "the queued workflow_job webhook was not accepted: $(grep -i webhook "$work/operator.log" | tail -3)"
accepted_at=$(date +%s.%N)
pass "job $job queued with labels [self-hosted, imp]; signed workflow_job webhook accepted by the operator"
job_status() { [[ "$(curl -sf "$sim/_admin/jobs/$job" | jq -r .status)" == "$1" ]]; }
wait_for $((60 * slow)) job_status completed || fail "job $job not completed (status $(curl -sf "$sim/_admin/jobs/$job" | jq -r .status); VM $(vm_state))"
wait_for 30 seen "$vm" status.runner.exitCode 0 || fail "the runner did not exit 0 ($(vm_state)): $(tail -3 "$work/agent.log")"
pass "imp-fake-runner took job $job on $vm, completed it and exited 0$([[ $guest == qemu ]] && echo " (inside the guest, over the VM's network and NAT)")"
vm_deleted() { ! kubectl get impvm "$vm" >/dev/null 2>&1; }
wait_for $((60 * slow)) vm_deleted || fail "runner VM $vm not deleted after success (TornDown: $(kubectl get impvm "$vm" -o jsonpath='{.status.conditions[?(@.type=="TornDown")].status}'))"
curl -sf --unix-socket "$runtime_sock" http://imp/v1/vms | grep -q "$vm_uid" && fail "imp-runtime still holds $vm_uid after teardown"
pass "runner VM $vm deleted by the pool after TornDown; imp-runtime released it"
replacement() { timeline replacement "$work/impvms.jsonl" "$vm" status.runner.startedTime; }
wait_for $((60 * slow)) replacement || fail "the pool did not replace the finished runner VM with a started runner"
pass "the pool replaced the runner (minIdle 1): $(replacement) is idle with its runner started"
if [[ -n "${IMP_SMOKE_TARGETS_DIR:-}" ]]; then
  : >"$IMP_SMOKE_TARGETS_DIR/holding"
  wait_for 600 test -e "$IMP_SMOKE_TARGETS_DIR/release" || fail "no $IMP_SMOKE_TARGETS_DIR/release within 10 min"
fi

# The timeline, from what the API server, the simulator and the runtime recorded.
curl -sf "$sim/_admin/jobs" >"$work/jobs.json"
curl -sf "http://$runtime_metrics/metrics" >"$work/runtime.metrics" || true
mkdir -p "$(dirname "$report")"
# kubectl-imp's timeline (kubectl-imp/src/timeline.rs): what `kubectl imp timeline` shows on a cluster,
# from this run's recorded versions.
"$bin/kubectl-imp" timeline "$vm" --out "$report" --path "$guest" --replacement "$(replacement)" --job "$job" \
  --impvms "$work/impvms.jsonl" --events "$work/events.jsonl" --jobs "$work/jobs.json" \
  --accepted-at "$accepted_at" --runtime-metrics "$work/runtime.metrics" || fail "the timeline misses phases (above)"
# How the VMM was confined, for a reader of the report.
if [[ $guest == simulated ]]; then
  confinement="Firecracker simulator through testkit's jailer double (imp-runtime --jailer-path): $confined"
else
  confinement="QEMU confined by imp-runtime (docs/security.md)"
fi
jq --arg c "$confinement" '. + {confinement: $c}' "$report" >"$report.tmp" && mv "$report.tmp" "$report"
pass "timeline of every phase (above; JSON in $report)"

jobs_queued=("$job")
jits=("$jitconfig")
captured=("secret/$secret")
# imp-chaos-check [--settled] over every job queued and JIT config seen so far (through stdin: never
# on argv or disk).
invariants() {
  local job_args=() j
  for j in "${jobs_queued[@]}"; do job_args+=(--job "$j"); done
  printf '%s\n' "${jits[@]}" | "$bin/imp-chaos-check" "$@" --sim "$sim" "${job_args[@]}" --state-dir "$work/node-state" \
    --logs "$work" --skip "$work/cp" --jit-configs-stdin
}
if [[ $chaos == 1 && $guest == qemu ]]; then
  # The chaos scenarios (dozens of VMs, kill -9 at handoff phases) run on the simulated path: the
  # pool scales to zero, the node's two processes restart on the Firecracker simulator through the
  # jailer double (same state dir), and the pool scales back to one idle runner.
  t_switch=$SECONDS
  kubectl patch imprp imp --type=merge -p '{"spec":{"scaling":{"minIdle":0}}}' >/dev/null
  kubectl delete impvm -l imp.dev/runner-pool=imp --wait=false >/dev/null
  wait_for 120 no_vms || fail "switching to the simulated path: ImpVMs left: $(kubectl get impvm -o name | tr '\n' ' ')"
  released() { curl -sf --unix-socket "$runtime_sock" http://imp/v1/vms | jq -e '.vms | length == 0'; }
  wait_for 30 released || fail "switching to the simulated path: imp-runtime still holds VMs"
  for pid in "$agent_pid" "$runtime_pid"; do kill -TERM "$pid"; wait "$pid" || fail "imp-agent/imp-runtime did not stop on SIGTERM for the switch"; done
  guest=simulated slow=1
  start_runtime
  start_agent
  kubectl patch imprp imp --type=merge -p '{"spec":{"scaling":{"minIdle":1}}}' >/dev/null
  idle_started() { kubectl get impvm -l imp.dev/runner-pool=imp -o json | jq -e '[.items[] | select(.status.runner.handoff == "Started")] | length > 0'; }
  wait_for 60 idle_started || fail "switching to the simulated path: no idle runner started on the simulator"
  # The deleted idle runner's GitHub registration goes with the pool's next runner sweep (which the
  # minIdle patch triggers), not with its VM: wait until every registration is a live VM's.
  registered_live() {
    local live
    live=$(kubectl get impvm -o json | jq -c '[.items[] | .metadata.annotations["imp.dev/github-runner-name"] // empty]')
    curl -sf "$sim/_admin/runners" | jq -e --argjson live "$live" '(map(.name) - $live) | length == 0'
  }
  wait_for 90 registered_live || fail "switching to the simulated path: registrations of deleted VMs left: $(curl -sf "$sim/_admin/runners" | jq -c 'map(.name)')"
  pass "node switched to the Firecracker simulator, jailed through the jailer double (jails under $IMP_SMOKE_JAIL_BASE), for the chaos scenarios (pool drained, runtime and agent restarted, runner idle again: $((SECONDS - t_switch)) s)"
fi
# The chaos scenarios (smoke/chaos.sh), each followed by the settled-state invariants.
if [[ $chaos == 1 ]]; then
  # shellcheck source=smoke/chaos.sh
  source "$repo/smoke/chaos.sh"
fi

# Teardown the way an operator would: delete the pool, and everything it made must go.
kubectl delete imprp imp --wait=false >/dev/null
wait_for 60 no_vms || fail "ImpVMs left after deleting the pool: $(kubectl get impvm -o name | tr '\n' ' ')"
pool_gone() { ! kubectl get imprp imp >/dev/null 2>&1; }
wait_for 30 pool_gone || fail "pool imp still exists (finalizer): $(kubectl get imprp imp -o jsonpath='{.status.conditions}')"
torn_down=1
runtime_empty() { curl -sf --unix-socket "$runtime_sock" http://imp/v1/vms | jq -e '.vms | length == 0'; }
wait_for 30 runtime_empty || fail "imp-runtime still holds VMs after the pool went: $(curl -sf --unix-socket "$runtime_sock" http://imp/v1/vms)"
jit=$(kubectl get secret -l imp.dev/secret-kind=jitconfig -o name)
[[ -z "$jit" ]] || fail "JIT Secrets left: $jit"
runners=$(curl -sf "$sim/_admin/runners" | jq -r 'map(.name) | join(" ")')
[[ -z "$runners" ]] || fail "runners still registered at GitHub: $runners"
allocations=$(kubectl get impnetwork runners -o json | jq -c '.status.allocations // {}')
[[ "$allocations" == "{}" ]] || fail "IP allocations left on ImpNetwork runners: $allocations"
kubectl delete -f "$work/runner-pool.yaml" --ignore-not-found >/dev/null
pass "pool deleted: no ImpVM, JIT Secret, runtime VM, GitHub registration or IP allocation left"

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
# The chaos invariants over the whole run, from imp_testkit::chaos.
invariants || fail "invariants broken (VIOLATION lines above)"
pass "invariants hold over ${#jobs_queued[@]} job(s) and ${#jits[@]} JIT config(s) (imp-chaos-check)"
# Every log of the run: the processes' own, the VMs' console and VMM logs (etcd's data is not a log).
logs=$(find "$work" -path "$work/cp" -prune -o -type f \( -name '*.log' -o -name '*.out' -o -name '*.err' -o -name '*.jsonl' \) -print)
leaked=$(grep -lF -- "$jitconfig" $logs || true)
[[ -z "$leaked" ]] || fail "the JIT config appears in: $leaked"
pass "the JIT config appears in none of the run's $(wc -w <<<"$logs") log files"
