#!/usr/bin/env bash
# Tests of images/base/build.sh (run by images/test.sh; needs root and the Debian mirror):
#   - two builds from the same mirror state give the same manifest digest (reproducible), the
#     second under another umask, locale, zone, TMPDIR and HOME than the caller's;
#   - the OCI layout's blobs match their digests; the image config's entrypoint;
#   - contents, chrooted into the unpacked layer: the runner user (uid/gid 1001, home, bash) with
#     passwordless sudo (`sudo -n true` as runner), the runner's .NET dependencies (one package of
#     each requirement its installdependencies.sh lists for Debian, reference/github/actions-runner/,
#     installed, and each shared library it ships resolving with ldconfig -p), git, curl, jq, tar,
#     unzip, dockerd, containerd, runc, the docker CLI, iptables and nft run; nothing the build must
#     strip (apt lists and caches, logs, /dev nodes) is in the layer;
#   - --cache: a second build with the same inputs is a copy with the same digest.
# Usage: images/base/test.sh [--reuse DIR] [--keep DIR]
#   --reuse DIR  a layout already built stands for the first build (images/test.sh: the Makefile's
#                base-layout, so CI builds twice, not three times)
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

# The first build (or the reused one) as the caller runs it; the second from the same mirror
# state under another environment: an env var, umask, locale, zone, TMPDIR or HOME that leaked
# into the image would change its digest. The second takes the first's SOURCE_DATE_EPOCH (its
# config label): build.sh's default, the newest Release file's Date, moves when the mirror
# updates between the two builds. (Callers that pinned the epoch differently, test.sh the main
# suite's Date and the Makefile build.sh's default, were once the only difference between two
# "stable" digests.)
config_of() {
    local m
    m="$(manifest_digest "$1")"
    grep -o '"config":{"mediaType":"[^"]*","digest":"sha256:[0-9a-f]\{64\}"' "$1/blobs/sha256/$m" | grep -o '[0-9a-f]\{64\}'
}
# A reused layout from another mirror state (its epoch is not the one a build would take now)
# cannot match a build today: build the first one here instead.
if [ -n "$reuse" ] && [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
    now="$("$here/build.sh" --print-epoch)" || fail "build.sh --print-epoch"
    if ! grep -q "\"dev.imp.base.source-date-epoch\":\"$now\"" "$reuse/blobs/sha256/$(config_of "$reuse")"; then
        echo "images/base/test.sh: $reuse is from another mirror state (a build now takes SOURCE_DATE_EPOCH=$now): building the first one too"
        reuse=""
    fi
fi
start=$(date +%s)
if [ -n "$reuse" ]; then
    cp -a "$reuse" "$t/b1"
else
    "$here/build.sh" --out "$t/b1" --cache "$t/cache" >"$t/b1.log" 2>&1 || fail "first build: $(tail -n 20 "$t/b1.log")"
fi
first=$(($(date +%s) - start))
epoch="$(grep -o '"dev.imp.base.source-date-epoch":"[0-9]*"' "$t/b1/blobs/sha256/$(config_of "$t/b1")" | grep -o '[0-9]\+' | tail -n1)"
[ -n "$epoch" ] || fail "the first build's config has no dev.imp.base.source-date-epoch label"
start=$(date +%s)
mkdir -p "$t/tmp2" "$t/home2"
(umask 077 && env -i PATH="$PATH" SOURCE_DATE_EPOCH="$epoch" TMPDIR="$t/tmp2" HOME="$t/home2" \
    LANG=tr_TR.UTF-8 LC_ALL=tr_TR.UTF-8 TZ=Pacific/Kiritimati SHELL=/bin/sh \
    "$here/build.sh" --out "$t/b2") >"$t/b2.log" 2>&1 || fail "second build: $(tail -n 20 "$t/b2.log")"
second=$(($(date +%s) - start))
d1="$(manifest_digest "$t/b1")" d2="$(manifest_digest "$t/b2")"
[ "$d1" = "$d2" ] || fail "two builds differ: sha256:$d1 vs sha256:$d2 (SOURCE_DATE_EPOCH=$epoch; the second under umask 077, LC_ALL=tr_TR.UTF-8, TZ=Pacific/Kiritimati, its own TMPDIR and HOME)"
ok "reproducible: two builds give sha256:$d1 (${first} s$([ -n "$reuse" ] && echo " (reused)") and ${second} s, the second under another umask, locale, zone, TMPDIR and HOME)"

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
# actions/runner's .NET dependencies, as its own bin/installdependencies.sh lists them for Debian
# (reference/github/actions-runner/debian-dependencies.txt): of each line one package is installed,
# and every shared library that package ships resolves through the image's ldconfig cache.
chroot "$root" /sbin/ldconfig -p >"$t/ldcache" || fail "ldconfig -p in the image"
deps="$here/../../reference/github/actions-runner/debian-dependencies.txt"
[ -f "$deps" ] || fail "no $deps"
checked=()
while read -r -a alternatives; do
    [ "${#alternatives[@]}" -gt 0 ] && [[ ${alternatives[0]} != \#* ]] || continue
    found=""
    for pkg in "${alternatives[@]}"; do
        if chroot "$root" dpkg-query -W -f '${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed; then
            found="$pkg"
            break
        fi
    done
    [ -n "$found" ] || fail "the runner's dependency (one of: ${alternatives[*]}) is not installed"
    # Its sonames (libfoo.so.N, the names a binary links against and ldconfig -p lists).
    libs="$(chroot "$root" dpkg-query -L "$found" | grep -o '[^/]*\.so\.[0-9]*$' | sort -u)"
    [ -n "$libs" ] || fail "$found ships no shared library"
    for lib in $libs; do
        grep -q "^[[:space:]]*$lib " "$t/ldcache" || fail "$lib of the runner's dependency $found does not resolve"
    done
    checked+=("$found ($(echo $libs | tr ' ' ,))")
done <"$deps"
ok "the runner's dependencies (actions/runner's installdependencies.sh for Debian): ${checked[*]}"
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
