#!/usr/bin/env bash
# Build imp-guest as a fully static binary (it is injected into every guest rootfs, which may
# have no libc at all) and verify that it has no dynamic dependencies. Prints the size.
# Usage: guest/check-static.sh   (honours CARGO_TARGET_DIR)
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
target=x86_64-unknown-linux-gnu
target_dir="${CARGO_TARGET_DIR:-$repo/target}"
bin="$target_dir/$target/release/imp-guest"

cd "$repo"
# Stripped: the binary is copied into every rootfs image; symbols only cost space there.
RUSTFLAGS='-C target-feature=+crt-static' CARGO_PROFILE_RELEASE_STRIP=symbols \
    cargo build --release --target "$target" -p imp-guest

fail() { echo "check-static: FAIL: $*" >&2; exit 1; }

[ -x "$bin" ] || fail "no binary at $bin"
desc="$(file -b "$bin")"
echo "file: $desc"
case "$desc" in
    *"statically linked"* | *"static-pie linked"*) ;;
    *) fail "file(1) does not report a static binary" ;;
esac
# ldd exits non-zero for static binaries; only its text matters.
ldd_out="$(ldd "$bin" 2>&1 || true)"
echo "ldd: $ldd_out"
case "$ldd_out" in
    *"not a dynamic executable"* | *"statically linked"*) ;;
    *) fail "ldd lists dynamic dependencies" ;;
esac
if readelf -d "$bin" 2>/dev/null | grep -q '(NEEDED)'; then
    fail "ELF dynamic section has NEEDED entries"
fi
if readelf -l "$bin" | grep -q 'INTERP'; then
    fail "ELF requests a program interpreter"
fi
# It must run with nothing but the kernel: no loader, no libc on disk needed.
"$bin" --version

size=$(stat -c %s "$bin")
echo "check-static: OK: $bin is static, $size bytes ($((size / 1024)) KiB)"
