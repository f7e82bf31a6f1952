#!/usr/bin/env bash
# Build Imp's reference runner base image from Debian packages with mmdebstrap, as an OCI image
# layout (one gzip layer, through images/oci-layout.sh): what the GitHub Actions runner needs
# (its .NET dependencies: libicu, libkrb5-3, zlib1g, libssl3, liblttng-ust1), what workflows
# assume (bash, git, curl, ca-certificates, jq, tar, unzip, xz, sudo), a `runner` user (uid and gid
# 1001, home /home/runner, passwordless sudo) and a container engine (docker.io: dockerd,
# containerd, runc, the docker CLI; iptables and nftables). The runner layer
# (images/runner/build.sh) goes on top of it in a pool's template (`image` + `runnerImage`).
#
# Usage:
#   images/base/build.sh --out DIR [--tag TAG] [--suite bookworm] [--mirror URL]
#                        [--security-mirror URL] [--include PKG[,PKG]]... [--apt-cache DIR]
#                        [--cache DIR] [--push HOST:PORT/REPO:TAG]
#
#   --out DIR              the OCI layout to write (replaced if it already holds one)
#   --tag TAG              the ref name in index.json (default: bookworm)
#   --suite S              Debian suite (default: bookworm)
#   --mirror URL           Debian mirror (default: http://deb.debian.org/debian); a
#                          snapshot.debian.org URL (.../archive/debian/<timestamp>/) pins the
#                          package set, and with it the digest
#   --security-mirror URL  default: http://deb.debian.org/debian-security ("none": leave it out)
#   --include PKGS         more packages, comma-separated (repeatable): how to extend the image
#   --apt-cache DIR        keep downloaded .deb files here and reuse them (saves the download)
#   --cache DIR            reuse a layout built from the same inputs (this script, the options,
#                          the mirrors' Release files): cached builds are a copy
#   --push REF             then copy the layout to docker://REF with skopeo (plain HTTP allowed)
#   --print-epoch          print the SOURCE_DATE_EPOCH a build would use now, and exit
#
# Reproducible: SOURCE_DATE_EPOCH (default: the newest Release file's Date, so the same mirror
# state gives the same epoch) fixes every timestamp mmdebstrap and the maintainer scripts write;
# logs, apt lists and caches, ldconfig's aux-cache, backup files (*-old, /etc/*-) and /dev's nodes
# are left out; entries are sorted with numeric owners and gzip -n. Two builds from the same mirror
# state give the same manifest digest (images/test.sh checks it), which is printed.
# Needs: mmdebstrap (Debian: mmdebstrap), root (mmdebstrap --mode=root), curl, tar, gzip,
# sha256sum; skopeo only for --push.
set -euo pipefail
# Nothing of the caller's environment may reach the image: files the hooks create take their mode
# from the umask, sort and date read the locale and zone (images/base/test.sh builds a second time
# under another umask, locale, zone, TMPDIR and HOME and compares digests).
umask 022
export LC_ALL=C TZ=UTC
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../oci-layout.sh
. "$here/../oci-layout.sh"

die() { echo "base/build.sh: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || die "needs $1 (Debian package: $2)"; }

# The image's packages. The runner's .NET dependencies are the ones actions/runner's
# bin/installdependencies.sh installs on Debian (liblttng-ust1 is liblttng-ust0 before bookworm,
# libicu72 is bookworm's ICU).
packages=(
    # actions/runner (.NET): ICU, Kerberos, zlib, OpenSSL, LTTng
    libicu72 libkrb5-3 zlib1g libssl3 liblttng-ust1
    # what workflows assume
    bash ca-certificates curl git jq tar unzip xz-utils gzip sudo procps iproute2 openssh-client
    # the job's container engine (dockerd is started by the image's entrypoint, images/base/)
    docker.io iptables nftables
)

out="" tag=bookworm suite=bookworm mirror=http://deb.debian.org/debian
security=http://deb.debian.org/debian-security apt_cache="" cache="" push="" extra=() print_epoch=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="${2:?--out needs a directory}"; shift 2 ;;
        --tag) tag="${2:?--tag needs a value}"; shift 2 ;;
        --suite) suite="${2:?--suite needs a value}"; shift 2 ;;
        --mirror) mirror="${2:?--mirror needs a URL}"; shift 2 ;;
        --security-mirror) security="${2:?--security-mirror needs a URL or none}"; shift 2 ;;
        --include) IFS=, read -r -a more <<<"${2:?--include needs packages}"; extra+=("${more[@]}"); shift 2 ;;
        --apt-cache) apt_cache="${2:?--apt-cache needs a directory}"; shift 2 ;;
        --cache) cache="${2:?--cache needs a directory}"; shift 2 ;;
        --push) push="${2:?--push needs HOST:PORT/REPO:TAG}"; shift 2 ;;
        --print-epoch) print_epoch=1; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[ -n "$out" ] || [ "$print_epoch" = 1 ] || die "--out DIR is required"
[[ "$tag" =~ ^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$ ]] || die "--tag $tag is not a valid tag"
[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap --mode=root creates files owned by other users)"
need mmdebstrap mmdebstrap
need curl curl
need tar tar
need sha256sum coreutils
[ -z "$push" ] || need skopeo skopeo
packages+=("${extra[@]}")
mirror="${mirror%/}" security="${security%/}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The mirror state: the suites' Release files (their Date and the index hashes they list).
sources=("deb $mirror $suite main" "deb $mirror $suite-updates main")
releases=("$mirror/dists/$suite/Release" "$mirror/dists/$suite-updates/Release")
if [ "$security" != none ]; then
    sources+=("deb $security $suite-security main")
    releases+=("$security/dists/$suite-security/Release")
