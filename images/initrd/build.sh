#!/usr/bin/env bash
# Build an initrd for a distribution kernel (e.g. Debian's cloud kernel) whose /init is the
# static imp-guest: no shell, no busybox. It carries the modules the guest needs (with their
# dependencies from modules.dep, decompressed) and lib/modules/imp/load-order, which imp-guest
# loads with finit_module before anything else (guest/src/pid1/modules.rs). Modules that are
# built into the kernel (modules.builtin) are skipped.
#
# Usage:
#   images/initrd/build.sh --guest PATH --out PATH [--modules-dir DIR | --kernel-version V]
#                          [--module NAME]... [--gzip]
#
#   --guest PATH        static imp-guest (guest/check-static.sh builds it)
#   --out PATH          the initrd to write (newc cpio; gzip-compressed with --gzip)
#   --modules-dir DIR   the kernel's module tree, the directory holding modules.dep
#                       (default: /lib/modules/<version>)
#   --kernel-version V  default: the version of the only /boot/vmlinuz-* (error if several)
#   --module NAME       load this module instead of the default set (repeatable)
#   --gzip              gzip -n -9 the archive
#
# The output is deterministic for the same inputs (sorted entries, mtime 0, owner 0:0).
# Needs: cpio (Debian: cpio); xz-utils / zstd only when the modules are compressed.
# The default set boots the guest (virtio, vsock, ext4, overlay) and gives the job's container
# engine what it needs (bridge, veth, br_netfilter, nf_tables and the xt_* matches of dockerd's
# bridge network); see default_modules below.
set -euo pipefail

default_modules=(
    virtio_pci                 # QEMU: virtio devices on PCI
    virtio_mmio                # Firecracker: virtio-mmio devices (virtio_mmio.device= on the cmdline)
    virtio_blk                 # base and writable drives
    virtio_net                 # the VM's network
    vsock
    vmw_vsock_virtio_transport # the agent's transport (pulls in ..._common)
    ext4                       # the drives' filesystem (jbd2, mbcache, crc16, crc32c... when modular)
    overlay                    # overlay(base, writable) root; also the engine's overlay2 storage
    # What a container engine in the job needs (dockerd's bridge network, docs/workloads.md).
    # Debian's iptables is iptables-nft: nf_tables + nft_compat run the xt_* matches dockerd's
    # rules use; ip_tables/iptable_* serve images that select iptables-legacy.
    bridge                     # docker0 (pulls in stp, llc)
    veth                       # each container's link to the bridge
    br_netfilter               # bridge-nf-call-iptables: containers reaching each other by port
    nf_tables
    nft_compat                 # xt_* matches and targets through nf_tables
    nft_chain_nat              # nat chains (MASQUERADE, DNAT of published ports)
    nf_nat
    nf_conntrack
    nf_conntrack_netlink       # dockerd flushes conntrack entries of removed containers
    xt_MASQUERADE              # containers' traffic out through the VM's address
    xt_addrtype                # -m addrtype --dst-type LOCAL (published ports)
    xt_conntrack               # -m conntrack --ctstate RELATED,ESTABLISHED
    xt_nat                     # DNAT/SNAT targets
    xt_tcpudp                  # -p tcp --dport
    ip_tables
    iptable_filter
    iptable_nat
)

die() { echo "initrd/build.sh: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || die "needs $1 (Debian package: $2)"; }

guest="" out="" modules_dir="" version="" gzip=0 modules=()
while [ $# -gt 0 ]; do
    case "$1" in
        --guest) guest="${2:?--guest needs a path}"; shift 2 ;;
        --out) out="${2:?--out needs a path}"; shift 2 ;;
        --modules-dir) modules_dir="${2:?--modules-dir needs a directory}"; shift 2 ;;
        --kernel-version) version="${2:?--kernel-version needs a version}"; shift 2 ;;
        --module) modules+=("${2:?--module needs a name}"); shift 2 ;;
        --gzip) gzip=1; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[ -n "$guest" ] || die "--guest PATH is required (a static imp-guest: guest/check-static.sh)"
[ -n "$out" ] || die "--out PATH is required"
[ -x "$guest" ] || die "--guest $guest is not an executable file"
need cpio cpio
need readelf binutils
if readelf -d "$guest" 2>/dev/null | grep -q '(NEEDED)'; then
    die "$guest is dynamically linked; /init must be static (build it with guest/check-static.sh)"
