#!/usr/bin/env bash
# Tests of the image builds that need no kernel build and no network:
#   - images/kernel/check-fragment.sh against the installed kernel config, and build.sh --verify;
#   - images/runner/build.sh, fake-runner variant: OCI layout valid (every blob digest checked
#     with sha256sum, skopeo inspect when installed), deterministic (two builds, same manifest
#     digest), layer contents, owners and sorted order, the bundled runner starts;
#   - the real-runner variant from a synthetic actions/runner tarball, and the imp-runner wrapper
#     passing the JIT config to run.sh without ever printing it;
#   - with docker-registry installed (Debian: docker-registry): --push to a local registry.
#   - with IMP_GUEST_STATIC_BIN set: images/initrd/build.sh is deterministic and lists its modules
#     (the boot set and the container engine's).
#   - with IMP_BASE_IMAGE_TEST=1 (slow, 4-8 min, needs mmdebstrap and deb.debian.org):
#     images/base/test.sh, the reference base image built twice (same digest) and its contents.
#   - images/components/build.sh: two builds give the same digests; each image's binary runs --version
#     chrooted into its unpacked layer (so every library it needs is in the image); operator and agent
#     are non-root; the runtime image's mkfs.ext4, ip, nft and /bin/sh run there too (needs root for
#     chroot). IMP_COMPONENT_BIN_DIR gives prebuilt binaries (default: a debug cargo build).
#   - with qemu-system-x86_64 and vhost-device-vsock: the runtime image --with-qemu starts a pc machine
#     and vhost-device-vsock from its layer (else SKIPPED, a failure with IMP_REQUIRE_QEMU=1);
#   - with those, docker-registry and skopeo: scripts/release.sh to the local registry, then the chart
#     from oci:// with no image values names each pushed image by digest, package lists per image
#     (else SKIPPED, a failure with IMP_REQUIRE_RELEASE=1).
# Usage: images/test.sh   (honours CARGO_TARGET_DIR; IMP_FAKE_RUNNER skips building the fake runner)
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
target_dir="${CARGO_TARGET_DIR:-$repo/target}"
fail() { echo "images/test.sh: FAIL: $*" >&2; exit 1; }
ok() { echo "images/test.sh: ok: $*"; }
t="$(mktemp -d)"
registry_pid=""
cleanup() {
    if [ -n "$registry_pid" ]; then kill "$registry_pid" 2>/dev/null || true; fi
    rm -rf "$t"
}
trap cleanup EXIT

# --- kernel ---------------------------------------------------------------------------------
"$repo/images/kernel/check-fragment.sh"
grep -E '^CONFIG_' "$repo/images/kernel/imp.config" >"$t/good.config"
"$repo/images/kernel/build.sh" --verify "$t/good.config" >/dev/null || fail "verify rejects a config with every option"
sed 's/^CONFIG_OVERLAY_FS=y$/CONFIG_OVERLAY_FS=m/' "$t/good.config" >"$t/bad.config"
if "$repo/images/kernel/build.sh" --verify "$t/bad.config" 2>"$t/verify.err"; then fail "verify accepted OVERLAY_FS=m"; fi
grep -q 'CONFIG_OVERLAY_FS=y (final: CONFIG_OVERLAY_FS=m)' "$t/verify.err" || fail "verify did not name the lost option: $(cat "$t/verify.err")"
ok "kernel fragment"
# What a container engine in the job needs (docs/workloads.md) is in the fragment, built in: cgroups
# (v2 controllers and the BPF device controller), namespaces, seccomp, overlay, the bridge network
# with veth and netfilter NAT. build.sh --verify then makes sure each survives into a built kernel.
for sym in CGROUPS MEMCG CGROUP_PIDS CGROUP_SCHED CGROUP_CPUACCT CGROUP_DEVICE CGROUP_FREEZER CPUSETS \
    BLK_CGROUP CGROUP_BPF BPF_SYSCALL NAMESPACES USER_NS PID_NS NET_NS IPC_NS UTS_NS SECCOMP \
    SECCOMP_FILTER OVERLAY_FS KEYS BRIDGE VETH BRIDGE_NETFILTER NETFILTER NF_CONNTRACK NF_NAT NF_TABLES \
    NFT_NAT NFT_COMPAT NETFILTER_XTABLES NETFILTER_XT_TARGET_MASQUERADE NETFILTER_XT_MATCH_ADDRTYPE \
    NETFILTER_XT_MATCH_CONNTRACK NETFILTER_XT_NAT IP_NF_IPTABLES IP_NF_FILTER IP_NF_NAT; do
    grep -qx "CONFIG_$sym=y" "$repo/images/kernel/imp.config" ||
        fail "images/kernel/imp.config lacks CONFIG_$sym=y, which a container engine in the guest needs"
