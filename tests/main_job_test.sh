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
# Sample 0's text is whole characters (no U+FFFD from a cut character).
sed -n '/^sample 0 (dataset /,/ptk-train: GPT/p' "$WORK/log1" | LC_ALL=C grep -q $'\xEF\xBF\xBD' && fail "sample 0 shows U+FFFD"
sed -n '/^sample 0 (dataset /,/ptk-train: GPT/p' "$WORK/log1" | iconv -f UTF-8 -t UTF-8 >/dev/null || fail "sample 0 is not UTF-8"
grep -q 'preprocessed/validation_text_document' "$WORK/log1" || fail "output locations not printed"
grep -q 'exiting program at iteration 25' "$WORK/log1" || fail "the first training run did not stop at 25"
grep -q 'loaded checkpoint .*iter_0000025' "$WORK/log1" || fail "the second training run did not resume"
grep -q 'iteration       50/      50' "$WORK/log1" || fail "training did not reach iteration 50"
first=$(grep -o 'iteration        5/.*lm loss: [0-9.E+-]*' "$WORK/log1" | sed 's/.*lm loss: //')
last=$(grep -o 'iteration       50/.*lm loss: [0-9.E+-]*' "$WORK/log1" | sed 's/.*lm loss: //')
awk -v a="$first" -v b="$last" 'BEGIN{exit !(b < a - 1.0)}' || fail "the loss did not fall ($first -> $last)"
[ -s "$WORK/out/train/loss.png" ] || fail "no loss curve"
# An event file per ptk-train run, samples at 25 and 50, the model exported for transformers.
[ "$(ls "$WORK"/out/train/tensorboard/events.out.tfevents.* | wc -l)" = 2 ] || fail "expected two event files"
grep -q ' sample at iteration       25 (greedy): "The history of" -> "' "$WORK/log1" || fail "no sample at 25"
grep -q ' sample at iteration       50 (greedy): "The history of" -> "' "$WORK/log1" || fail "no sample at 50"
for f in model.safetensors config.json vocab.json merges.txt; do
  [ -s "$WORK/out/train/hf/$f" ] || fail "the Hugging Face export has no $f"
done
[ "$(cat "$WORK/out/train/checkpoints/latest_checkpointed_iteration.txt")" = 50 ] || fail "latest is not 50"
sha256sum "$WORK"/out/preprocessed/*.bin "$WORK"/out/preprocessed/*.idx > "$WORK/sums1"
stat -c '%n %i %Y' "$WORK"/out/preprocessed/* > "$WORK/stat1"

run "$WORK/log2"
grep -q '0 to download' "$WORK/log2" || fail "the rerun downloaded again"
grep -q ' 0 extracted, 32 already complete' "$WORK/log2" || fail "the rerun extracted again"
grep -q '0 chunks built, 4 already complete' "$WORK/log2" || fail "the rerun rebuilt chunks"
sha256sum -c --quiet "$WORK/sums1" || fail "the rerun wrote different datasets"
# The rerun tokenizes nothing (same files: inodes and mtimes) and says so;
# training says it is complete, without announcing runs that do not happen.
[ "$(grep -c '_text_document: up to date, not rewritten' "$WORK/log2")" = 5 ] || fail "the rerun tokenized again"
stat -c '%n %i %Y' "$WORK"/out/preprocessed/* | diff "$WORK/stat1" - || fail "the rerun rewrote datasets"
grep -q 'holds a finished run (iteration 50)' "$WORK/log2" || fail "the rerun does not say training is complete"
grep -q 'first run: stops at iteration 25' "$WORK/log2" && fail "the rerun announces a first run"
grep -q 'nothing to train: the checkpoint in .* is at iteration 50 (.* samples consumed)' "$WORK/log2" ||
  fail "the rerun trained again"
grep -q 'done: nothing to train' "$WORK/log2" || fail "no 'nothing to train' summary"
grep -q 'last lm loss 0.000000' "$WORK/log2" && fail "the rerun reports a loss it did not compute"
grep -A1 'its last sample' "$WORK/log2" | grep -q ' sample at iteration       50' || fail "the rerun shows no sample"
# As Megatron's, the rerun evaluates at the end (iteration 50 on the validation set) and writes its scalars.
grep -q 'validation loss at iteration 50 on validation set' "$WORK/log2" || fail "the rerun did not evaluate at the end"
[ "$(ls "$WORK"/out/train/tensorboard/events.out.tfevents.* | wc -l)" = 3 ] || fail "the rerun wrote no events"
echo "main job: OK"
