#!/usr/bin/env bash
# Builds the test control plane (etcd, kube-apiserver, kube-controller-manager, kubectl, helm) from their
# Go modules into testenv/bin/. A binary is rebuilt only when it is missing or its module pin (go.mod/go.sum)
# changed, so a warm run costs a few hashes. Go's own build and module caches make a rebuild after a pin
# change incremental.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$here/bin"
mkdir -p "$bin"

# component -> "module-dir package"
components=(
  "etcd etcd go.etcd.io/etcd/server/v3"
  "kube-apiserver kube k8s.io/kubernetes/cmd/kube-apiserver"
  "kube-controller-manager kube k8s.io/kubernetes/cmd/kube-controller-manager"
  "kubectl kube k8s.io/kubernetes/cmd/kubectl"
  "helm helm helm.sh/helm/v3/cmd/helm"
)

pin_of() { cat "$here/$1/go.mod" "$here/$1/go.sum" | sha256sum | cut -c1-16; }

for entry in "${components[@]}"; do
  read -r name dir pkg <<<"$entry"
  pin="$(pin_of "$dir")"
  stamp="$bin/.$name.pin"
  if [[ -x "$bin/$name" && -f "$stamp" && "$(cat "$stamp")" == "$pin" ]]; then
    echo "testenv: $name up to date ($pin)"
    continue
  fi
  echo "testenv: building $name from $pkg"
  start=$(date +%s)
  (cd "$here/$dir" && CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$bin/$name.tmp" "$pkg")
  mv "$bin/$name.tmp" "$bin/$name"
  echo "$pin" >"$stamp"
  echo "testenv: built $name in $(( $(date +%s) - start ))s"
done