done
ok "kernel fragment has the container-engine options (cgroups, namespaces, seccomp, overlay, bridge, veth, NAT)"

# --- runner layout helpers -------------------------------------------------------------------
build="$repo/images/runner/build.sh"
manifest_digest() { grep -o '"digest":"sha256:[0-9a-f]\{64\}"' "$1/index.json" | head -n1 | cut -d: -f3 | tr -d '"'; }
layer_blob() {
    local m
    m="$(manifest_digest "$1")"
    grep -o '"layers":\[{"mediaType":"[^"]*","digest":"sha256:[0-9a-f]\{64\}"' "$1/blobs/sha256/$m" | grep -o '[0-9a-f]\{64\}'
}
# Every blob's name is its sha256; every digest index.json, the manifest and config mention
# exists with the size its descriptor gives.
check_layout() {
    local dir="$1" f d size m
    [ "$(cat "$dir/oci-layout")" = '{"imageLayoutVersion":"1.0.0"}' ] || fail "$dir/oci-layout"
    for f in "$dir"/blobs/sha256/*; do
        [ "$(sha256sum "$f" | cut -d' ' -f1)" = "${f##*/}" ] || fail "blob $f does not match its digest"
    done
    m="$(manifest_digest "$dir")"
    for f in "$dir/index.json" "$dir/blobs/sha256/$m"; do
        grep -o '"digest":"sha256:[0-9a-f]\{64\}","size":[0-9]*' "$f" | while IFS= read -r desc; do
            d="$(echo "$desc" | cut -d: -f3 | cut -d'"' -f1)"
            size="${desc##*:}"
            [ -f "$dir/blobs/sha256/$d" ] || fail "$f refers to missing blob $d"
            [ "$(stat -c %s "$dir/blobs/sha256/$d")" = "$size" ] || fail "blob $d: size differs from its descriptor"
        done
    done
    if command -v skopeo >/dev/null; then
        skopeo inspect "oci:$dir:${2:-latest}" >"$t/inspect.json" || fail "skopeo inspect oci:$dir"
        grep -q "\"Digest\": \"sha256:$m\"" "$t/inspect.json" || fail "skopeo reports another digest"
    else
        echo "images/test.sh: skopeo not installed (Debian: skopeo): checked the layout with sha256sum only"
    fi
}

# --- fake-runner variant -----------------------------------------------------------------------
fake="${IMP_FAKE_RUNNER:-}"
if [ -z "$fake" ]; then
    (cd "$repo" && cargo build -q -p imp-fake-runner)
    fake="$target_dir/debug/imp-fake-runner"
fi
# A debug build is ~150 MB; its symbols only slow gzip down.
strip -o "$t/imp-fake-runner" "$fake"
fake="$t/imp-fake-runner"
"$build" --fake-runner "$fake" --out "$t/fake1" >/dev/null
"$build" --fake-runner "$fake" --out "$t/fake2" >/dev/null
check_layout "$t/fake1"
[ "$(manifest_digest "$t/fake1")" = "$(manifest_digest "$t/fake2")" ] || fail "two builds gave different manifests"
ok "fake-runner layout valid and deterministic (sha256:$(manifest_digest "$t/fake1"))"

layer="$t/fake1/blobs/sha256/$(layer_blob "$t/fake1")"
tar -tzf "$layer" >"$t/list"
LC_ALL=C sort -c "$t/list" || fail "layer entries are not sorted"
for p in opt/actions-runner/ opt/actions-runner/run.sh opt/actions-runner/bin/imp-fake-runner usr/local/bin/imp-runner; do
    grep -qx "$p" "$t/list" || fail "layer lacks $p"
