//go:build tools

// Package tools pins etcd's server command, built with `go build go.etcd.io/etcd/server/v3`.
package tools

import _ "go.etcd.io/etcd/server/v3"
