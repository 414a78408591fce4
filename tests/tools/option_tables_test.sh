#!/usr/bin/env bash
# Every tool's option table passes CheckOptionTable (long names, help text, no flag defined twice),
# every tool answers --help and --version with exit 0, and a one-dash long flag with the flag meant.
# Usage: option_tables_test.sh BIN_DIR
set -uo pipefail
BIN=$1
fail=0
for tool in ptk-download ptk-extract ptk-concat ptk-tokenize ptk-inspect ptk-merge ptk-train ptk-convert; do
  [ -x "$BIN/$tool" ] || { echo "FAIL: $tool not built"; fail=1; continue; }
  PTK_CHECK_OPTIONS=1 "$BIN/$tool" || { echo "FAIL: $tool's option table"; fail=1; }
  "$BIN/$tool" --help >/dev/null || { echo "FAIL: $tool --help"; fail=1; }
  # Issue 29: --version, and a long flag written with one dash names the flag meant (common/cli).
  v=$("$BIN/$tool" --version) && [[ $v == "$tool (ptk "* ]] || { echo "FAIL: $tool --version: $v"; fail=1; }
  out=$("$BIN/$tool" -version 2>&1); rc=$?
  [ "$rc" = 2 ] && [[ $out == *"unknown flag -version; did you mean --version?"* ]] ||
    { echo "FAIL: $tool -version (rc $rc): $out"; fail=1; }
done
[ "$fail" = 0 ] && echo "option tables: OK"
exit "$fail"