done
grep -q '^opt/actions-runner/lib/ld-linux' "$t/list" || fail "layer lacks the fake runner's loader"
tar -tvzf "$layer" --numeric-owner >"$t/long"
grep -q ' 1001/1001 .* opt/actions-runner/run.sh$' "$t/long" || fail "runner dir not owned by 1001:1001"
grep -q '^d.* 1001/1001 .* home/runner/$' "$t/long" || fail "the runner user's home is not owned by 1001:1001"
grep -q '^-rwxr-xr-x 0/0 .* usr/local/bin/imp-runner$' "$t/long" || fail "wrapper is not 0755 root"
if grep -qv ' 1970-01-01 00:00 ' "$t/long"; then fail "entries with mtime other than 0"; fi
mkdir "$t/fakeroot"
tar -xzf "$layer" -C "$t/fakeroot" --no-same-owner
"$t/fakeroot/opt/actions-runner/run.sh" --help >"$t/help" || fail "the bundled fake runner does not start"
grep -q -- '--jitconfig' "$t/help" || fail "unexpected fake runner help: $(cat "$t/help")"
ok "fake-runner layer contents; bundled runner starts with its own libraries"

# --- real-runner variant from a synthetic actions/runner tarball -------------------------------
mkdir -p "$t/tarball/bin"
cat >"$t/tarball/run.sh" <<'SH'
#!/bin/sh
printf '%s\n' "$@" >"$ARGS_FILE"
[ -n "${ACTIONS_RUNNER_INPUT_JITCONFIG:-}" ] && echo "jit config in the environment" >>"$ARGS_FILE"
echo "runner: listening for jobs"
echo "env: HOME=${HOME:-} PATH=${PATH:-}"
SH
printf '#!/bin/sh\necho configured\n' >"$t/tarball/config.sh"
echo listener >"$t/tarball/bin/Runner.Listener"
chmod 0755 "$t/tarball/run.sh" "$t/tarball/config.sh"
tar -czf "$t/actions-runner-linux-x64-0.0.0.tar.gz" -C "$t/tarball" .
"$build" --runner-tarball "$t/actions-runner-linux-x64-0.0.0.tar.gz" --out "$t/real" --tag 0.0.0 >/dev/null
check_layout "$t/real" 0.0.0
layer="$t/real/blobs/sha256/$(layer_blob "$t/real")"
tar -tzf "$layer" >"$t/list"
for p in opt/actions-runner/run.sh opt/actions-runner/config.sh opt/actions-runner/bin/Runner.Listener usr/local/bin/imp-runner; do
    grep -qx "$p" "$t/list" || fail "real layer lacks $p"
done
mkdir "$t/realroot"
tar -xzf "$layer" -C "$t/realroot" --no-same-owner
secret="jit-$(date +%s%N)-never-print"
ACTIONS_RUNNER_INPUT_JITCONFIG="$secret" ARGS_FILE="$t/args" IMP_RUNNER_DIR="$t/realroot/opt/actions-runner" \
    "$t/realroot/usr/local/bin/imp-runner" >"$t/out" 2>"$t/err" || fail "wrapper failed: $(cat "$t/err")"
# No arguments (argv is readable by every process in the VM): the config stays in the environment.
[ "$(cat "$t/args")" = "$(printf '\njit config in the environment')" ] || fail "run.sh got: $(cat "$t/args")"
if grep -qF "$secret" "$t/out" "$t/err"; then fail "the wrapper printed the JIT config"; fi
grep -q 'listening for jobs' "$t/out" || fail "run.sh output lost"
# The guest gives the runner nothing but the config: the wrapper supplies PATH and HOME.
env -i ACTIONS_RUNNER_INPUT_JITCONFIG="$secret" ARGS_FILE="$t/args" IMP_RUNNER_DIR="$t/realroot/opt/actions-runner" \
    "$t/realroot/usr/local/bin/imp-runner" >"$t/out" 2>"$t/err" || fail "wrapper failed with an empty env: $(cat "$t/err")"
if [ "$(id -u)" = 0 ]; then want_home=/root; else want_home=/home/runner; fi
grep -qx "env: HOME=$want_home PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" "$t/out" ||
    fail "the wrapper did not set HOME/PATH: $(cat "$t/out")"
if env -u ACTIONS_RUNNER_INPUT_JITCONFIG IMP_RUNNER_DIR="$t/realroot/opt/actions-runner" \
    "$t/realroot/usr/local/bin/imp-runner" 2>"$t/err"; then fail "wrapper ran without a JIT config"; fi
grep -q 'ACTIONS_RUNNER_INPUT_JITCONFIG is not set' "$t/err" || fail "no clear message without a JIT config"
ok "real-runner layout from a tarball; wrapper passes the JIT config without printing it"

