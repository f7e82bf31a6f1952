//go:build tools

// Package tools pins helm's command, built with `go build helm.sh/helm/v3/cmd/helm`.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
