#!/usr/bin/env bash
# Tests of images/base/build.sh (run by images/test.sh; needs root and the Debian mirror):
#   - two builds from the same mirror state give the same manifest digest (reproducible);
#   - the OCI layout's blobs match their digests; the image config's entrypoint;
#   - contents, chrooted into the unpacked layer: the runner user (uid/gid 1001, home, bash) with
#     passwordless sudo (`sudo -n true` as runner), the runner's .NET dependencies (each library
#     actions/runner's Linux dependency list names resolves with ldconfig -p), git, curl, jq, tar,
#     unzip, dockerd, containerd, runc, the docker CLI, iptables and nft run; nothing the build must
#     strip (apt lists and caches, logs, /dev nodes) is in the layer;
#   - --cache: a second build with the same inputs is a copy with the same digest.
# Usage: images/base/test.sh [--reuse DIR] [--keep DIR]
#   --reuse DIR  a layout already built stands for the first build
#   --keep DIR   copy the built layout there (e.g. for IMP_BASE_IMAGE_LAYOUT of the Docker guest test)
# Takes 100-280 s per build on 2 shared cores (mmdebstrap, then tar and gzip -9 of ~490 MB).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
fail() { echo "images/base/test.sh: FAIL: $*" >&2; exit 1; }
ok() { echo "images/base/test.sh: ok: $*"; }
reuse="" keep=""
while [ $# -gt 0 ]; do
    case "$1" in
        --reuse) reuse="${2:?--reuse needs a directory}"; shift 2 ;;
        --keep) keep="${2:?--keep needs a directory}"; shift 2 ;;
        *) fail "unknown argument $1" ;;
    esac
done
[ "$(id -u)" = 0 ] || fail "run as root (mmdebstrap --mode=root, chroot)"
t="$(mktemp -d)"
trap 'rm -rf "$t"' EXIT
manifest_digest() { grep -o '"digest":"sha256:[0-9a-f]\{64\}"' "$1/index.json" | head -n1 | cut -d: -f3 | tr -d '"'; }

# The same SOURCE_DATE_EPOCH and mirror state for both builds (the default epoch is the Release
# files' Date, which moves when the mirror updates between the two builds).
epoch="${SOURCE_DATE_EPOCH:-$(date -d "$(curl -fsS http://deb.debian.org/debian/dists/bookworm/Release | sed -n 's/^Date: //p')" +%s)}"
export SOURCE_DATE_EPOCH="$epoch"
start=$(date +%s)
if [ -n "$reuse" ]; then
    cp -a "$reuse" "$t/b1"
else
    "$here/build.sh" --out "$t/b1" --cache "$t/cache" >"$t/b1.log" 2>&1 || fail "first build: $(tail -n 20 "$t/b1.log")"
fi
first=$(($(date +%s) - start))
start=$(date +%s)
"$here/build.sh" --out "$t/b2" >"$t/b2.log" 2>&1 || fail "second build: $(tail -n 20 "$t/b2.log")"
second=$(($(date +%s) - start))
d1="$(manifest_digest "$t/b1")" d2="$(manifest_digest "$t/b2")"
[ "$d1" = "$d2" ] || fail "two builds differ: sha256:$d1 vs sha256:$d2 (SOURCE_DATE_EPOCH=$epoch)"
ok "reproducible: two builds give sha256:$d1 (${first} s and ${second} s)"

for f in "$t/b1"/blobs/sha256/*; do
    [ "$(sha256sum "$f" | cut -d' ' -f1)" = "${f##*/}" ] || fail "blob $f does not match its digest"