# Runner versions: the layer records its version, and a runner GitHub refuses exits 7 (the
# deprecation message of a runner that does not know the variable becomes 7 too); other codes pass.
grep -q '"dev.imp.runner.version":"0.0.0"' "$t/real/blobs/sha256/"* || fail "no dev.imp.runner.version label"
mkdir -p "$t/refused"
for want in "1:7:Runner version v2.300.0 is deprecated and cannot receive messages." "3:3:other failure" \
    "0:0:fine" "7:7:deprecated (exit code 7 itself)"; do
    code="${want%%:*}" rest="${want#*:}"; expect="${rest%%:*}" line="${rest#*:}"
    printf '#!/bin/sh\n[ "$ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE" = 1 ] || exit 99\necho "%s"\nexit %s\n' "$line" "$code" >"$t/refused/run.sh"
    chmod 0755 "$t/refused/run.sh"
    got=0
    ACTIONS_RUNNER_INPUT_JITCONFIG=x IMP_RUNNER_DIR="$t/refused" "$t/realroot/usr/local/bin/imp-runner" >"$t/out" 2>&1 || got=$?
    [ "$got" = "$expect" ] || fail "runner exiting $code with \"$line\": wrapper exited $got, want $expect"
    grep -qF "$line" "$t/out" || fail "the runner's output was not passed through: $(cat "$t/out")"
done
ok "runner version labelled; deprecation (exit 7 or the message) reported as exit code 7"

# Inputs the user must supply are named when missing.
if "$build" --out "$t/x" 2>"$t/err"; then fail "built without a runner"; fi
grep -q -- '--runner-tarball' "$t/err" || fail "missing-tarball message: $(cat "$t/err")"
tar -czf "$t/empty.tar.gz" -C "$t/tarball/bin" .
if "$build" --runner-tarball "$t/empty.tar.gz" --runner-version 2.330.0 --out "$t/x" 2>"$t/err"; then fail "accepted a tarball without run.sh"; fi
grep -q 'no run.sh' "$t/err" || fail "bad-tarball message: $(cat "$t/err")"
ok "clear errors for missing or wrong inputs"

# --- push to a local registry -------------------------------------------------------------------
if command -v docker-registry >/dev/null && command -v skopeo >/dev/null; then
    port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
    cat >"$t/registry.yml" <<YML
version: 0.1
storage:
  filesystem:
    rootdirectory: $t/registry
http:
  addr: 127.0.0.1:$port
YML
    docker-registry serve "$t/registry.yml" >"$t/registry.log" 2>&1 &
    registry_pid=$!
    for _ in $(seq 50); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
        sleep 0.1
    done
    "$build" --fake-runner "$fake" --out "$t/push" --push "127.0.0.1:$port/imp/runner:test" >/dev/null
    skopeo inspect --tls-verify=false "docker://127.0.0.1:$port/imp/runner:test" >"$t/remote.json"
    grep -q "\"Digest\": \"sha256:$(manifest_digest "$t/push")\"" "$t/remote.json" || fail "pushed digest differs"
    ok "pushed to a local registry with the same manifest digest"
else
    why="needs docker-registry and skopeo (Debian packages)"
    [ "${IMP_REQUIRE_REGISTRY:-}" != 1 ] || fail "IMP_REQUIRE_REGISTRY=1 but the push test $why"
    # The line testkit::skip prints, so .ci/skips.sh sees it.
    echo "SKIPPED images/test.sh's push test: $why (IMP_REQUIRE_REGISTRY=1 makes this a failure)"
fi

# --- component images ----------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || fail "the component image test chroots into each image: run it as root"
components="$repo/images/components/build.sh"
bins="${IMP_COMPONENT_BIN_DIR:-}"
if [ -z "$bins" ]; then
    (cd "$repo" && cargo build -q -p imp-operator -p imp-runtime -p imp-agent --bins)
    bins="$target_dir/debug"
fi
# The runtime image carries the static imp-guest (guest/check-static.sh; the Makefile's images target
# builds it first and passes it here).
guest_args=()
[ -z "${IMP_GUEST_STATIC_BIN:-}" ] || guest_args=(--guest "$IMP_GUEST_STATIC_BIN")
start=$(date +%s)
"$components" --bin-dir "$bins" --out "$t/comp1" --tag test "${guest_args[@]}" >/dev/null
took=$(($(date +%s) - start))
"$components" --bin-dir "$bins" --out "$t/comp2" --tag test "${guest_args[@]}" >/dev/null
if "$components" --bin-dir "$bins" --out "$t/comp-noguest" --only imp-runtime --guest "$t/no-such-guest" 2>"$t/noguest.err"; then
    fail "the runtime image was built without imp-guest"
