#!/usr/bin/env bash
# Lists every SKIPPED line of a run (the output given, and the IMP_SKIP_LOG file where
# imp_testkit::skip records the lines cargo test hides) and fails on each one that a requirement of
# this environment forbids: a line naming an IMP_REQUIRE_* variable that is set to 1, or naming none
# (a skip that nothing can turn into a failure).
#   .ci/skips.sh OUTPUT...
set -euo pipefail
files=("$@")
[[ -n "${IMP_SKIP_LOG:-}" && -f "$IMP_SKIP_LOG" ]] && files+=("$IMP_SKIP_LOG")
((${#files[@]})) || { echo "usage: .ci/skips.sh OUTPUT..." >&2; exit 2; }
bad=0 n=0
# The same skip can reach both files: each distinct line once.
while IFS= read -r line; do
  n=$((n + 1))
  var=$(grep -oE 'IMP_REQUIRE_[A-Z_]+' <<<"$line" | head -1 || true)
  if [[ -z "$var" ]]; then
    echo "skips: FAIL (no IMP_REQUIRE_* variable) $line"; bad=1
  elif [[ "${!var:-}" == 1 ]]; then
    echo "skips: FAIL ($var=1) $line"; bad=1
  else
    echo "skips: allowed ($var unset) $line"
  fi
done < <(grep -hoE 'SKIPPED.*' "${files[@]}" | sort -u)
echo "skips: $n distinct SKIPPED line(s)$( ((bad)) && echo ', some of them for required components' )"
exit "$bad"
