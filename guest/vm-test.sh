#!/usr/bin/env bash
# Real-VM tests of imp-guest: PID 1 + agent booted under QEMU (software emulation, no /dev/kvm
# needed) with vhost-device-vsock providing Firecracker's hybrid-vsock socket; and under real
# Firecracker when IMP_FIRECRACKER_BIN and IMP_KERNEL are set. Then the rootfs pipeline end to
# end (node/runtime/tests/rootfs_qemu.rs): images pushed to a local registry, built into one cached
# base, two VMs booted from it. Then imp-runtime's QEMU backend through its socket API
# (node/runtime/tests/runtime_qemu.rs): PUT, Hello, Exec, kill -9 + reattach, DELETE, with the boot
# time and RSS measurements it prints (MEASURE lines). Then VM networking with two real guests
# through imp-runtime (node/runtime/tests/network_qemu.rs): NAT, DNS, isolation, restart, teardown, with
# NAT throughput/latency (MEASURE lines); it needs root, nft and dnsmasq, and as root it fails
# instead of skipping. Then ScaleToZero through imp-agent on a real guest
# (node/runtime/tests/scale_to_zero_qemu.rs): idle -> Suspended, a client connection wakes it and
# completes, with the MEASURE line it prints; root and nft, like the networking test.
#
# Needs qemu-system-x86_64, a kernel in /boot (or IMP_QEMU_KERNEL) with its modules, a static
# /bin/busybox, cpio, e2fsprogs, docker-registry and vhost-device-vsock. IMP_INSTALL_DEPS=1
# installs what is missing (Debian packages + cargo install). The QEMU tests fail instead of
# skipping here.
# Usage: guest/vm-test.sh   (honours CARGO_TARGET_DIR)
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
target_dir="${CARGO_TARGET_DIR:-$repo/target}"

if [ "${IMP_INSTALL_DEPS:-0}" = 1 ]; then
    pkgs=()
    command -v qemu-system-x86_64 >/dev/null || pkgs+=(qemu-system-x86)
    compgen -G '/boot/vmlinuz-*' >/dev/null || pkgs+=(linux-image-cloud-amd64)
    if ! [ -x /bin/busybox ] || readelf -d /bin/busybox 2>/dev/null | grep -q NEEDED; then
        pkgs+=(busybox-static)
    fi
    command -v cpio >/dev/null || pkgs+=(cpio)
    command -v debugfs >/dev/null || pkgs+=(e2fsprogs)
    command -v docker-registry >/dev/null || pkgs+=(docker-registry)
    command -v nft >/dev/null || pkgs+=(nftables)
    command -v dnsmasq >/dev/null || pkgs+=(dnsmasq-base)
    if [ ${#pkgs[@]} -gt 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
    fi
    command -v vhost-device-vsock >/dev/null || cargo install --locked vhost-device-vsock --version 0.3.0
fi

"$repo/guest/check-static.sh"
export IMP_GUEST_STATIC_BIN="$target_dir/x86_64-unknown-linux-gnu/release/imp-guest"
export IMP_REQUIRE_QEMU=1
cd "$repo"
cargo test -p imp-guest --test qemu --test firecracker -- --nocapture
# The rootfs pipeline end to end: registry -> cached ext4 base -> two VMs booted from it.
cargo test -p imp-runtime --test rootfs_qemu -- --nocapture
# imp-runtime with --backend qemu, end to end.
cargo test -p imp-runtime --test runtime_qemu -- --nocapture
cargo test -p imp-runtime --test suspend_qemu -- --nocapture  # suspend/resume round trips on a real guest
cargo test -p imp-runtime --test agent_qemu -- --nocapture  # imp-agent's runner handoff on a real QEMU guest
# VM networking with real guests (root: the TAPs, bridge and nft rules live in test netns).
IMP_REQUIRE_ROOT="${IMP_REQUIRE_ROOT:-$([ "$(id -u)" = 0 ] && echo 1 || echo 0)}" \
    cargo test -p imp-runtime --test network_qemu -- --nocapture
# Snapshot standby: a template, clones restored and reidentified, fallbacks (root as above).
IMP_REQUIRE_ROOT="${IMP_REQUIRE_ROOT:-$([ "$(id -u)" = 0 ] && echo 1 || echo 0)}" \
    cargo test -p imp-runtime --test template_qemu -- --nocapture
# ScaleToZero through imp-agent on a real guest, client and node in test netns (root as above).
IMP_REQUIRE_ROOT="${IMP_REQUIRE_ROOT:-$([ "$(id -u)" = 0 ] && echo 1 || echo 0)}" \
    cargo test -p imp-runtime --test scale_to_zero_qemu -- --nocapture