fi
grep -q "imp-runtime needs the static imp-guest" "$t/noguest.err" || fail "no clear error without imp-guest: $(cat "$t/noguest.err")"
cmp -s "$t/comp1/digests" "$t/comp2/digests" ||
    fail "two component builds differ: $(diff "$t/comp1/digests" "$t/comp2/digests")"
for name in imp-operator imp-agent imp-runtime; do
    dir="$t/comp1/$name"
    check_layout "$dir" test
    grep -qx "$name sha256:$(manifest_digest "$dir")" "$t/comp1/digests" || fail "digests file lacks $name"
    layer="$dir/blobs/sha256/$(layer_blob "$dir")"
    tar -tvzf "$layer" --numeric-owner >"$t/long"
    if grep -qv ' 0/0 ' "$t/long"; then fail "$name: entries not owned by 0:0"; fi
    if grep -qv ' 1970-01-01 00:00 ' "$t/long"; then fail "$name: entries with mtime other than 0"; fi
    tar -tzf "$layer" | LC_ALL=C sort -c || fail "$name: layer entries are not sorted"
    root="$t/root-$name"
    mkdir "$root"
    tar -xzf "$layer" -C "$root"
    chroot "$root" "/usr/local/bin/$name" --version >"$t/version" 2>&1 ||
        fail "$name --version does not run from its image: $(cat "$t/version")"
    grep -q "^$name " "$t/version" || fail "$name --version printed: $(cat "$t/version")"
    config="$(grep -o '"config":{"mediaType":"[^"]*","digest":"sha256:[0-9a-f]\{64\}"' "$dir/blobs/sha256/$(manifest_digest "$dir")" | grep -o '[0-9a-f]\{64\}')"
    grep -q "\"Entrypoint\":\[\"/usr/local/bin/$name\"\]" "$dir/blobs/sha256/$config" || fail "$name: Entrypoint"
    if [ "$name" = imp-runtime ]; then
        if grep -q '"User"' "$dir/blobs/sha256/$config"; then fail "imp-runtime must run as root (TAP, /dev/kvm)"; fi
        chroot "$root" /usr/sbin/mkfs.ext4 -V >"$t/tool" 2>&1 || fail "mkfs.ext4 in the runtime image: $(cat "$t/tool")"
        grep -q '^mke2fs ' "$t/tool" || fail "mkfs.ext4 -V printed: $(cat "$t/tool")"
        # The runtime builds ext4 images with -d (populate from a directory): do it inside the image.
        mkdir -p "$root/tmp/src/etc" && echo probe >"$root/tmp/src/etc/probe"
        chroot "$root" /usr/sbin/mkfs.ext4 -q -F -d /tmp/src /tmp/probe.ext4 4M >"$t/tool" 2>&1 ||
            fail "mkfs.ext4 -d in the runtime image: $(cat "$t/tool")"
        chroot "$root" /usr/sbin/nft --version >"$t/tool" 2>&1 || fail "nft in the runtime image: $(cat "$t/tool")"
        # IMP_GUEST_BIN's default: copied into every VM's root filesystem.
        [ -x "$root/usr/local/lib/imp/imp-guest" ] || fail "the runtime image lacks /usr/local/lib/imp/imp-guest"
        if [ -n "${IMP_GUEST_STATIC_BIN:-}" ]; then
            cmp -s "$IMP_GUEST_STATIC_BIN" "$root/usr/local/lib/imp/imp-guest" ||
                fail "the runtime image's imp-guest is not $IMP_GUEST_STATIC_BIN"
        fi
        chroot "$root" /usr/sbin/ip -V >"$t/tool" 2>&1 || fail "ip in the runtime image: $(cat "$t/tool")"
        # The chart's KVM preflight script needs /bin/sh, [ -c ] and sleep.
        chroot "$root" /bin/sh -c '[ ! -c /nonexistent ] && exec sleep 0' || fail "/bin/sh or sleep in the runtime image"
    else
        grep -q '"User":"65532:65532"' "$dir/blobs/sha256/$config" || fail "$name does not run as 65532"
    fi
    echo "images/test.sh: $name: $(stat -c %s "$layer") bytes gzipped, $(du -sb "$root" | cut -f1) bytes unpacked"
done
# The chart's image values from the build pin each image by its digest.
helm="$repo/testenv/bin/helm"
[ -x "$helm" ] || fail "needs $helm (make testenv) to render the chart with the built image values"
HELM_CACHE_HOME="$t/helm" HELM_CONFIG_HOME="$t/helm" HELM_DATA_HOME="$t/helm" "$helm" template imp "$repo/helm/imp" \
    --set agent.env.kernelPath=/var/lib/imp/vmlinux --set agent.env.fcBinPath=/usr/local/bin/firecracker --set agent.env.jailerPath=/usr/local/bin/jailer \
    -f "$t/comp1/values.yaml" >"$t/rendered.yaml" || fail "helm template with $t/comp1/values.yaml"
while read -r name digest; do
    grep -q "image: ghcr.io/imp-dev/$name@$digest\$" "$t/rendered.yaml" || fail "the chart does not render $name@$digest"
done <"$t/comp1/digests"
ok "component images: reproducible ($(tr '\n' ' ' <"$t/comp1/digests")), each binary runs from its image (one build: ${took}s)"

# The QEMU backend's runtime image: QEMU (with its firmware) and vhost-device-vsock run from the image.
if command -v qemu-system-x86_64 >/dev/null && command -v vhost-device-vsock >/dev/null; then
    "$components" --bin-dir "$bins" --out "$t/compq" --tag test --only imp-runtime --with-qemu "${guest_args[@]}" >/dev/null
    check_layout "$t/compq/imp-runtime" test
    rootq="$t/root-qemu"
    mkdir "$rootq"
    tar -xzf "$t/compq/imp-runtime/blobs/sha256/$(layer_blob "$t/compq/imp-runtime")" -C "$rootq"
    chroot "$rootq" /usr/bin/qemu-system-x86_64 --version >"$t/tool" 2>&1 || fail "QEMU in the runtime image: $(cat "$t/tool")"
    # The pc machine's BIOS and option ROMs load from the image: QEMU exits at once when one is
    # missing; started and still running after 3 s (timeout's 124) it found them.
    rc=0
    timeout 3 chroot "$rootq" /usr/bin/qemu-system-x86_64 -machine pc -accel tcg -display none \
        -nodefaults -no-reboot -serial none -monitor none -device virtio-net-pci,netdev=n0 \
        -netdev user,id=n0 >"$t/tool" 2>&1 || rc=$?
    [ "$rc" = 124 ] || fail "QEMU cannot start a pc machine from the runtime image (exit $rc): $(cat "$t/tool")"
    chroot "$rootq" /usr/local/bin/vhost-device-vsock --version >"$t/tool" 2>&1 ||
        fail "vhost-device-vsock in the runtime image: $(cat "$t/tool")"
    if cmp -s "$t/comp1/digests" <(grep imp-runtime "$t/compq/digests"); then fail "--with-qemu changed nothing"; fi
    ok "runtime image --with-qemu: qemu-system-x86_64 starts a pc machine and vhost-device-vsock runs from it"
elif [ "${IMP_REQUIRE_QEMU:-0}" = 1 ]; then
    fail "IMP_REQUIRE_QEMU=1: the --with-qemu runtime image needs qemu-system-x86_64 and vhost-device-vsock"
else
    echo "images/test.sh: SKIPPED the --with-qemu runtime image: no qemu-system-x86_64 or vhost-device-vsock (IMP_REQUIRE_QEMU=1 fails instead)"
fi

# --- a release to the local registry (scripts/release.sh) ---------------------------------------
if [ -n "$registry_pid" ] && command -v qemu-system-x86_64 >/dev/null && command -v vhost-device-vsock >/dev/null; then
    reg="127.0.0.1:$port/imp-release"
    "$repo/scripts/release.sh" --registry "$reg" --version 0.0.1-test --out "$t/rel" --bin-dir "$bins" \
        "${guest_args[@]}" --plain-http >"$t/release.log" 2>&1 || fail "release.sh: $(tail -5 "$t/release.log")"
    # The chart from the registry, with no image values, names every image by the release's digest.
    HELM_CACHE_HOME="$t/helm" HELM_CONFIG_HOME="$t/helm" HELM_DATA_HOME="$t/helm" "$helm" template imp \
        "oci://$reg/charts/imp" --version 0.0.1-test --plain-http \
        --set agent.env.kernelPath=/var/lib/imp/vmlinux --set agent.env.fcBinPath=/usr/local/bin/firecracker --set agent.env.jailerPath=/usr/local/bin/jailer \
        >"$t/release.yaml" 2>"$t/release.err" || fail "helm template oci://$reg/charts/imp: $(cat "$t/release.err")"
    grep -c '^chart sha256:[0-9a-f]\{64\}$' "$t/rel/digests" >/dev/null || fail "no chart digest in $t/rel/digests"
    while read -r name digest; do
        [ "$name" = chart ] && continue
        grep -q "image: $reg/$name@$digest\$" "$t/release.yaml" || fail "the released chart does not default to $reg/$name@$digest"
        skopeo inspect --tls-verify=false "docker://$reg/$name:0.0.1-test" >"$t/remote.json"
        grep -q "\"Digest\": \"$digest\"" "$t/remote.json" || fail "$reg/$name:0.0.1-test is not $digest"
        [ -s "$t/rel/packages/$name.txt" ] || fail "no package list for $name"
        grep -q "^$name 0.0.1-test " "$t/rel/packages/$name.txt" || fail "$name's package list does not name it"
    done <"$t/rel/digests"
    for p in e2fsprogs nftables iproute2 busybox-static qemu-system-x86 vhost-device-vsock; do
        grep -q "^$p " "$t/rel/packages/imp-runtime.txt" || fail "imp-runtime's package list lacks $p: $(cat "$t/rel/packages/imp-runtime.txt")"
    done
    ok "release 0.0.1-test pushed to $reg: the chart installs its images by digest with no image values ($(wc -l <"$t/rel/packages/imp-runtime.txt") lines in imp-runtime's package list)"
elif [ "${IMP_REQUIRE_RELEASE:-0}" = 1 ]; then
    fail "IMP_REQUIRE_RELEASE=1: the release test needs docker-registry, skopeo, qemu-system-x86_64 and vhost-device-vsock"
else
    echo "images/test.sh: SKIPPED the release test: needs docker-registry, skopeo, qemu-system-x86_64 and vhost-device-vsock (IMP_REQUIRE_RELEASE=1 fails instead)"
fi

# --- initrd (optional: needs the static imp-guest and an installed kernel) ---------------------
if [ -n "${IMP_GUEST_STATIC_BIN:-}" ]; then
    "$repo/images/initrd/build.sh" --guest "$IMP_GUEST_STATIC_BIN" --out "$t/i1" --gzip >/dev/null
    "$repo/images/initrd/build.sh" --guest "$IMP_GUEST_STATIC_BIN" --out "$t/i2" --gzip >/dev/null
    cmp -s "$t/i1" "$t/i2" || fail "two initrd builds differ"
    zcat "$t/i1" | cpio -i --to-stdout --quiet lib/modules/imp/load-order >"$t/order"
    for m in vmw_vsock_virtio_transport bridge veth br_netfilter nf_tables nft_compat nft_chain_nat \
        xt_MASQUERADE xt_addrtype xt_conntrack iptable_nat; do
        grep -qx "/lib/modules/imp/$m.ko" "$t/order" || fail "initrd load-order lacks $m: $(cat "$t/order")"
    done
    ok "initrd deterministic ($(stat -c %s "$t/i1") bytes)"
fi
# --- reference base image (images/base/test.sh): two mmdebstrap builds, ~4 min each ----------------
if [ "${IMP_BASE_IMAGE_TEST:-0}" = 1 ] || [ "${IMP_REQUIRE_BASE_IMAGE:-0}" = 1 ]; then
    command -v mmdebstrap >/dev/null || fail "the base image test needs mmdebstrap (Debian: mmdebstrap)"
    # The Makefile's base-layout (build.sh as the caller ran it) stands for the first build: the
    # second, under another environment, must give its digest (one build less in CI).
    reuse=()
    layout="$(cat "${CARGO_TARGET_DIR:-$repo/target}/base-image.path" 2>/dev/null || true)"
    [ -n "$layout" ] && [ -f "$layout/index.json" ] && reuse=(--reuse "$layout")
    "$repo/images/base/test.sh" "${reuse[@]}" || fail "images/base/test.sh"
else
    echo "SKIPPED images/base/test.sh: two builds of the reference base image from the Debian mirror take 4-8 min; IMP_BASE_IMAGE_TEST=1 runs it (IMP_REQUIRE_BASE_IMAGE=1 makes this a failure)"
fi
echo "images/test.sh: all passed"
