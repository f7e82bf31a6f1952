//go:build tools

// Package tools pins the Kubernetes control-plane commands that testenv builds.
// They are built with `go build <package>`; this file only keeps them in go.mod.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