done
m="$t/b1/blobs/sha256/$d1"
config="$(grep -o '"config":{"mediaType":"[^"]*","digest":"sha256:[0-9a-f]\{64\}"' "$m" | grep -o '[0-9a-f]\{64\}')"
layer="$(grep -o '"layers":\[{"mediaType":"[^"]*","digest":"sha256:[0-9a-f]\{64\}"' "$m" | grep -o '[0-9a-f]\{64\}')"
grep -q '"Entrypoint":\["/usr/local/bin/imp-base-entrypoint"\]' "$t/b1/blobs/sha256/$config" || fail "entrypoint"
if command -v skopeo >/dev/null; then
    skopeo inspect "oci:$t/b1:bookworm" >/dev/null || fail "skopeo inspect oci:$t/b1:bookworm"
fi

tar -tzf "$t/b1/blobs/sha256/$layer" >"$t/list"
for p in var/lib/apt/lists/ var/cache/apt/ var/log/ dev/ tmp/; do
    if grep -q "^$p." "$t/list"; then fail "the layer holds $(grep "^$p." "$t/list" | head -n1) (should be stripped)"; fi
done
for p in var/cache/ldconfig/aux-cache etc/passwd- etc/shadow- var/lib/dpkg/status-old; do
    if grep -qx "$p" "$t/list"; then fail "the layer holds $p (should be stripped)"; fi
done
root="$t/root"
mkdir "$root"
tar -xzf "$t/b1/blobs/sha256/$layer" -C "$root" --numeric-owner
grep -qx 'runner:x:1001:1001::/home/runner:/bin/bash' "$root/etc/passwd" || fail "runner user: $(grep runner "$root/etc/passwd")"
grep -q '^runner:x:1001:' "$root/etc/group" || fail "runner group"
grep -q '^docker:x:[0-9]*:runner$' "$root/etc/group" || fail "runner not in docker: $(grep docker "$root/etc/group")"
[ "$(stat -c %u:%g "$root/home/runner")" = 1001:1001 ] || fail "/home/runner owner"
# The image has no /dev nodes (devtmpfs in the guest): the host's, for the chrooted commands.
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"
trap 'umount "$root/dev" "$root/proc" 2>/dev/null || true; rm -rf "$t"' EXIT
chroot "$root" /usr/sbin/runuser -u runner -- sudo -n true || fail "sudo -n true as runner"
[ "$(chroot "$root" /usr/sbin/runuser -u runner -- id -u)" = 1001 ] || fail "id -u as runner"
# actions/runner's .NET dependencies (its bin/installdependencies.sh for Debian 12).
chroot "$root" /sbin/ldconfig -p >"$t/ldcache" || fail "ldconfig -p in the image"
for lib in libicuuc.so.72 libicui18n.so.72 libkrb5.so.3 libgssapi_krb5.so.2 libz.so.1 libssl.so.3 \
    libcrypto.so.3 liblttng-ust.so.1; do
    grep -q "^[[:space:]]*$lib " "$t/ldcache" || fail "the runner's dependency $lib is missing"
done
for cmd in "git --version" "curl --version" "jq --version" "tar --version" "unzip -v" "xz --version" \
    "dockerd --version" "containerd --version" "runc --version" "docker --version" \
    "iptables --version" "nft --version" "bash --version"; do
    chroot "$root" /usr/bin/env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        $cmd >"$t/out" 2>&1 || fail "$cmd in the image: $(cat "$t/out")"
done
[ -x "$root/usr/local/sbin/imp-start-dockerd" ] || fail "no imp-start-dockerd"
grep -q '"group": "runner"' "$root/etc/docker/daemon.json" || fail "daemon.json socket group"
umount "$root/dev" "$root/proc"
size="$(du -sb "$root" | cut -f1)"
ok "contents: runner 1001:1001 with sudo, .NET dependencies, git/curl/jq/tar/unzip, docker.io, iptables/nft ($size bytes unpacked, $(stat -c %s "$t/b1/blobs/sha256/$layer") bytes gzip)"

if [ -z "$reuse" ]; then
    start=$(date +%s)
    "$here/build.sh" --out "$t/b3" --cache "$t/cache" >"$t/b3.log" 2>&1 || fail "cached build: $(tail -n 5 "$t/b3.log")"
    grep -q '^base/build.sh: cached' "$t/b3.log" || fail "the third build with the same inputs did not use the cache"
    [ "$(manifest_digest "$t/b3")" = "$d1" ] || fail "cached build gave another digest"
    ok "cached by its inputs: $(($(date +%s) - start)) s"
fi
if [ -n "$keep" ]; then rm -rf "$keep" && cp -a "$t/b1" "$keep"; fi
echo "images/base/test.sh: all passed"
