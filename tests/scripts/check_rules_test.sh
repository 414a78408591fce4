#!/usr/bin/env bash
# scripts/check-rules.sh on a small tree of its own: a clean tree passes; each planted violation (a
# file over 600 lines, a flag's error in library code, a header nobody includes) is named with its
# file and line and fails the check; what the rules allow (tools/, the allowlists) passes.
# Usage: check_rules_test.sh SOURCE_DIR
set -euo pipefail
SRC=$1
CHECK=$SRC/scripts/check-rules.sh
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

tree() {  # a clean tree in $W/$1
  local r=$W/$1 d
  for d in common tokenizer indexed_dataset tensorboard dataprep trainer interop tools tests; do mkdir -p "$r/$d"; done
  printf '// Used.\n#pragma once\nint Used();\n' >"$r/common/used.h"
  printf '// Uses used.h.\n#include "common/used.h"\nint Used() { return 1; }\n' >"$r/common/used.cpp"
  # tools/ may word an error as a flag; an allowlisted file may be long.
  printf 'absl::Status Check() { return absl::InvalidArgumentError("--chunks must be >= 1"); }\n' \
    >"$r/tools/x_main.cpp"
  seq 700 | sed 's#^#// #' >"$r/trainer/training.cpp"
  echo "$r"
}
run() {  # run ROOT: the check's output in $out, its status in $rc
  set +e
  out=$(bash "$CHECK" "$1" 2>&1)
  rc=$?
  set -e
}

r=$(tree clean)
run "$r"
[ "$rc" = 0 ] || fail "a clean tree: exit $rc: $out"
echo "$out" | grep -qx "check-rules: OK" || fail "a clean tree: $out"

r=$(tree long)
seq 601 | sed 's#^#// #' >"$r/dataprep/long.cpp"
seq 600 | sed 's#^#// #' >"$r/dataprep/just_fits.cpp"
run "$r"
[ "$rc" = 1 ] || fail "a file of 601 lines: exit $rc: $out"
echo "$out" | grep -q "^dataprep/long.cpp:601: 601 lines, over 600" || fail "a file of 601 lines: $out"
echo "$out" | grep -q "^dataprep/just_fits" && fail "a file of 600 lines was refused: $out"

r=$(tree flag)
printf '%s\n' '// A library.' '' 'absl::Status F(int n) {' \
  '  if (n < 1) return absl::InvalidArgumentError("--n must be >= 1");' \
  '  if (n > 9) return absl::InvalidArgumentError(fmt::format("--n {} is over 9", n));' \
  '  return absl::UsageError("--n is fine here: a usage error");' '}' >"$r/interop/flag.cpp"
run "$r"
[ "$rc" = 1 ] || fail "a flag's error in a library: exit $rc: $out"
echo "$out" | grep -q '^interop/flag.cpp:4: InvalidArgumentError("--...") in library code' ||
  fail "a flag's error in a library: $out"
echo "$out" | grep -q '^interop/flag.cpp:5: InvalidArgumentError' || fail "fmt::format(\"--: $out"
echo "$out" | grep -q '^interop/flag.cpp:6:' && fail "a UsageError was refused: $out"
echo "$out" | grep -q "^tools/" && fail "tools/ was refused: $out"

r=$(tree header)
printf '// Nobody includes me.\n#pragma once\n' >"$r/trainer/orphan.h"
printf '// Only a test includes me.\n#pragma once\n' >"$r/tokenizer/tested.h"
printf '#include "tokenizer/tested.h"\n' >"$r/tests/tested_test.cpp"
run "$r"
[ "$rc" = 1 ] || fail "a header nobody includes: exit $rc: $out"
echo "$out" | grep -q "^trainer/orphan.h:1: no file includes this header" || fail "a header nobody includes: $out"
echo "$out" | grep -q "^tokenizer/tested.h" && fail "a header a test includes was refused: $out"
n=$(echo "$out" | grep -cE '^[^ ]+:[0-9]+: ' || true)
[ "$n" = 1 ] || fail "one violation planted, $n reported: $out"
echo "check_rules_test: OK"
