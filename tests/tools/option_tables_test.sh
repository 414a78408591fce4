#!/usr/bin/env bash
# Every tool's option table passes CheckOptionTable (long names, help text, no flag defined twice),
# and every tool answers --help with exit 0.
# Usage: option_tables_test.sh BIN_DIR
set -uo pipefail
BIN=$1
fail=0
for tool in ptk-download ptk-extract ptk-concat ptk-tokenize ptk-inspect ptk-merge ptk-train; do
  [ -x "$BIN/$tool" ] || { echo "FAIL: $tool not built"; fail=1; continue; }
  PTK_CHECK_OPTIONS=1 "$BIN/$tool" || { echo "FAIL: $tool's option table"; fail=1; }
  "$BIN/$tool" --help >/dev/null || { echo "FAIL: $tool --help"; fail=1; }
done
[ "$fail" = 0 ] && echo "option tables: OK"
exit "$fail"
