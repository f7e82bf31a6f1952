#!/usr/bin/env bash
# Build an uncompressed vmlinux for Firecracker guests: a base config with imp.config merged on
# top (scripts/kconfig/merge_config.sh), every fragment option verified in the final .config.
# No modules and no initrd are needed with the result.
#
# Usage:
#   images/kernel/build.sh --source DIR [--base-config FILE] [--out DIR] [--jobs N]
#   images/kernel/build.sh --verify .config        (only the fragment check, no build)
#
#   --source DIR       a kernel source tree, e.g. Debian's: apt-get install linux-source, then
#                      tar -xf /usr/src/linux-source-<ver>.tar.xz
#   --base-config F    the config to start from (e.g. /boot/config-<ver>, or Firecracker's
#                      microvm-kernel-ci-x86_64-*.config); default: the tree's x86_64 defconfig
#   --out DIR          where vmlinux and config land (default: ./out/kernel); the build tree is
#                      DIR/build (make O=), so the source stays clean and rebuilds are incremental
#   --jobs N           parallel make jobs (default: nproc)
#
# Needs: make gcc flex bison bc perl libelf-dev libssl-dev (Debian: build-essential flex bison
# bc libelf-dev libssl-dev). Building takes tens of minutes to hours depending on the base.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
fragment="$here/imp.config"
die() { echo "kernel/build.sh: $*" >&2; exit 1; }

# Every CONFIG_X=V line of the fragment must be in $1 verbatim; "# CONFIG_X is not set" lines
# must not be enabled. Prints the ones that did not survive.
verify() {
    local cfg="$1" line sym lost=()
    while IFS= read -r line; do
        case "$line" in
            CONFIG_*=*) grep -qxF -- "$line" "$cfg" || lost+=("$line (final: $(grep -E "^(# )?${line%%=*}[= ]" "$cfg" || echo absent))") ;;
            "# CONFIG_"*" is not set")
                sym="${line#\# }"; sym="${sym%% *}"
                if grep -qE "^$sym=[ym]$" "$cfg"; then lost+=("$line (final: enabled)"); fi ;;
        esac
    done <"$fragment"
    if [ ${#lost[@]} -gt 0 ]; then
        echo "kernel/build.sh: FAIL: these fragment options did not survive into $cfg (a dependency is off or the symbol does not exist in this kernel):" >&2
        printf '  %s\n' "${lost[@]}" >&2
        return 1
    fi
    echo "kernel/build.sh: every option of $fragment is in $cfg"
}

src="" base="" out="out/kernel" jobs="$(nproc)" verify_only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --source) src="${2:?--source needs a directory}"; shift 2 ;;
        --base-config) base="${2:?--base-config needs a file}"; shift 2 ;;
        --out) out="${2:?--out needs a directory}"; shift 2 ;;
        --jobs) jobs="${2:?--jobs needs a number}"; shift 2 ;;
        --verify) verify_only="${2:?--verify needs a .config}"; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
if [ -n "$verify_only" ]; then
    [ -f "$verify_only" ] || die "$verify_only not found"
    verify "$verify_only"
    exit
fi
[ -n "$src" ] || die "--source DIR (a kernel source tree) is required; Debian: apt-get install linux-source, then unpack /usr/src/linux-source-*.tar.xz"
if ! [ -f "$src/Makefile" ] || ! [ -f "$src/scripts/kconfig/merge_config.sh" ]; then
    die "$src is not a kernel source tree (no Makefile or scripts/kconfig/merge_config.sh)"
fi
for t in make:make gcc:gcc flex:flex bison:bison bc:bc perl:perl; do
    command -v "${t%%:*}" >/dev/null || die "needs ${t%%:*} (Debian package: ${t#*:}; all of them: build-essential flex bison bc libelf-dev libssl-dev)"
done
[ -e /usr/include/libelf.h ] || die "needs libelf headers (Debian package: libelf-dev)"
[ -e /usr/include/openssl/ssl.h ] || die "needs OpenSSL headers (Debian package: libssl-dev)"

src="$(cd "$src" && pwd)"
mkdir -p "$out/build"
out="$(cd "$out" && pwd)"
build="$out/build"
mk() { make -C "$src" O="$build" "$@"; }

if [ -n "$base" ]; then
    [ -f "$base" ] || die "base config $base not found"
    cp "$base" "$build/base.config"
else
    mk defconfig >/dev/null
    cp "$build/.config" "$build/base.config"
fi
(cd "$src" && sh scripts/kconfig/merge_config.sh -m -O "$build" "$build/base.config" "$fragment")
# Distribution configs name signing keys from their own build trees (Debian: debian/certs/...),
# and BTF needs pahole; neither matters for a Firecracker vmlinux.
"$src/scripts/config" --file "$build/.config" \
    --set-str SYSTEM_TRUSTED_KEYS "" --set-str SYSTEM_REVOCATION_KEYS "" \
    --disable DEBUG_INFO_BTF
mk olddefconfig >/dev/null
verify "$build/.config"

mk -j"$jobs" vmlinux
verify "$build/.config"
cp "$build/vmlinux" "$out/vmlinux"
cp "$build/.config" "$out/config"
echo "kernel/build.sh: wrote $out/vmlinux ($(stat -c %s "$out/vmlinux") bytes) and $out/config"
