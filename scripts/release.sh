#!/usr/bin/env bash
# Build and publish one Imp release to an OCI registry: the three component images (the runtime's with
# QEMU and vhost-device-vsock, so both backends work), the chart with the images' repository, tag and
# digests baked in as its defaults, a digests file and a package list per image. Afterwards
#   helm install imp oci://REGISTRY/charts/imp --version VERSION -n imp-system -f your-values.yaml
# needs no image values.
#
# Usage:
#   scripts/release.sh --registry HOST[:PORT]/PATH --version X.Y.Z [--out DIR] [--bin-dir DIR]
#                      [--plain-http] [--no-push]
#   make release REGISTRY=HOST[:PORT]/PATH VERSION=X.Y.Z
#
#   --registry R   images go to R/imp-operator, R/imp-agent, R/imp-runtime, the chart to R/charts/imp
#   --version V    the release version (SemVer): image tag, chart version and appVersion
#   --out DIR      where the release's files land (default: out/release/V): images/ (OCI layouts),
#                  imp-V.tgz (the chart), digests, packages/<image>.txt
#   --bin-dir DIR  prebuilt imp-operator, imp-agent, imp-runtime (default: a release cargo build)
#   --guest PATH   the static imp-guest (default: guest/check-static.sh's build)
#   --plain-http   the registry speaks HTTP (a local test registry); default HTTPS with TLS checked
#   --no-push      build everything, push nothing
#
# Credentials for the registry come from the usual places (skopeo's and helm's registry logins); none
# is passed on a command line here.
# Needs: what images/components/build.sh needs, qemu-system-x86 and vhost-device-vsock, skopeo, dpkg,
# and testenv/bin/helm (make testenv) or helm on PATH.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
die() { echo "release.sh: $*" >&2; exit 1; }

registry="" version="" out="" bin_dir="" guest="" plain_http="" push=1
while [ $# -gt 0 ]; do
    case "$1" in
        --registry) registry="${2:?--registry needs HOST[:PORT]/PATH}"; shift 2 ;;
        --version) version="${2:?--version needs X.Y.Z}"; shift 2 ;;
        --out) out="${2:?--out needs a directory}"; shift 2 ;;
        --bin-dir) bin_dir="${2:?--bin-dir needs a directory}"; shift 2 ;;
        --guest) guest="${2:?--guest needs the static imp-guest}"; shift 2 ;;
        --plain-http) plain_http=1; shift ;;
        --no-push) push=""; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[ -n "$registry" ] || die "--registry HOST[:PORT]/PATH is required (make release REGISTRY=...)"
[ -n "$version" ] || die "--version X.Y.Z is required (make release VERSION=...)"
[[ "$registry" =~ ^[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+$ ]] ||
    die "--registry $registry: expected HOST[:PORT]/PATH in lower case, e.g. ghcr.io/acme or 127.0.0.1:5000/imp"
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] ||
    die "--version $version: expected SemVer X.Y.Z[-pre] (the chart's version and the images' tag)"
out="${out:-$repo/out/release/$version}"
helm="$repo/testenv/bin/helm"
[ -x "$helm" ] || helm="$(command -v helm)" || die "needs helm (make testenv builds testenv/bin/helm)"
command -v dpkg-query >/dev/null || die "needs dpkg-query (Debian) for the package lists"
[ -z "$push" ] || command -v skopeo >/dev/null || die "needs skopeo (Debian package: skopeo)"

mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export HELM_CACHE_HOME="${HELM_CACHE_HOME:-$work/helm/cache}" HELM_DATA_HOME="${HELM_DATA_HOME:-$work/helm/data}"

# 1. Images, one OCI layout each; the runtime's with QEMU so `runtime.backend: qemu` needs nothing more.
args=(--out "$out/images" --tag "$version" --repository "$registry" --with-qemu)
[ -z "$bin_dir" ] || args+=(--bin-dir "$bin_dir")
[ -z "$guest" ] || args+=(--guest "$guest")
"$repo/images/components/build.sh" "${args[@]}"

