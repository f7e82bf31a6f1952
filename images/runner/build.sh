#!/usr/bin/env bash
# Build the runner layer as an OCI image layout: one gzip layer holding the GitHub Actions runner
# under /opt/actions-runner and the runner user's home /home/runner (both owner 1001:1001, the
# `runner` user the guest starts the runner as) and the wrapper /usr/local/bin/imp-runner, which
# starts it with the JIT config Imp delivers in ACTIONS_RUNNER_INPUT_JITCONFIG. The layout is
# what a pool template's `runnerImage` points at once pushed to a registry.
#
# The runner's version is recorded as the image config label `dev.imp.runner.version` and printed:
# set the pool's `spec.github.runnerVersion` to it, so the operator can compare it with GitHub's
# supported versions (docs/runner-pool.md, "Runner freshness"). The wrapper runs the runner with
# ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE=1 (exit code 7 when GitHub refuses the version)
# and turns the deprecation message of a runner too old to know that variable into exit code 7 too.
#
# Usage:
#   images/runner/build.sh --runner-tarball actions-runner-linux-x64-<ver>.tar.gz --out DIR
#                          [--tag TAG] [--push HOST:PORT/REPO:TAG]
#   images/runner/build.sh --fake-runner PATH/imp-fake-runner --out DIR [...]   (tests)
#
#   --runner-tarball F  the actions/runner release tarball (you download it; it is not fetched)
#   --fake-runner BIN   instead of the real runner: Imp's fake runner (cargo build -p imp-testkit
#                       --bin imp-fake-runner) with the shared libraries ldd lists, behind a run.sh
#   --out DIR           the OCI layout to write (replaced if it already holds one)
#   --runner-version V  the runner's version (default: from the tarball's name; with --fake-runner
#                       2.330.0, the GitHub simulator's newest release, which its broker checks)
#   --tag TAG           the ref name in index.json (default: latest)
#   --push REF          then copy the layout to docker://REF with skopeo (plain HTTP allowed)
#
# Deterministic: sorted entries, mtime 0, numeric owners, gzip -n; two builds from the same
# input give the same manifest digest, which is printed.
# Needs: tar, gzip, sha256sum (coreutils); skopeo only for --push (Debian: skopeo).
set -euo pipefail
# shellcheck source=../oci-layout.sh
. "$(dirname "$0")/../oci-layout.sh"

die() { echo "runner/build.sh: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || die "needs $1 (Debian package: $2)"; }

tarball="" fake="" out="" tag=latest push="" version=""
while [ $# -gt 0 ]; do
    case "$1" in
        --runner-tarball) tarball="${2:?--runner-tarball needs a file}"; shift 2 ;;
        --fake-runner) fake="${2:?--fake-runner needs a binary}"; shift 2 ;;
        --out) out="${2:?--out needs a directory}"; shift 2 ;;
        --tag) tag="${2:?--tag needs a value}"; shift 2 ;;
        --runner-version) version="${2:?--runner-version needs MAJOR.MINOR.PATCH}"; shift 2 ;;
        --push) push="${2:?--push needs HOST:PORT/REPO:TAG}"; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[ -n "$out" ] || die "--out DIR is required"
if [ -n "$tarball" ] && [ -n "$fake" ]; then die "give --runner-tarball or --fake-runner, not both"; fi
if [ -z "$tarball" ] && [ -z "$fake" ]; then
    die "--runner-tarball actions-runner-linux-x64-<ver>.tar.gz is required (download it from github.com/actions/runner/releases), or --fake-runner for tests"
fi
[[ "$tag" =~ ^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$ ]] || die "--tag $tag is not a valid tag"
if [ -z "$version" ] && [ -n "$tarball" ]; then
    # actions-runner-linux-x64-2.330.0.tar.gz
    version="$(basename "$tarball" | sed -n 's/^actions-runner-.*-\([0-9]*\.[0-9]*\.[0-9]*\)\.tar\.gz$/\1/p')"
    [ -n "$version" ] || die "cannot read the runner version from $(basename "$tarball"); give --runner-version"
fi
[ -n "$version" ] || version=2.330.0
version="${version#v}"
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "--runner-version $version is not MAJOR.MINOR.PATCH"
need tar tar
need gzip gzip
need sha256sum coreutils
[ -z "$push" ] || need skopeo skopeo

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
root="$work/root"
runner="$root/opt/actions-runner"
mkdir -p "$runner" "$root/usr/local/bin" "$root/home/runner"

if [ -n "$tarball" ]; then
    [ -f "$tarball" ] || die "runner tarball $tarball not found"
    tar -xzf "$tarball" -C "$runner" --no-same-owner ||
        die "cannot unpack $tarball (expected actions-runner-linux-x64-<ver>.tar.gz)"
    [ -f "$runner/run.sh" ] || die "$tarball has no run.sh at its top: not an actions/runner tarball"
else
    [ -x "$fake" ] || die "--fake-runner $fake is not an executable (cargo build -p imp-fake-runner)"
    need ldd libc-bin
    need readelf binutils
    mkdir -p "$runner/bin" "$runner/lib"
    cp "$fake" "$runner/bin/imp-fake-runner"
    interp="$(readelf -l "$fake" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')"
    if [ -n "$interp" ]; then
        # Every library the binary loads travels with it, run through its own loader, so the
        # layer does not depend on (or overwrite) the base image's libc.
        ldd "$fake" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | while read -r lib; do
            cp -L "$lib" "$runner/lib/"
        done
        cp -L "$interp" "$runner/lib/"
        loader="${interp##*/}"
        cat >"$runner/run.sh" <<EOF
