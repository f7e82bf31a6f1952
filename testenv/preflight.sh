#!/usr/bin/env bash
# What `make smoke` and `make test` need, checked before anything long runs (testenv/build.sh's first
# Go build takes minutes): toolchains, Debian packages, vhost-device-vsock, root for the smoke.
#
#   testenv/preflight.sh build|smoke|smoke-simulated|test
#       build            go (only while testenv/build.sh has something to build) and cargo
#       smoke            build + what smoke/imp-smoke.sh --local needs, real-guest path included
#       smoke-simulated  build + what smoke/imp-smoke.sh --local --guest simulated needs
#       test             build + everything `make test` runs (the smoke, guest/vm-test.sh, images/,
#                        the monitoring test, the real node of testkit/tests/real_node.rs)
#
# What is missing is installed by default when it can be: as root with apt-get (Debian packages) and
# cargo (vhost-device-vsock). IMP_INSTALL_DEPS=0 refuses installing; then, or when installing is not
# possible, it fails at once, naming what is missing and the command that installs it. Packages are
# checked with dpkg-query where there is one, else by a command each package provides.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
what="${1:-}"
say() { printf 'preflight: %s\n' "$*"; }
die() { printf 'preflight: FAIL %s\n' "$*" >&2; exit 1; }

# package:command. The command proves the package where dpkg-query cannot (non-Debian hosts).
smoke_base=(iproute2:ip nftables:nft python3:python3 curl:curl jq:jq docker-registry:docker-registry)
# The real-guest path (imp-runtime's QEMU backend): the kernel as a file, busybox as a static binary.
smoke_guest=(qemu-system-x86:qemu-system-x86_64 cpio:cpio skopeo:skopeo kmod:modinfo binutils:readelf
  linux-image-cloud-amd64:/boot/vmlinuz-*-cloud-amd64 busybox-static:/bin/busybox)
# .ci/run's list before it moved here: file (static-binary check), util-linux (namespaces), e2fsprogs
# (ext4 images), apache2-utils (htpasswd for the registry's basic auth), zstd (zstd layers),
# ca-certificates (component images), dnsmasq-base (the VM network tests' DNS server), prometheus
# (the dashboard test), containerd, runc, containernetworking-plugins and gcc/libc6-dev (the real node:
# container runtime, CNI bridge, the static pause binary); mmdebstrap (the reference base image,
# images/base/).
test_extra=(file:file util-linux:unshare e2fsprogs:mkfs.ext4 make:make apache2-utils:htpasswd zstd:zstd
  ca-certificates:/etc/ssl/certs/ca-certificates.crt dnsmasq-base:dnsmasq prometheus:promtool
  containerd:containerd runc:runc containernetworking-plugins:/usr/lib/cni/bridge gcc:gcc
  libc6-dev:/usr/include/stdio.h mmdebstrap:mmdebstrap)
vsock_version=0.3.0

case "$what" in
  build) pkgs=() vsock=0 root=0 ;;
  smoke) pkgs=("${smoke_base[@]}" "${smoke_guest[@]}") vsock=1 root=1 ;;
  smoke-simulated) pkgs=("${smoke_base[@]}") vsock=0 root=1 ;;
  test) pkgs=("${smoke_base[@]}" "${smoke_guest[@]}" "${test_extra[@]}") vsock=1 root=1 ;;
  *) echo "usage: testenv/preflight.sh build|smoke|smoke-simulated|test" >&2; exit 2 ;;
esac

installed() {
  local pkg="${1%%:*}" probe="${1#*:}"
  if command -v dpkg-query >/dev/null; then
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'
  elif [[ "$probe" == /* ]]; then
    compgen -G "$probe" >/dev/null
  else
    command -v "$probe" >/dev/null
  fi
}

missing=()
for p in "${pkgs[@]}"; do installed "$p" || missing+=("${p%%:*}"); done
need_vsock=0
((vsock)) && ! command -v vhost-device-vsock >/dev/null && need_vsock=1
# Toolchains are not installed from here: Debian's Go is older than testenv's go.mod wants.
command -v cargo >/dev/null || die "no cargo on PATH: install Rust with rustup (https://rustup.rs)"
stale=$("$here/build.sh" --stale)
if [[ -n "$stale" ]] && ! command -v go >/dev/null; then
  die "no go on PATH, and testenv/build.sh must build $stale: install Go $(awk '$1 == "go" {print $2}' "$here/kube/go.mod") or later (https://go.dev/dl)"
fi
if ((root)) && ((EUID != 0)); then
  die "the smoke needs root (network namespaces, bridges, TAPs, nft tables): run it with sudo"
fi

command_for() {
  local apt="apt-get install -y --no-install-recommends ${missing[*]}"
  local vsock="cargo install --locked vhost-device-vsock --version $vsock_version"
  if ((${#missing[@]} && need_vsock)); then echo "$1$apt && $vsock"
  elif ((${#missing[@]})); then echo "$1$apt"
  else echo "$vsock"; fi
}
what_missing() {
  local list=("${missing[@]}")
  ((need_vsock)) && list+=(vhost-device-vsock)
  echo "${list[*]}"
}

if ((${#missing[@]} == 0 && need_vsock == 0)); then
  say "$what: everything needed is installed"
  exit 0
fi
if [[ "${IMP_INSTALL_DEPS:-1}" == 0 ]]; then
  die "missing $(what_missing) (IMP_INSTALL_DEPS=0: not installing). Install with: $(command_for "")"
fi
if ((${#missing[@]})) && { ((EUID != 0)) || ! command -v apt-get >/dev/null; }; then
  die "missing $(what_missing); installing needs root and apt-get. Install with: $(command_for "sudo ")"
fi
start=$SECONDS
if ((${#missing[@]})); then
  say "installing Debian packages ${missing[*]} (IMP_INSTALL_DEPS=0 refuses)"
  log="$(mktemp /tmp/imp-preflight-apt.XXXXXX)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
    >"$log" 2>&1 || die "apt-get install ${missing[*]} failed: $(tail -3 "$log") (full log: $log)"
  rm -f "$log"
  still=()
  for p in "${pkgs[@]}"; do installed "$p" || still+=("${p%%:*}"); done
  ((${#still[@]} == 0)) || die "still missing after apt-get install: ${still[*]}"
fi
if ((need_vsock)); then
  say "installing vhost-device-vsock $vsock_version with cargo (a few minutes on 2 cores)"
  log="$(mktemp /tmp/imp-preflight-vsock.XXXXXX)"
  cargo install -q --locked vhost-device-vsock --version "$vsock_version" >"$log" 2>&1 \
    || die "cargo install vhost-device-vsock failed: $(tail -3 "$log") (full log: $log)"
  rm -f "$log"
  command -v vhost-device-vsock >/dev/null || die "vhost-device-vsock installed but not on PATH (add ~/.cargo/bin)"
fi
say "$what: installed $(what_missing) in $((SECONDS - start))s"
