#!/usr/bin/env bash
# Builds the test control plane (etcd, kube-apiserver, kube-controller-manager, kubectl, helm) and the
# real-node binaries (kubelet, kube-scheduler; module node/) from their Go modules into testenv/bin/. A
# binary is rebuilt only when it is missing or its module pin (go.mod/go.sum) changed, so a warm run costs
# a few hashes. Go's own build and module caches make a rebuild after a pin change incremental.
# Prints the plan with a first-run estimate, then one line per component with the time it took, the
# elapsed total and what is next. `--stale` only prints the components a run would build.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$here/bin"
mkdir -p "$bin"

# Versions stamped into the binaries: a go-module build has no git metadata, and clients such as helm
# check the server's version (the chart's kubeVersion).
k8s_version="$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3}' "$here/kube/go.mod")"
helm_version="$(awk '$1 == "require" && $2 == "helm.sh/helm/v3" {print $3}' "$here/helm/go.mod")"
k8s_minor="$(cut -d. -f2 <<<"$k8s_version")"
# The node module exists so that adding kubelet does not change the control plane's pin; both must build
# the same Kubernetes release.
node_k8s_version="$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3}' "$here/node/go.mod")"
if [[ "$node_k8s_version" != "$k8s_version" ]]; then
  echo "testenv: node/go.mod pins k8s.io/kubernetes $node_k8s_version, kube/go.mod $k8s_version; they must match" >&2
  exit 1
fi
kube_ldflags="-X k8s.io/component-base/version.gitVersion=$k8s_version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$k8s_minor -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$k8s_minor"
helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$helm_version -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$k8s_minor"

# component -> "module-dir package"
components=(
  "etcd etcd go.etcd.io/etcd/server/v3"
  "kube-apiserver kube k8s.io/kubernetes/cmd/kube-apiserver"
  "kube-controller-manager kube k8s.io/kubernetes/cmd/kube-controller-manager"
  "kubectl kube k8s.io/kubernetes/cmd/kubectl"
  "kubelet node k8s.io/kubernetes/cmd/kubelet"
  "kube-scheduler node k8s.io/kubernetes/cmd/kube-scheduler"
  "helm helm helm.sh/helm/v3/cmd/helm"
)

ldflags_of() {
  case "$1" in
    kube | node) echo "$kube_ldflags" ;;
    helm) echo "$helm_ldflags" ;;
    *) echo "" ;;
  esac
}

pin_of() { { cat "$here/$1/go.mod" "$here/$1/go.sum"; ldflags_of "$1"; } | sha256sum | cut -c1-16; }

# Rough share of a first build (empty Go cache) on 2 cores, in seconds: the estimate printed up front.
first_run_s() {
  case "$1" in
    kube-apiserver) echo 150 ;; kube-controller-manager) echo 90 ;; kubelet) echo 80 ;;
    etcd | kubectl | helm) echo 60 ;; *) echo 40 ;;
  esac
}

todo=()
for entry in "${components[@]}"; do
  read -r name dir pkg <<<"$entry"
  stamp="$bin/.$name.pin"
  if [[ -x "$bin/$name" && -f "$stamp" && "$(cat "$stamp")" == "$(pin_of "$dir")" ]]; then continue; fi
  todo+=("$entry")
done
# --stale: the components a run would build, for testenv/preflight.sh (which needs Go only then).
if [[ "${1:-}" == --stale ]]; then
  for entry in "${todo[@]}"; do printf '%s ' "${entry%% *}"; done
  exit 0
fi
if ((${#todo[@]} == 0)); then
  echo "testenv: all ${#components[@]} components up to date in $bin"
  exit 0
fi
estimate=0 names=()
for entry in "${todo[@]}"; do estimate=$((estimate + $(first_run_s "${entry%% *}"))); names+=("${entry%% *}"); done
echo "testenv: building ${names[*]} from their Go modules into $bin: up to ~$(((estimate + 59) / 60)) min on a first run (empty Go cache, 2 cores), much less with Go's build cache warm"
t0=$SECONDS
for i in "${!todo[@]}"; do
  read -r name dir pkg <<<"${todo[i]}"
  n="[$((i + 1))/${#todo[@]}]"
  echo "testenv: $n building $name ($pkg)"
  start=$SECONDS
  (cd "$here/$dir" && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w $(ldflags_of "$dir")" -o "$bin/$name.tmp" "$pkg")
  mv "$bin/$name.tmp" "$bin/$name"
  pin_of "$dir" >"$bin/.$name.pin"
  next="done"
  ((i + 1 < ${#todo[@]})) && next="next: ${todo[i + 1]%% *}"
  echo "testenv: $n built $name in $((SECONDS - start))s ($((SECONDS - t0))s elapsed; $next)"
done