#!/bin/sh
# Imp's fake runner in place of actions/runner (test image); its libraries travel with it.
here="\$(cd "\$(dirname "\$0")" && pwd)"
export IMP_FAKE_RUNNER_VERSION="\${IMP_FAKE_RUNNER_VERSION:-$version}"
exec "\$here/lib/$loader" --library-path "\$here/lib" "\$here/bin/imp-fake-runner" "\$@"
EOF
    else
        cat >"$runner/run.sh" <<EOF
#!/bin/sh
# Imp's fake runner (static) in place of actions/runner (test image).
export IMP_FAKE_RUNNER_VERSION="\${IMP_FAKE_RUNNER_VERSION:-$version}"
exec "\$(cd "\$(dirname "\$0")" && pwd)/bin/imp-fake-runner" "\$@"
EOF
    fi
    chmod 0755 "$runner/run.sh"
fi

cat >"$root/usr/local/bin/imp-runner" <<'EOF'
#!/bin/sh
# Start the GitHub Actions runner with the one-time JIT config Imp delivers in the environment
# variable ACTIONS_RUNNER_INPUT_JITCONFIG. The runner reads ACTIONS_RUNNER_INPUT_<option> from its
# environment (as actions-runner-controller runs it), so the config never appears in argv where
# any process in the VM could read it. The config is a credential: never print it.
set -eu
if [ -z "${ACTIONS_RUNNER_INPUT_JITCONFIG:-}" ]; then
    echo "imp-runner: ACTIONS_RUNNER_INPUT_JITCONFIG is not set" >&2
    exit 2
fi
# The guest starts this as the pool's runner user (uid 1001, the `runner` user, unless the pool
# says otherwise) with nothing but the config in the environment: give the runner and its jobs
# the basics a login would.
export PATH="${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"
if [ -z "${HOME:-}" ]; then
    if [ "$(id -u)" = 0 ]; then HOME=/root; else HOME=/home/runner; fi
    export HOME
fi
export USER="${USER:-$(id -un 2>/dev/null || id -u)}"
# A base image with a container engine (images/base/) starts it as root before the runner and
# waits for it; its failure is printed and the runner starts anyway (jobs without Docker run).
if [ -x /usr/local/sbin/imp-start-dockerd ]; then
    if [ "$(id -u)" = 0 ]; then /usr/local/sbin/imp-start-dockerd || true
    else sudo -n /usr/local/sbin/imp-start-dockerd || true; fi
fi
# GitHub refusing this runner's version (deprecated) ends it with exit code 7, which the node agent
# records and the operator acts on (the pool stops minting instead of retrying forever).
export ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE=1
cd "${IMP_RUNNER_DIR:-/opt/actions-runner}"
# A runner too old to know that variable exits 1 after printing the deprecation message: watch its
# output for the message (passed through unchanged) and report 7 for it too.
# Without a writable temp dir there is nothing to watch with: run it as is (7 still passes through).
seen="$(mktemp "${TMPDIR:-/tmp}/imp-runner.XXXXXX" 2>/dev/null)" || exec ./run.sh
code="$seen.code"
{ rc=0; ./run.sh 2>&1 || rc=$?; echo "$rc" >"$code"; } | while IFS= read -r line; do
    printf '%s\n' "$line"
    case "$line" in
        *"is deprecated and cannot receive messages"*) echo deprecated >"$seen" ;;
    esac
done
rc="$(cat "$code" 2>/dev/null || echo 1)"
if [ "$rc" != 0 ] && [ -s "$seen" ]; then rc=7; fi
rm -f "$seen" "$code"
exit "$rc"
EOF
chmod 0755 "$root/usr/local/bin/imp-runner"

# Normalised modes; no group/other write anywhere.
chmod -R u+rwX,go+rX,go-w "$root"

# Archives concatenated so every entry is in sorted order with its own numeric owner.
topts=(--format=gnu --sort=name --mtime=@0 --numeric-owner --no-recursion -C "$root")
tar -cf "$work/layer.tar" "${topts[@]}" --owner=0 --group=0 home
tar -cf "$work/home.tar" "${topts[@]}" --owner=1001 --group=1001 home/runner
tar -cf "$work/opt.tar" "${topts[@]}" --owner=0 --group=0 opt
(cd "$root" && find opt/actions-runner -print0 | LC_ALL=C sort -z) |
    tar -cf "$work/runner.tar" "${topts[@]}" --owner=1001 --group=1001 --null -T -
tar -cf "$work/usr.tar" "${topts[@]}" --owner=0 --group=0 \
    usr usr/local usr/local/bin usr/local/bin/imp-runner
for part in home opt runner usr; do tar -Af "$work/layer.tar" "$work/$part.tar"; done

oci_write_layout "$work" "$work/layer.tar" \
    '"Entrypoint":["/usr/local/bin/imp-runner"],"WorkingDir":"/opt/actions-runner","Env":["ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE=1"],"Labels":{"dev.imp.runner.version":"'"$version"'"}' "$tag" "$out" ||
    die "cannot write the layout to $out"
manifest="$OCI_MANIFEST" layer="$OCI_LAYER" layer_size="$OCI_LAYER_SIZE"

echo "runner/build.sh: wrote $out (tag $tag): manifest sha256:$manifest, layer sha256:$layer ($layer_size bytes), runner version $version (set spec.github.runnerVersion: \"$version\")"
if [ -n "$push" ]; then
    skopeo copy --quiet --dest-tls-verify=false "oci:$out:$tag" "docker://$push" ||
        die "skopeo copy to docker://$push failed"
    echo "runner/build.sh: pushed to $push"
fi
