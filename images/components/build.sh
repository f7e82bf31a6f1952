#!/usr/bin/env bash
# Build the OCI images of Imp's components (imp-operator, imp-agent, imp-runtime) from the repository,
# without a container daemon: each is one gzip layer with the stripped binary, the shared libraries
# `ldd` lists at their paths and the dynamic loader, so the binary runs from the image's root alone.
#   imp-operator, imp-agent  run as 65532:65532 (User in the image config; /etc/passwd names it)
#   imp-runtime              runs as root (TAP devices, /dev/kvm) and carries what it runs: mkfs.ext4
#                            (e2fsprogs, with /etc/mke2fs.conf), ip (iproute2), nft (nftables),
#                            busybox (static: /bin/sh and sleep for the chart's KVM preflight), and the
#                            static imp-guest at /usr/local/lib/imp/imp-guest (IMP_GUEST_BIN's default),
#                            which it copies into every VM's root filesystem; with --with-qemu also
#                            the QEMU backend's qemu-system-x86_64 (/usr/bin, IMP_QEMU_BIN's default)
#                            with the firmware it loads (/usr/share/qemu, /usr/share/seabios,
#                            /usr/lib/ipxe/qemu; symlinks resolved), its
#                            TCG module, and vhost-device-vsock (/usr/local/bin, IMP_VHOST_VSOCK_BIN's
#                            default)
#
# Usage:
#   images/components/build.sh --out DIR [--bin-dir DIR] [--tag TAG] [--only NAME]... [--push PREFIX]
#
#   --out DIR       writes DIR/<name>/ (an OCI layout per image), DIR/digests (`<name> sha256:...`)
#                   and DIR/values.yaml: the chart's image values (repository, tag, digest) for them
#   --bin-dir DIR   take the binaries from DIR (e.g. target/debug); default: `cargo build --release
#                   --locked -p imp-operator -p imp-runtime -p imp-agent --bins`, then target/release
#   --tag TAG       ref name in each index.json (default: the workspace version, e.g. 0.1.0)
#   --only NAME     build only this image (repeatable)
#   --with-qemu     the runtime image carries QEMU and vhost-device-vsock for `runtime.backend: qemu`
#                   (needs the host's qemu-system-x86 and a vhost-device-vsock on PATH)
#   --guest PATH    the static imp-guest for the runtime image (default: the one guest/check-static.sh
#                   builds, <target>/x86_64-unknown-linux-gnu/release/imp-guest); required for imp-runtime
#   --repository P  registry prefix the images will be pulled from (default ghcr.io/imp-dev), for
#                   values.yaml
#   --push PREFIX   then copy each to docker://PREFIX/<name>:TAG with skopeo (plain HTTP allowed),
#                   e.g. --push 127.0.0.1:5000/imp-dev; also the default --repository
#
# Reproducible: sorted entries, mtime 0, numeric owners 0:0, normalised modes, gzip -n, stripped
# binaries: two builds from the same binaries and host packages give the same manifest digests.
# Needs: tar, gzip, coreutils, ldd (libc-bin), readelf/strip (binutils), ca-certificates (the TLS
# roots every image carries), the host's e2fsprogs,
# iproute2, nftables and busybox-static for the runtime image; skopeo for --push.
set -euo pipefail
# shellcheck source=../oci-layout.sh
. "$(dirname "$0")/../oci-layout.sh"

die() { echo "components/build.sh: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || die "needs $1 (Debian package: $2)"; }

repo="$(cd "$(dirname "$0")/../.." && pwd)"
all=(imp-operator imp-agent imp-runtime)
out="" bin_dir="" tag="" push="" repository="" guest="" with_qemu="" only=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="${2:?--out needs a directory}"; shift 2 ;;
        --bin-dir) bin_dir="${2:?--bin-dir needs a directory}"; shift 2 ;;
        --tag) tag="${2:?--tag needs a value}"; shift 2 ;;
        --only) only+=("${2:?--only needs an image name}"); shift 2 ;;
        --with-qemu) with_qemu=1; shift ;;
        --guest) guest="${2:?--guest needs the static imp-guest}"; shift 2 ;;
        --push) push="${2:?--push needs HOST:PORT/PREFIX}"; shift 2 ;;
        --repository) repository="${2:?--repository needs a registry prefix}"; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[ -n "$out" ] || die "--out DIR is required"