fi
[ ${#modules[@]} -gt 0 ] || modules=("${default_modules[@]}")

if [ -z "$modules_dir" ]; then
    if [ -z "$version" ]; then
        shopt -s nullglob
        kernels=(/boot/vmlinuz-*)
        shopt -u nullglob
        [ ${#kernels[@]} -eq 1 ] ||
            die "found ${#kernels[@]} /boot/vmlinuz-* kernels; pass --kernel-version or --modules-dir (Debian: linux-image-cloud-amd64)"
        version="${kernels[0]#/boot/vmlinuz-}"
    fi
    modules_dir="/lib/modules/$version"
fi
[ -f "$modules_dir/modules.dep" ] ||
    die "no $modules_dir/modules.dep (install the kernel's modules, e.g. Debian linux-image-cloud-amd64, or unpack its .deb with dpkg-deb -x and pass --modules-dir)"

# name (dashes as underscores) -> path relative to modules_dir, and -> its dependencies.
declare -A path_of deps_of builtin softpre
modname() { local b="${1##*/}"; b="${b%%.ko*}"; echo "${b//-/_}"; }
while IFS= read -r line; do
    key="${line%%:*}"
    rest="${line#*:}"
    n="$(modname "$key")"
    path_of[$n]="$key"
    deps_of[$n]="$rest"
done <"$modules_dir/modules.dep"
if [ -f "$modules_dir/modules.builtin" ]; then
    while IFS= read -r line; do builtin[$(modname "$line")]=1; done <"$modules_dir/modules.builtin"
fi
# "softdep ext4 pre: crc32c": load those first when they are modules.
if [ -f "$modules_dir/modules.softdep" ]; then
    while read -r word mod rest; do
        [ "$word" = softdep ] || continue
        pre="${rest#*pre:}"
        [ "$pre" != "$rest" ] || continue
        pre="${pre%%post:*}"
        softpre[$(modname "$mod")]="$pre"
    done <"$modules_dir/modules.softdep"
fi

order=() skipped=()
declare -A seen
visit() {
    local n
    n="$(modname "$1")"
    [ -z "${seen[$n]:-}" ] || return 0
    seen[$n]=1
    if [ -z "${path_of[$n]:-}" ]; then
        if [ -n "${builtin[$n]:-}" ]; then skipped+=("$n"); return 0; fi
        [ "${2:-}" = optional ] && return 0
        die "module $n is neither in $modules_dir/modules.dep nor built in (modules.builtin)"
    fi
    local d
    for d in ${softpre[$n]:-}; do visit "$d" optional; done
    for d in ${deps_of[$n]}; do visit "$d"; done
    order+=("$n")
}
for m in "${modules[@]}"; do visit "$m"; done

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib/modules/imp" "$stage"/{dev,proc,sys,run,tmp}
cp "$guest" "$stage/init"
chmod 0755 "$stage/init"
list="$stage/lib/modules/imp/load-order"
echo "# Loaded in this order by imp-guest (PID 1) before anything else; see images/initrd/build.sh." >"$list"
for n in "${order[@]}"; do
    src="$modules_dir/${path_of[$n]}"
    dst="$stage/lib/modules/imp/$n.ko"
    case "$src" in
        *.ko) cp "$src" "$dst" ;;
        *.ko.xz) need xz xz-utils; xz -dc "$src" >"$dst" ;;
        *.ko.zst) need zstd zstd; zstd -qdc "$src" >"$dst" ;;
        *.ko.gz) gzip -dc "$src" >"$dst" ;;
        *) die "unexpected module file $src" ;;
    esac
    echo "/lib/modules/imp/$n.ko" >>"$list"
done

find "$stage" -exec touch -h -d @0 {} +
mkdir -p "$(dirname "$out")"
tmp_out="$out.tmp.$$"
(
    cd "$stage"
    find . -mindepth 1 -printf '%P\n' | LC_ALL=C sort |
        cpio -o -H newc -R 0:0 --reproducible --quiet
) >"$tmp_out.cpio"
if [ "$gzip" = 1 ]; then
    gzip -n -9 -c "$tmp_out.cpio" >"$tmp_out"
    rm -f "$tmp_out.cpio"
else
    mv "$tmp_out.cpio" "$tmp_out"
fi
mv "$tmp_out" "$out"

echo "initrd/build.sh: modules ($modules_dir): ${order[*]}"
[ ${#skipped[@]} -eq 0 ] || echo "initrd/build.sh: built into the kernel, skipped: ${skipped[*]}"
echo "initrd/build.sh: wrote $out ($(stat -c %s "$out") bytes)"
