#!/usr/bin/env bash
# A minimal runner base image for real guests in tests and the smoke: Debian's static busybox as
# /bin/sh with every applet linked (the runner image's wrappers are shell scripts calling dirname,
# pwd, ...), an /etc/passwd with root, a sticky /tmp. One deterministic layer (images/oci-layout.sh).
#
# Usage: images/busybox-base/build.sh --out DIR [--tag TAG] [--push HOST:PORT/REPO:TAG]
#   --out DIR    the OCI image layout (replaced if it holds one)
#   --tag TAG    its ref name (default latest)
#   --push REF   then copy it to docker://REF with skopeo (plain HTTP allowed: a local test registry)
# Needs: a static /bin/busybox (Debian: busybox-static), tar, gzip, sha256sum; skopeo for --push.
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
die() { echo "busybox-base/build.sh: $*" >&2; exit 1; }
out="" tag=latest push=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="${2:?--out needs a directory}"; shift 2 ;;
        --tag) tag="${2:?--tag needs a tag}"; shift 2 ;;
        --push) push="${2:?--push needs HOST:PORT/REPO:TAG}"; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[ -n "$out" ] || die "--out DIR is required"
[ -x /bin/busybox ] && ! readelf -d /bin/busybox 2>/dev/null | grep -q NEEDED ||
    die "needs a static /bin/busybox (Debian: busybox-static)"
[ -z "$push" ] || command -v skopeo >/dev/null || die "--push needs skopeo (Debian: skopeo)"

. "$repo/images/oci-layout.sh"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/root/bin" "$work/root/etc" "$work/root/tmp"
cp /bin/busybox "$work/root/bin/busybox"
for applet in $(/bin/busybox --list); do [[ $applet == busybox ]] || ln -s busybox "$work/root/bin/$applet"; done
echo 'root:x:0:0::/:/bin/sh' >"$work/root/etc/passwd"
echo base >"$work/root/etc/imp-base"
chmod 1777 "$work/root/tmp"
tar -cf "$work/layer.tar" --format=gnu --sort=name --mtime=@0 --numeric-owner --owner=0 --group=0 \
    -C "$work/root" bin etc tmp
mkdir -p "$work/w"
oci_write_layout "$work/w" "$work/layer.tar" '"Cmd":["/bin/sh"]' "$tag" "$out" || die "writing the layout $out"
if [ -n "$push" ]; then
    skopeo copy --quiet --dest-tls-verify=false "oci:$out:$tag" "docker://$push" || die "skopeo copy to docker://$push failed"
fi