((${#only[@]})) || only=("${all[@]}")
for n in "${only[@]}"; do
    [[ " ${all[*]} " == *" $n "* ]] || die "--only $n: no such image (one of ${all[*]})"
done
if [ -z "$tag" ]; then
    tag="$(sed -n '/^\[workspace.package\]/,/^\[/ s/^version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml")"
    [ -n "$tag" ] || die "no [workspace.package] version in $repo/Cargo.toml; give --tag"
fi
[[ "$tag" =~ ^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$ ]] || die "--tag $tag is not a valid tag"
need tar tar
need gzip gzip
need sha256sum coreutils
need ldd libc-bin
need readelf binutils
need strip binutils
[ -z "$push" ] || need skopeo skopeo

if [ -z "$bin_dir" ]; then
    (cd "$repo" && cargo build --release --locked -q -p imp-operator -p imp-runtime -p imp-agent --bins) ||
        die "cargo build --release failed"
    bin_dir="${CARGO_TARGET_DIR:-$repo/target}/release"
fi
for n in "${only[@]}"; do
    [ -x "$bin_dir/$n" ] || die "$bin_dir/$n is not an executable (cargo build -p imp-operator -p imp-runtime -p imp-agent --bins)"
done
# The runtime copies imp-guest into every VM's root filesystem: an image without it cannot boot a VM.
if [[ " ${only[*]} " == *" imp-runtime "* ]]; then
    guest="${guest:-${CARGO_TARGET_DIR:-$repo/target}/x86_64-unknown-linux-gnu/release/imp-guest}"
    [ -x "$guest" ] || die "imp-runtime needs the static imp-guest: $guest is not an executable (guest/check-static.sh builds it; or --guest PATH)"
    readelf -l "$guest" | grep -q 'program interpreter' &&
        die "--guest $guest is dynamically linked: VM root filesystems may have no libc (guest/check-static.sh)"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Copy a host file into the root at the same path (symlinks resolved: the image holds plain files).
put_host() {
    local root="$1" src="$2" dest="${3:-$2}"
    mkdir -p "$root$(dirname "$dest")"
    cp -L "$src" "$root$dest"
}

# An ELF at DEST in the root, stripped, with every library ldd lists and its loader at their paths.
put_elf() {
    local root="$1" src="$2" dest="$3" interp lib
    mkdir -p "$root$(dirname "$dest")"
    strip -o "$root$dest" "$src"
    interp="$(readelf -l "$src" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')"
    [ -n "$interp" ] || return 0
    put_host "$root" "$interp"
    ldd "$src" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | while read -r lib; do
        [ -e "$root$lib" ] || put_host "$root" "$lib"
    done
}

# The host's binary NAME (sbin included), or die naming its Debian package.
host_tool() {
    PATH="/usr/sbin:/sbin:$PATH" command -v "$1" || die "the runtime image needs $1 (Debian package: $2)"
}

: >"$work/digests"
repository="${repository:-${push:-ghcr.io/imp-dev}}"
echo "# Image values for helm/imp from images/components/build.sh (helm install -f this file)." >"$work/values.yaml"
for name in "${only[@]}"; do
    root="$work/$name/root"
    mkdir -p "$root/etc" "$root/tmp"
    put_elf "$root" "$bin_dir/$name" "/usr/local/bin/$name"
    # The GitHub client and registry pulls verify TLS against the system roots.
    [ -f /etc/ssl/certs/ca-certificates.crt ] ||
        die "needs /etc/ssl/certs/ca-certificates.crt (Debian package: ca-certificates)"
    put_host "$root" /etc/ssl/certs/ca-certificates.crt
    printf 'root:x:0:0:root:/:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/:/sbin/nologin\n' >"$root/etc/passwd"
    printf 'root:x:0:\nnonroot:x:65532:\n' >"$root/etc/group"
    user='"User":"65532:65532",'
    if [ "$name" = imp-runtime ]; then
        user=""
        put_elf "$root" "$(host_tool mkfs.ext4 e2fsprogs)" /usr/sbin/mkfs.ext4
        put_host "$root" /etc/mke2fs.conf
        put_elf "$root" "$(host_tool ip iproute2)" /usr/sbin/ip
        put_elf "$root" "$(host_tool nft nftables)" /usr/sbin/nft
        busybox="$(host_tool busybox busybox-static)"
        readelf -l "$busybox" | grep -q 'program interpreter' &&
            die "$busybox is dynamically linked: the runtime image needs busybox-static's"
        put_elf "$root" "$busybox" /bin/busybox
        ln -s busybox "$root/bin/sh"
        ln -s busybox "$root/bin/sleep"
        mkdir -p "$root/usr/local/lib/imp"
        cp "$guest" "$root/usr/local/lib/imp/imp-guest"
        if [ -n "$with_qemu" ]; then
            put_elf "$root" "$(host_tool qemu-system-x86_64 qemu-system-x86)" /usr/bin/qemu-system-x86_64
            # The BIOS, option ROMs and keymaps QEMU loads: Debian's build searches these three
            # directories (the pc machine's BIOS is seabios', virtio-net's option ROM ipxe's).
            for d in /usr/share/qemu:qemu-system-data /usr/share/seabios:seabios /usr/lib/ipxe/qemu:ipxe-qemu; do
                [ -d "${d%%:*}" ] || die "--with-qemu needs ${d%%:*} (Debian package: ${d#*:})"
                mkdir -p "$root$(dirname "${d%%:*}")"
                cp -rL "${d%%:*}" "$root${d%%:*}"
            done
            # Debian builds TCG as a module QEMU loads at start when KVM is not used (qemuAccel tcg,
            # auto without /dev/kvm); the display and audio modules are not needed headless.
            tcg=/usr/lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so
            [ ! -e "$tcg" ] || put_elf "$root" "$tcg" "$tcg"
            put_elf "$root" "$(host_tool vhost-device-vsock "none: cargo install vhost-device-vsock")" \
                /usr/local/bin/vhost-device-vsock
        fi
    fi
    # Normalised modes: no group/other write; /tmp sticky and world-writable.
    chmod -R u+rwX,go+rX,go-w "$root"
    chmod 1777 "$root/tmp"
    (cd "$root" && find . -mindepth 1 -printf '%P\0' | LC_ALL=C sort -z) |
        tar -cf "$work/$name/layer.tar" --format=gnu --mtime=@0 --owner=0 --group=0 --numeric-owner \
            --no-recursion -C "$root" --null -T -
    fields='"Entrypoint":["/usr/local/bin/'"$name"'"],'"$user"'"Env":["PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"WorkingDir":"/"'
    oci_write_layout "$work/$name" "$work/$name/layer.tar" "$fields" "$tag" "$work/out/$name" ||
        die "cannot write the layout of $name"
    echo "$name sha256:$OCI_MANIFEST" >>"$work/digests"
    printf '%s:\n  image: {repository: %s/%s, tag: "%s", digest: "sha256:%s"}\n' \
        "${name#imp-}" "$repository" "$name" "$tag" "$OCI_MANIFEST" >>"$work/values.yaml"
    echo "components/build.sh: $name (tag $tag): manifest sha256:$OCI_MANIFEST, layer $OCI_LAYER_SIZE bytes gzipped"
done

if [ -e "$out" ]; then
    for n in "${only[@]}"; do
        if [ -e "$out/$n" ] && [ ! -f "$out/$n/oci-layout" ]; then
            die "--out $out/$n exists and is not an OCI layout; refusing to replace it"
        fi
    done
fi
mkdir -p "$out"
for n in "${only[@]}"; do
    rm -rf "${out:?}/$n"
    mv "$work/out/$n" "$out/$n"
done
mv "$work/digests" "$out/digests"
mv "$work/values.yaml" "$out/values.yaml"
echo "components/build.sh: wrote $out (digests in $out/digests, chart values in $out/values.yaml)"

if [ -n "$push" ]; then
    for n in "${only[@]}"; do
        skopeo copy --quiet --dest-tls-verify=false "oci:$out/$n:$tag" "docker://$push/$n:$tag" ||
            die "skopeo copy to docker://$push/$n:$tag failed"
        echo "components/build.sh: pushed $push/$n:$tag"
    done
fi
