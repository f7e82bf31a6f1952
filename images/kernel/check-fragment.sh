#!/usr/bin/env bash
# Cheap check of images/kernel/imp.config against an installed distribution kernel's config
# (no kernel build): every CONFIG_ the fragment sets must be a real symbol, i.e. =y or =m in
# that config, unless the fragment documents why not with "# check-fragment: CONFIG_X: reason".
# Catches typos and symbols renamed or dropped upstream.
#
# Usage: images/kernel/check-fragment.sh [--config /boot/config-<version>] [--fragment FILE]
#   --config    default: the newest /boot/config-* (Debian: linux-image-cloud-amd64)
#   --fragment  default: imp.config beside this script
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
die() { echo "check-fragment: $*" >&2; exit 1; }

config="" fragment="$here/imp.config"
while [ $# -gt 0 ]; do
    case "$1" in
        --config) config="${2:?--config needs a file}"; shift 2 ;;
        --fragment) fragment="${2:?--fragment needs a file}"; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
if [ -z "$config" ]; then
    config="$(find /boot -maxdepth 1 -name 'config-*' 2>/dev/null | sort -V | tail -n1)"
    [ -n "$config" ] || die "no /boot/config-* to check against; install a kernel (Debian: linux-image-cloud-amd64) or pass --config"
fi
[ -f "$config" ] || die "kernel config $config not found"
[ -f "$fragment" ] || die "fragment $fragment not found"

declare -A value documented
while IFS= read -r line; do
    case "$line" in
        CONFIG_*=*) value[${line%%=*}]="${line#*=}" ;;
        "# CONFIG_"*" is not set") sym="${line#\# }"; value[${sym%% *}]=n ;;
    esac
done <"$config"
while IFS= read -r line; do
    rest="${line#\# check-fragment: }"
    [ "$rest" != "$line" ] || continue
    documented[${rest%%:*}]="${rest#*: }"
done <"$fragment"

checked=0 failed=()
while IFS= read -r line; do
    case "$line" in
        CONFIG_*=*) ;;
        *) continue ;;
    esac
    sym="${line%%=*}" want="${line#*=}"
    checked=$((checked + 1))
    have="${value[$sym]:-absent}"
    case "$want:$have" in
        y:y | y:m | m:y | m:m) continue ;;
        [!ym]*:absent | y:absent | m:absent | *:n) ;;
        *) continue ;; # a string/number option: the symbol exists
    esac
    shown="$have"
    [ "$have" != n ] || shown="not set"
    if [ -n "${documented[$sym]:-}" ]; then
        echo "check-fragment: $sym is $shown in $config; documented: ${documented[$sym]}"
    else
        failed+=("$sym (fragment: $want, $config: $shown)")
    fi
done <"$fragment"

if [ ${#failed[@]} -gt 0 ]; then
    echo "check-fragment: FAIL: these fragment options are not =y/=m in $config and the fragment does not say why:" >&2
    printf '  %s\n' "${failed[@]}" >&2
    echo "Fix the symbol name, or add '# check-fragment: CONFIG_X: reason' to $fragment." >&2
    exit 1
fi
echo "check-fragment: OK: $checked options of $fragment checked against $config"
