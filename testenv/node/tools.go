//go:build tools

// Package tools pins the Kubernetes node commands that testenv builds for the real-node tests (kubelet,
// kube-scheduler). A module of their own, at the same k8s.io/kubernetes pin as ../kube (build.sh checks),
// so adding them does not change the control plane's pin and rebuild it.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