# 2. A package list per image: every file of its layer that a Debian package installed, as
#    `package version`, and Imp's own binary.
mkdir -p "$out/packages"
while read -r name _digest; do
    layer="$(grep -o '"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:[0-9a-f]\{64\}"' \
        "$out/images/$name/blobs/sha256/$(grep -o 'sha256:[0-9a-f]\{64\}' "$out/images/$name/index.json" | head -n1 | cut -d: -f2)" |
        grep -o '[0-9a-f]\{64\}')"
    tar -tzf "$out/images/$name/blobs/sha256/$layer" | grep -v '/$' | sed 's|^\./||; s|^|/|' >"$work/files"
    {
        echo "# $name $version: Debian packages whose files it carries (dpkg-query), then Imp's own."
        # Debian's merged /usr: a file at /lib/x is /usr/lib/x to dpkg, and the other way round.
        while read -r f; do
            dpkg-query -S "$f" 2>/dev/null || dpkg-query -S "/usr$f" 2>/dev/null ||
                dpkg-query -S "${f#/usr}" 2>/dev/null || true
        done <"$work/files" | grep -v '^diversion by ' | cut -d: -f1 | tr ',' '\n' | sed 's/ //g' | sort -u |
            while read -r p; do dpkg-query -W -f '${Package} ${Version}\n' "$p"; done
        grep -q '^/usr/local/bin/vhost-device-vsock$' "$work/files" &&
            echo "vhost-device-vsock $(vhost-device-vsock --version 2>/dev/null | awk '{print $NF}') (crates.io)"
        echo "$name $version (this repository, $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown))"
    } >"$out/packages/$name.txt"
done <"$out/images/digests"

# 3. The chart: version and appVersion, and its image defaults pinned to this release.
cp -r "$repo/helm/imp" "$work/imp"
sed -i "s/^version: .*/version: $version/; s/^appVersion: .*/appVersion: \"$version\"/" "$work/imp/Chart.yaml"
digest_of() { awk -v n="$1" '$1 == n { print $2 }' "$out/images/digests"; }
awk -v reg="$registry" -v tag="$version" -v op="$(digest_of imp-operator)" -v ag="$(digest_of imp-agent)" \
    -v rt="$(digest_of imp-runtime)" '
    /^[A-Za-z]/ { section = $1 }
    section == "image:" && /^  repository: / { $0 = "  repository: " reg }
    section == "image:" && /^  tag: / { $0 = "  tag: \"" tag "\"" }
    /^  image: \{repository: "", tag: "", digest: ""\}$/ {
        d = section == "operator:" ? op : section == "agent:" ? ag : section == "runtime:" ? rt : ""
        if (d != "") { $0 = "  image: {repository: \"\", tag: \"\", digest: \"" d "\"}"; pinned++ }
    }
    { print }
    END { if (pinned != 3) exit 3 }
' "$repo/helm/imp/values.yaml" >"$work/imp/values.yaml" ||
    die "helm/imp/values.yaml: did not find the three component image lines to pin"
grep -q "^  repository: $registry\$" "$work/imp/values.yaml" || die "helm/imp/values.yaml: no image.repository line to set"
"$helm" lint --strict "$work/imp" --set agent.env.kernelPath=/var/lib/imp/vmlinux \
    --set agent.env.fcBinPath=/usr/local/bin/firecracker --set agent.env.jailerPath=/usr/local/bin/jailer >/dev/null || die "the release chart does not lint"
"$helm" package "$work/imp" --destination "$out" >/dev/null || die "helm package failed"
chart="$out/imp-$version.tgz"
[ -f "$chart" ] || die "helm package wrote no $chart"

# 4. Push: images by tag (their digests do not change), then the chart.
cp "$out/images/digests" "$out/digests"
if [ -n "$push" ]; then
    tls=(); [ -z "$plain_http" ] || tls=(--dest-tls-verify=false)
    while read -r name _digest; do
        skopeo copy --quiet "${tls[@]}" "oci:$out/images/$name:$version" "docker://$registry/$name:$version" ||
            die "skopeo copy to docker://$registry/$name:$version failed"
    done <"$out/images/digests"
    hp=(); [ -z "$plain_http" ] || hp=(--plain-http)
    "$helm" push "$chart" "oci://$registry/charts" "${hp[@]}" >"$work/push.log" 2>&1 ||
        die "helm push to oci://$registry/charts failed: $(cat "$work/push.log")"
    chart_digest="$(sed -n 's/^Digest: //p' "$work/push.log")"
    [ -n "$chart_digest" ] || die "helm push printed no digest: $(cat "$work/push.log")"
    echo "chart $chart_digest" >>"$out/digests"
fi
echo "release.sh: $version in $out (digests: $(tr '\n' ' ' <"$out/digests"))"
[ -z "$push" ] || echo "release.sh: helm install imp oci://$registry/charts/imp --version $version"
