#!/usr/bin/env bash
# The held-out splits stay out of the training chunks: a download that brought the repo's test/ (and a
# validation/ with VALID_SUBDIR empty), as HF_INCLUDE='**' does, was extracted and concat-plan.sbatch
# put everything but VALID_SUBDIR into the chunks: the test documents were trained on. No Slurm needed.
# Usage: heldout_splits_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
BIN=$1
SRC=$2
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
run_stages() {  # STAGE_PATH, then VAR=value settings
  local stage=$1 s out
  shift
  for s in extract concat-plan concat; do
    out=$(env "$@" PTK_BIN="$BIN" STAGE_PATH="$stage" CONCAT_CHUNKS=1 CPUS_PER_TASK=1 bash "$SRC/slurm/$s.sbatch" 2>&1) ||
      fail "$s.sbatch: $out"
    echo "$out"
  done
}
for valid in validation ""; do
  S=$W/stage${valid:+_v}
  D=$S/slimpajama
  mkdir -p "$D/raw/train/chunk1" "$D/raw/test/chunk1" "$D/raw/validation/chunk1"
  printf '{"text": "a training document"}\n' | gzip > "$D/raw/train/chunk1/t0.jsonl.gz"
  printf '{"text": "a TEST document"}\n' | gzip > "$D/raw/test/chunk1/x0.jsonl.gz"
  printf '{"text": "a VALIDATION document"}\n' | gzip > "$D/raw/validation/chunk1/v0.jsonl.gz"
  out=$(run_stages "$S" HF_INCLUDE= VALID_SUBDIR="$valid")
  echo "$out" | grep -q "without the held-out .*test/" || fail "VALID_SUBDIR=$valid: test/ not said to be held out: $out"
  chunks=$(cat "$D"/chunks/train_*.jsonl)
  [[ $chunks == *"a training document"* ]] || fail "VALID_SUBDIR=$valid: the training document is not in the chunks"
  [[ $chunks != *"TEST"* ]] || fail "VALID_SUBDIR=$valid: the test split went into the training chunks"
  [[ $chunks != *"VALIDATION"* ]] || fail "VALID_SUBDIR=$valid: the validation split went into the training chunks"
done
# HELDOUT_SUBDIRS names the held-out folders: emptied, test/ is training data as the user asked.
S=$W/stage_all
D=$S/slimpajama
mkdir -p "$D/raw/train" "$D/raw/test"
printf '{"text": "a training document"}\n' | gzip > "$D/raw/train/t0.jsonl.gz"
printf '{"text": "a TEST document"}\n' | gzip > "$D/raw/test/x0.jsonl.gz"
run_stages "$S" HELDOUT_SUBDIRS= >/dev/null
[[ $(cat "$D"/chunks/train_*.jsonl) == *"TEST"* ]] || fail "HELDOUT_SUBDIRS= still left test/ out"
# A word of HELDOUT_SUBDIRS is a name, never a pattern: run where 'te*' would glob to test/, it holds out nothing.
rm -rf "$D/extracted" "$D/chunks"
(cd "$D/raw" && run_stages "$S" HELDOUT_SUBDIRS='te*' >/dev/null)
[[ $(cat "$D"/chunks/train_*.jsonl) == *"TEST"* ]] || fail "HELDOUT_SUBDIRS='te*' was globbed into test"
# DROP_SETS: each word a --drop-set of extract.sbatch (the k8s extract pod runs it too), never globbed.
S=$W/stage_drop
D=$S/slimpajama
mkdir -p "$D/raw/train" "$D/raw/RedPajamaBookX"
printf '%s\n' '{"text": "a BOOK", "meta": {"redpajama_set_name": "RedPajamaBook"}}' \
  '{"text": "a C4 page", "meta": {"redpajama_set_name": "RedPajamaC4"}}' | gzip > "$D/raw/train/t0.jsonl.gz"
out=$(cd "$D/raw" && run_stages "$S" DROP_SETS='RedPajamaBook RedPajamaB*' 2>&1)
chunks=$(cat "$D"/chunks/train_*.jsonl)
[[ $chunks == *"a C4 page"* && $chunks != *"BOOK"* ]] || fail "DROP_SETS=RedPajamaBook did not drop the book: $chunks"
[[ $out == *"--drop-set RedPajamaB*: no record of this set"* ]] || fail "DROP_SETS' RedPajamaB* was globbed: $out"
# Nothing but held-out splits: a clear refusal naming them.
S=$W/stage_none
mkdir -p "$S/slimpajama/raw/test"
printf '{"text": "a TEST document"}\n' | gzip > "$S/slimpajama/raw/test/x0.jsonl.gz"
PTK_BIN=$BIN STAGE_PATH=$S bash "$SRC/slurm/extract.sbatch" >/dev/null 2>&1 || fail "extract"
set +e
out=$(PTK_BIN=$BIN STAGE_PATH=$S bash "$SRC/slurm/concat-plan.sbatch" 2>&1)
rc=$?
set -e
[ "$rc" = 1 ] && [[ $out == *"nothing extracted in "*"besides the held-out splits test/"* ]] || fail "rc $rc: $out"
echo "heldout_splits_test: OK"