fi
for i in "${!releases[@]}"; do
    curl -fsS --retry 3 -o "$work/release.$i" "${releases[$i]}" ||
        die "cannot fetch ${releases[$i]} (is the mirror reachable?)"
done
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
    newest=0
    for f in "$work"/release.*; do
        d="$(date -d "$(sed -n 's/^Date: //p' "$f")" +%s)" || die "no Date in $f"
        [ "$d" -le "$newest" ] || newest="$d"
    done
    SOURCE_DATE_EPOCH="$newest"
fi
export SOURCE_DATE_EPOCH
if [ "$print_epoch" = 1 ]; then echo "$SOURCE_DATE_EPOCH"; exit 0; fi

key="$( (cat "$0" "$here/../oci-layout.sh" "$work"/release.*
    printf '%s\n' "$suite" "$tag" "$SOURCE_DATE_EPOCH" "${sources[@]}" "${packages[@]}") | sha256sum | cut -c1-32)"
if [ -n "$cache" ] && [ -f "$cache/$key/oci-layout" ]; then
    rm -rf "$out"
    mkdir -p "$(dirname "$out")"
    cp -a "$cache/$key" "$out"
    echo "base/build.sh: cached ($cache/$key): wrote $out (tag $tag): manifest sha256:$(cat "$cache/$key.manifest")"
    exec_push=1
else
    exec_push=0
fi

if [ "$exec_push" = 0 ]; then
    root="$work/rootfs"
    hooks=()
    if [ -n "$apt_cache" ]; then
        mkdir -p "$apt_cache"
        apt_cache="$(cd "$apt_cache" && pwd)"
        # mmdebstrap's documented cache recipe: debs in before the download, new ones out after.
        hooks+=(--skip=download/empty
            --setup-hook='mkdir -p "$1/var/cache/apt/archives"'
            --setup-hook="cp -a '$apt_cache'/. \"\$1/var/cache/apt/archives/\" 2>/dev/null || true"
            --customize-hook="find \"\$1/var/cache/apt/archives\" -maxdepth 1 -name '*.deb' -exec cp -n {} '$apt_cache'/ \\;")
    fi
    # Leave out what no job reads (docs, man pages, translations): about a fifth of the size.
    mmdebstrap --mode=root --format=directory --variant=apt \
        --include="$(IFS=,; echo "${packages[*]}")" \
        --aptopt='Acquire::Languages "none"' \
        --aptopt='APT::Install-Recommends "false"' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        "${hooks[@]}" \
        --customize-hook="'$here/customize.sh' \"\$1\"" \
        "$suite" "$root" "${sources[@]}" >"$work/mmdebstrap.log" 2>&1 ||
        die "mmdebstrap failed: $(tail -n 20 "$work/mmdebstrap.log")"

    # Everything that differs between two runs, or that no VM should inherit.
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
        "$root"/var/lib/dpkg/*-old "$root"/var/cache/ldconfig/aux-cache "$root"/var/log/* \
        "$root"/etc/*- "$root"/tmp/* "$root"/var/tmp/* "$root"/dev/* "$root"/run/* \
        "$root"/var/lib/docker/* "$root"/var/lib/containerd/*
    : >"$root/etc/machine-id"
    # Paths, not the order readdir gives; fixed mtimes clamped to the epoch; numeric owners.
    (cd "$root" && find . -mindepth 1 -printf '%P\0' | LC_ALL=C sort -z) |
        tar -C "$root" -cf "$work/layer.tar" --format=posix --numeric-owner \
            --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime \
            --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
            --null --no-recursion -T -
    size="$(du -sb "$root" | cut -f1)"
    rm -rf "$root"

    config='"Entrypoint":["/usr/local/bin/imp-base-entrypoint"],'
    config+='"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],'
    config+='"Labels":{"org.opencontainers.image.source":"images/base/build.sh",'
    config+='"dev.imp.base.suite":"'"$suite"'","dev.imp.base.source-date-epoch":"'"$SOURCE_DATE_EPOCH"'"}'
    oci_write_layout "$work" "$work/layer.tar" "$config" "$tag" "$out" || die "cannot write the layout to $out"
    echo "base/build.sh: wrote $out (tag $tag): manifest sha256:$OCI_MANIFEST, layer sha256:$OCI_LAYER ($OCI_LAYER_SIZE bytes gzip, $size bytes unpacked), SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH"
    if [ -n "$cache" ]; then
        mkdir -p "$cache"
        rm -rf "$cache/$key.tmp"
        cp -a "$out" "$cache/$key.tmp"
        echo "$OCI_MANIFEST" >"$cache/$key.manifest"
        rm -rf "$cache/$key"
        mv "$cache/$key.tmp" "$cache/$key"
    fi
fi

if [ -n "$push" ]; then
    skopeo copy --quiet --dest-tls-verify=false "oci:$out:$tag" "docker://$push" ||
        die "skopeo copy to docker://$push failed"
    echo "base/build.sh: pushed to $push"
fi
