#!/usr/bin/env bash
# README's main job (scripts/run-main-job.sh) with the binaries of this build: it completes, verifies
# five datasets, prints sample 0 and where the outputs are; a rerun redoes no verified work and
# writes the same datasets.
# Usage: main_job_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
BIN=$1
SRC=$2
WORK=$(mktemp -d /tmp/ptk-main-job-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
run() { PTK_SKIP_INSTALL=1 PTK_SKIP_BUILD=1 PTK_BIN=$BIN PTK_JOBS=2 bash "$SRC/scripts/run-main-job.sh" "$WORK/out" > "$1" 2>&1 || { tail -40 "$1"; fail "the main job failed"; }; }

run "$WORK/log1"
[ "$(grep -c '^OK: .*index and data consistent' "$WORK/log1")" = 5 ] || { cat "$WORK/log1"; fail "expected five verified datasets"; }
grep -q "34 downloaded (.*), 0 already present, 0 failed" "$WORK/log1" || fail "download summary missing"
grep -q '^sample 0 (dataset ' "$WORK/log1" || fail "GPTDataset sample 0 not shown"
grep -q 'preprocessed/validation_text_document' "$WORK/log1" || fail "output locations not printed"
sha256sum "$WORK"/out/preprocessed/*.bin "$WORK"/out/preprocessed/*.idx > "$WORK/sums1"

run "$WORK/log2"
grep -q '0 to download' "$WORK/log2" || fail "the rerun downloaded again"
grep -q ' 0 extracted, 32 already complete' "$WORK/log2" || fail "the rerun extracted again"
grep -q '0 chunks built, 4 already complete' "$WORK/log2" || fail "the rerun rebuilt chunks"
sha256sum -c --quiet "$WORK/sums1" || fail "the rerun wrote different datasets"
echo "main job: OK"
