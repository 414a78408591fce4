#!/usr/bin/env bash
# Which stages and tasks of the ptk pipeline are complete, judged from the outputs themselves
# (verified downloads, extraction sidecars, chunk sidecars, verified datasets), plus the state of
# the jobs last submitted (from $STAGE_PATH/results/jobs.txt, via squeue/scontrol; no accounting).
# Usage: STAGE_PATH=... slurm/status.sh      Exit 0 when every stage is complete.
set -uo pipefail
PTK_SLURM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -n "${STAGE_PATH:-}" ] || { echo "status: STAGE_PATH is not set" >&2; exit 2; }
source "$PTK_SLURM_DIR/config.sh"

complete=1
line() { printf '%-12s %s\n' "$1" "$2"; }

# download: verified files recorded in the done logs vs the listing
manifest=$(ls "$RAW_DIR"/.ptk-download/manifest-*.jsonl 2>/dev/null | head -1)
if [ -n "$manifest" ]; then
  done_n=$(cat "$RAW_DIR"/.ptk-download/done-*.tsv 2>/dev/null | cut -f1 | sort -u | wc -l)
  parts=$(find "$RAW_DIR" -name '*.part' 2>/dev/null | wc -l)
  line download "$done_n verified files recorded ($(wc -l < "$manifest") in the repo listing), $parts partial"
  [ "$parts" -eq 0 ] && [ "$done_n" -gt 0 ] || complete=0
else
  line download "not started"; complete=0
fi
# extract: inputs vs outputs with a sidecar
n_in=$(find "$RAW_DIR" -type f \( -name '*.zst' -o -name '*.xz' \) 2>/dev/null | wc -l)
n_out=$(find "$EXTRACT_DIR" -type f -name '*.ptk-done' 2>/dev/null | wc -l)
line extract "$n_out of $n_in files extracted"
[ "$n_in" -gt 0 ] && [ "$n_out" -ge "$n_in" ] || complete=0
# concat: the plan's chunks with a sidecar; any other chunk in CHUNK_DIR is an error (not this plan's data)
plan_chunks=()
if [ -f "$PLAN_FILE" ]; then
  mapfile -t plan_chunks < <("$PTK_BIN/ptk-concat" list --plan "$PLAN_FILE" 2>/dev/null)
  n_chunks=0
  for c in "${plan_chunks[@]}"; do [ -f "$c.ptk-done" ] && n_chunks=$((n_chunks + 1)); done
  extra=$(comm -13 <(printf '%s\n' "${plan_chunks[@]}" | LC_ALL=C sort) \
                   <(find "$CHUNK_DIR" -maxdepth 1 -name '*.jsonl' -type f 2>/dev/null | LC_ALL=C sort))
  line concat "$n_chunks of ${#plan_chunks[@]} chunks built"
  [ "$n_chunks" -ge "${#plan_chunks[@]}" ] || complete=0
  if [ -n "$extra" ]; then
    line "" "error: $(echo "$extra" | wc -l) chunk files not in the plan (an earlier plan's?): $(echo "$extra" | head -3 | tr '\n' ' ')"
    line "" "  rerun 'ptk-concat plan' (it removes them) or delete them"
    complete=0
  fi
else
  line concat "no plan yet"; complete=0
fi
# tokenize: the plan's chunks vs verified datasets; a dataset of no plan chunk is an error
n_ok=0; n_want=0; missing=()
for chunk in "${plan_chunks[@]}"; do
  n_want=$((n_want + 1))
  name=$(basename "$chunk" .jsonl)
  # Complete = verified (checksums included) and made from this very chunk (its stamp is the chunk's sidecar).
  if [ -f "$PREPROCESSED_DIR/$name.ptk-tokenized" ] && [ -f "$chunk.ptk-done" ] &&
     [ "$(cat "$PREPROCESSED_DIR/$name.ptk-tokenized")" = "$(cat "$chunk.ptk-done")" ] &&
     "$PTK_BIN/ptk-inspect" "$PREPROCESSED_DIR/${name}_text_document" --verify >/dev/null 2>&1; then
    n_ok=$((n_ok + 1))
  else
    missing+=("$name")
  fi
done
line tokenize "$n_ok of $n_want datasets complete${missing:+ (missing: ${missing[*]:0:8})}"
[ "$n_want" -gt 0 ] && [ "$n_ok" -eq "$n_want" ] || complete=0
stray=$(comm -13 <(for c in "${plan_chunks[@]}"; do echo "$PREPROCESSED_DIR/$(basename "$c" .jsonl)_text_document.idx"; done | LC_ALL=C sort) \
                 <(find "$PREPROCESSED_DIR" -maxdepth 1 -name '*_text_document.idx' -type f 2>/dev/null | LC_ALL=C sort))
if [ -n "$stray" ]; then
  line "" "error: $(echo "$stray" | wc -l) datasets of no chunk in the plan (training ignores them): $(echo "$stray" | head -3 | xargs -r -n1 basename | tr '\n' ' ')"
  complete=0
fi
# train: the checkpoint tracker vs TRAIN_ITERS
latest=$(cat "$CKPT_DIR/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
line train "checkpoint at iteration $latest of $TRAIN_ITERS (in $CKPT_DIR)"
[ "$latest" -ge "$TRAIN_ITERS" ] 2>/dev/null || complete=0

# jobs of the last submission
if [ -f "$RESULTS_DIR/jobs.txt" ] && command -v scontrol >/dev/null; then
  echo "jobs (last submission):"
  while read -r stage id; do
    states=$(scontrol show job -o "$id" 2>/dev/null | sed -n 's/.*JobId=\([0-9_]*\) .*ArrayTaskId=\([^ ]*\) .*JobState=\([A-Z_]*\) Reason=\([^ ]*\) .*ExitCode=\([0-9:]*\).*/\2:\3(\4,exit \5)/p; s/.*JobId=\([0-9]*\) .*JobState=\([A-Z_]*\) Reason=\([^ ]*\) .*ExitCode=\([0-9:]*\).*/\2(\3,exit \4)/p' | sort -u | tr '\n' ' ')
    printf '  %-12s %-8s %s\n' "$stage" "$id" "${states:-finished (no longer known to slurmctld)}"
    if [[ "$states" =~ (FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) ]]; then
      echo "  -> $stage job $id has failed or cancelled tasks; logs in $RESULTS_DIR/$stage/; resubmit with slurm/submit-pipeline.sh --from $stage"
      complete=0
    fi
  done < "$RESULTS_DIR/jobs.txt"
fi
if [ "$complete" = 1 ]; then echo "status: every stage is complete; datasets in $PREPROCESSED_DIR, checkpoints in $CKPT_DIR"; exit 0; fi
exit 1
