# Imp's two entry points: `make smoke` (the local smoke run) and `make test` (everything CI runs).
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: preflight test testenv lint unit base-layout crds reasons guest-static guest-vm images release chart-lint monitoring real-node smoke clean-testenv

## The whole suite: builds the test control plane if needed, lints, runs every test.
test: testenv lint unit images chart-lint monitoring smoke

## What the target needs (testenv/preflight.sh), checked first, before any long build: installed when
## missing (root, apt-get, cargo) unless IMP_INSTALL_DEPS=0, which fails at once naming what is missing and
## the command that installs it. `make test` and `make smoke` check their whole set; other targets the
## toolchains.
PREFLIGHT = build
test: PREFLIGHT = test
smoke: PREFLIGHT = smoke
preflight:
	testenv/preflight.sh $(PREFLIGHT)

## etcd, kube-apiserver, kube-controller-manager, kubectl, helm, kubelet and kube-scheduler from their Go
## modules (incremental; one progress line per component).
testenv: preflight
	testenv/build.sh

## Formatting and clippy (warnings are errors).
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

## Unit and integration tests; integration tests start their own control plane on 127.0.0.1. Includes
## testkit/tests/real_node.rs (`make real-node` alone): the chart on a real kubelet + containerd node,
## skipped with the reason where the host cannot (IMP_REQUIRE_REAL_NODE=1 makes that a failure).
## The real-VM tests (imp-guest's qemu, imp-runtime's *_qemu) run here too, on the static guest built first:
## IMP_REQUIRE_QEMU=1 makes a missing piece a failure (`make guest-vm` runs only them, with their output).
unit: testenv guest-static base-layout
	IMP_GUEST_STATIC_BIN="$${IMP_GUEST_STATIC_BIN:-$$(realpath -m "$${CARGO_TARGET_DIR:-target}")/x86_64-unknown-linux-gnu/release/imp-guest}" \
		IMP_BASE_IMAGE_LAYOUT="$${IMP_BASE_IMAGE_LAYOUT:-$$(cat "$${CARGO_TARGET_DIR:-target}/base-image.path" 2>/dev/null)}" \
		$(CARGO) test --workspace --locked --no-fail-fast

## The reference base image (images/base/) for the Docker-in-the-guest test, built (or reused from
## its cache when the inputs are unchanged) when IMP_REQUIRE_BASE_IMAGE=1 and IMP_BASE_IMAGE_LAYOUT
## names none; otherwise that test says SKIPPED.
base-layout:
	@t="$${CARGO_TARGET_DIR:-target}"; rm -f "$$t/base-image.path"; \
	if [ "$${IMP_REQUIRE_BASE_IMAGE:-0}" = 1 ] && [ -z "$${IMP_BASE_IMAGE_LAYOUT:-}" ]; then \
		images/base/build.sh --out "$$t/base-image" --cache "$$t/base-image-cache" \
			&& realpath "$$t/base-image" > "$$t/base-image.path"; \
	fi

## Regenerate helm/imp/crds from the Rust types.
crds:
	$(CARGO) run -p imp-api --bin crdgen

## Regenerate docs/reasons.md from imp_api::names::reason.
reasons:
	$(CARGO) run -p imp-api --bin reasondoc

## The guest agent must build fully static (it is injected into images that may have no libc).
guest-static:
	guest/check-static.sh

## imp-guest booted for real under QEMU (software emulation) with a Firecracker-style hybrid vsock, and
## under real Firecracker when IMP_FIRECRACKER_BIN and IMP_KERNEL are set. IMP_INSTALL_DEPS=1 installs
## qemu, a Debian cloud kernel, busybox-static, cpio and vhost-device-vsock first.
guest-vm:
	guest/vm-test.sh

## images/: the kernel config fragment against the installed kernel, the runner layer builds
## (determinism, digests, the wrapper never printing the JIT config), the initrd's reproducibility, the
## component images (reproducible, each binary runs from its image, the chart renders their digests).
images: testenv guest-static
	IMP_GUEST_STATIC_BIN="$${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/release/imp-guest" images/test.sh

## One release to an OCI registry: make release REGISTRY=HOST[:PORT]/PATH VERSION=X.Y.Z [PLAIN_HTTP=1]
## (scripts/release.sh: the three images, the chart with their digests as defaults, digests, package lists).
release: testenv guest-static
	scripts/release.sh --registry "$(REGISTRY)" --version "$(VERSION)" $(if $(PLAIN_HTTP),--plain-http) \
		--guest "$${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/release/imp-guest"

## helm lint with the merged seed values (kernelPath, fcBinPath and jailerPath have no defaults) and every seed values
## file over them.
chart-lint: testenv
	for f in reference/seed-examples/helm-values-*.yaml; do testenv/bin/helm lint --strict helm/imp -f reference/seed-examples/helm-values-seed.yaml -f "$$f" || exit 1; done

## The Grafana dashboards and alert rules (helm/imp/dashboards, helm/imp/alerts): promtool parses every query
## and runs the alert tests, then a real Prometheus scrapes a local smoke run and every panel must return
## data. Needs Debian's prometheus (IMP_INSTALL_DEPS=1 installs it); skipped without it unless
## IMP_REQUIRE_PROMETHEUS=1.
monitoring: testenv
	helm/monitoring-test.py

## The chart installed from oci:// onto a real node (kubelet, containerd, runc, CNI bridge) in a network
## namespace of its own; docs/real-node.md.
real-node: testenv
	$(CARGO) test -p imp-testkit --locked --test real_node -- --nocapture

## The local smoke run (root): the runner lifecycle against the GitHub simulator and a real API server, in
## network namespaces of its own, on a real guest where the host allows it (imp-runtime's QEMU backend,
## KVM or TCG; else the Firecracker simulator, and the first line says why); prints a per-phase timeline
## (JSON in target/imp-smoke/report.json), then the chaos scenarios on the simulated path (Firecracker through the jailer double) and their
## invariants (imp-chaos-check), and fails if anything of its own is left. Its Debian packages and
## vhost-device-vsock are installed first (preflight; IMP_INSTALL_DEPS=0 refuses). --guest
## simulated|qemu forces a path; IMP_REQUIRE_REAL_GUEST=1 fails instead of falling back to the simulator.
smoke: testenv
	smoke/imp-smoke.sh --local --chaos

clean-testenv:
	rm -rf testenv/bin
