#!/usr/bin/env bash
# Which stages and tasks of the ptk pipeline are complete, judged from the outputs themselves
# (verified downloads, extraction sidecars, chunk sidecars, verified datasets), plus the state of
# the jobs last submitted (from $STAGE_PATH/results/jobs.txt, via squeue/scontrol; no accounting).
# Usage: STAGE_PATH=... slurm/status.sh      Exit 0 when every stage is complete (no arguments).
set -uo pipefail
case "${1:-}" in
  "") ;;
  -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
  *) echo "status: unknown argument: $1 (status.sh takes none; settings are environment variables, see --help)" >&2
     exit 2 ;;
esac
PTK_SLURM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -n "${STAGE_PATH:-}" ] || { echo "status: STAGE_PATH is not set" >&2; exit 2; }
# What the last submission ran with (submit-pipeline.sh records it beside the job ids), over this
# shell's variables: TRAIN_ITERS=10 at submit time is the goal, whatever this shell says.
submitted="$STAGE_PATH/results/submitted-settings.sh"
if [ -f "$submitted" ]; then
  # shellcheck source=/dev/null
  source "$submitted"
fi
source "$PTK_SLURM_DIR/config.sh"
[ -f "$submitted" ] && echo "settings: as submitted ($submitted, $(date -r "$submitted" '+%F %T'))"

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
# extract: inputs vs outputs whose sidecar matches the input as it is now (size and mtime): an
# output of an input that changed since (a re-download, a corrupted file) is stale, not extracted.
# Each input's output is where extract.sbatch puts it (EXTRACT_DIR/REL without .zst/.xz/.gz); names go
# NUL-separated and the sidecars are read by bash itself, so a name with a quote, a tab or a newline
# counts once (a sidecar's "source" is JSON-escaped: it is not compared). A sidecar whose input is gone
# (--delete-input) counts as extracted.
n_in=0; n_out=0; n_stale=0; n_matched=0
while IFS= read -r -d '' rel && IFS= read -r -d '' size && IFS= read -r -d '' mtime; do
  n_in=$((n_in + 1))
  side="$EXTRACT_DIR/${rel%.*}.ptk-done"
  [ -f "$side" ] || continue
  n_matched=$((n_matched + 1))
  body=""
  IFS= read -r -d '' body < "$side" || true
  [[ $mtime == *.* ]] || mtime="$mtime.0"
  frac="${mtime#*.}000000000"
  if [[ $body =~ \"source_size\":\ ([0-9]+) ]] && [ "${BASH_REMATCH[1]}" = "$size" ] &&
     [[ $body =~ \"source_mtime_ns\":\ ([0-9]+) ]] && [ "${BASH_REMATCH[1]}" = "${mtime%%.*}${frac:0:9}" ]; then
    n_out=$((n_out + 1))
  else
    n_stale=$((n_stale + 1))
  fi
done < <(find "$RAW_DIR/" -type f \( -name '*.zst' -o -name '*.xz' -o -name '*.gz' \) -printf '%P\0%s\0%T@\0' 2>/dev/null)
n_side=$(find "$EXTRACT_DIR" -type f -name '*.ptk-done' -printf '.' 2>/dev/null | wc -c)
n_out=$((n_out + n_side - n_matched))
line extract "$n_out of $n_in files extracted${n_stale:+$([ "$n_stale" -gt 0 ] && echo ", $n_stale stale (the input changed since)")}"
[ "$n_in" -gt 0 ] && [ "$n_out" -ge "$n_in" ] && [ "${n_stale:-0}" -eq 0 ] || complete=0
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
# tokenize: the plan's chunks (and the validation split) vs verified datasets; a dataset of no plan
# chunk is an error
items=("${plan_chunks[@]}")
ptk_has_valid && items+=("$VALID_DIR")
n_ok=0; n_want=0; missing=(); redo=()
for chunk in "${items[@]}"; do
  n_want=$((n_want + 1))
  name=$(basename "$chunk" .jsonl)
  # Complete = verified (checksums included) and made from these very inputs (its stamp: the chunk's
  # sidecar, or the digest of the validation files' sidecars).
  if [ -f "$PREPROCESSED_DIR/$name.ptk-tokenized" ] && { [ -d "$chunk" ] || [ -f "$chunk.ptk-done" ]; } &&
     [ "$(cat "$PREPROCESSED_DIR/$name.ptk-tokenized")" = "$(ptk_source_id "$chunk")" ] &&
     "$PTK_BIN/ptk-inspect" "$PREPROCESSED_DIR/${name}_text_document" --verify >/dev/null 2>&1; then
    n_ok=$((n_ok + 1))
  elif [ -f "$PREPROCESSED_DIR/${name}_text_document.idx" ]; then
    redo+=("$name")  # there, but not this chunk's (made before it changed, or outside the pipeline) or damaged
  else
    missing+=("$name")
  fi
done
# A dataset that is there was listed as "missing" too: say which are absent and which are to be made again.
line tokenize "$n_ok of $n_want datasets complete$(ptk_has_valid && echo " (incl. $VALID_SUBDIR)")${missing:+ (missing: ${missing[*]:0:8})}${redo:+ (there but not made from the current chunks, or damaged; tokenize redoes them: ${redo[*]:0:8})}"
[ "$n_want" -gt 0 ] && [ "$n_ok" -eq "$n_want" ] || complete=0
stray=$(comm -13 <(for c in "${items[@]}"; do echo "$PREPROCESSED_DIR/$(basename "$c" .jsonl)_text_document.idx"; done | LC_ALL=C sort) \
                 <(find "$PREPROCESSED_DIR" -maxdepth 1 -name '*_text_document.idx' -type f 2>/dev/null | LC_ALL=C sort))
if [ -n "$stray" ]; then
  line "" "error: $(echo "$stray" | wc -l) datasets of no chunk in the plan (training ignores them): $(echo "$stray" | head -3 | sed 's|.*/||' | tr '\n' ' ')"
  complete=0
fi
# train: the checkpoint tracker vs TRAIN_ITERS
if latest=$(cat "$CKPT_DIR/latest_checkpointed_iteration.txt" 2>/dev/null) && [ -n "$latest" ]; then
  line train "checkpoint at iteration $latest of $TRAIN_ITERS (in $CKPT_DIR)"
  [ "$latest" -ge "$TRAIN_ITERS" ] 2>/dev/null || complete=0
else
  line train "no checkpoint yet (training to iteration $TRAIN_ITERS; checkpoints in $CKPT_DIR)"
  complete=0
fi

# jobs of the last submission: per stage, its tasks done / running / pending / failed / cancelled;
# failed tasks with their log files; one resubmit command, for the first stage that failed (its
# dependents were cancelled because of it and need nothing of their own).
if [ -f "$RESULTS_DIR/jobs.txt" ] && command -v scontrol >/dev/null; then
  echo "jobs (last submission, $(date -r "$RESULTS_DIR/jobs.txt" '+%F %T')):"
  root=""
  err=$(mktemp)
  trap 'rm -f "$err"' EXIT
  while read -r stage id; do
    if ! recs=$(scontrol show job -o "$id" 2>"$err"); then
      # slurmctld's answer for a job it no longer knows; any other failure is no answer at all (a
      # controller that is down costs each call its MessageTimeout of retries: asked once, not per job).
      if ! grep -q "Invalid job id" "$err"; then
        msg=$(head -n 1 "$err")
        echo "  no job states: the Slurm controller does not answer (scontrol: ${msg:-failed without a message});" \
             "the stages above are judged from their outputs"
        break
      fi
      recs=""
    fi
    if [ -z "$recs" ]; then
      printf '  %-12s job %-8s finished (no longer known to slurmctld)\n' "$stage" "$id"
      continue
    fi
    # "TASK STATE REASON EXIT" per record; a pending array range (3-71%8) counts as its tasks.
    table=$(echo "$recs" | awk '{
      task = ""; state = ""; reason = ""; code = ""; jid = ""; ajid = ""
      for (i = 1; i <= NF; i++) {
        if ($i ~ /^JobId=/) jid = substr($i, 7)
        else if ($i ~ /^ArrayJobId=/) ajid = substr($i, 12)
        else if ($i ~ /^ArrayTaskId=/) task = substr($i, 13)
        else if ($i ~ /^JobState=/) state = substr($i, 10)
        else if ($i ~ /^Reason=/) reason = substr($i, 8)
        else if ($i ~ /^ExitCode=/) code = substr($i, 10)
      }
      print (task == "" ? jid : (ajid == "" ? jid : ajid) "_" task), state, reason, code }')
    counts=$(echo "$table" | awk '{
      n = 1; t = $1; sub(/^[0-9]+_/, "", t); sub(/%.*/, "", t)
      if (t ~ /^[0-9]+-[0-9]+$/) { split(t, r, "-"); n = r[2] - r[1] + 1 }
      if ($2 == "COMPLETED") d += n
      else if ($2 == "RUNNING" || $2 == "COMPLETING") ru += n
      else if ($2 == "PENDING" || $2 == "REQUEUED") p += n
      else if ($2 == "CANCELLED") c += n
      else f += n }
      END { printf "%d %d %d %d %d", d, ru, p, f, c }')
    read -r n_done n_run n_pend n_fail n_canc <<< "$counts"
    printf '  %-12s job %-8s %d done, %d running, %d pending, %d failed%s\n' "$stage" "$id" "$n_done" "$n_run" \
      "$n_pend" "$n_fail" "$([ "$n_canc" -gt 0 ] && echo ", $n_canc cancelled")"
    if [ "$n_fail" -gt 0 ]; then
      complete=0
      [ -n "$root" ] || root=$stage
      echo "$table" | awk '$2 != "COMPLETED" && $2 != "RUNNING" && $2 != "COMPLETING" && $2 != "PENDING" &&
                           $2 != "REQUEUED" && $2 != "CANCELLED"' | head -n 10 |
        while read -r task state reason code; do
          printf '      %s %s (exit %s): log %s/%s/%s.out\n' "$task" "$state" "$code" "$RESULTS_DIR" "$stage" "$task"
        done
      [ "$n_fail" -le 10 ] || echo "      ... and $((n_fail - 10)) more failed tasks"
    elif [ "$n_canc" -gt 0 ]; then
      complete=0
      reason=$(echo "$table" | awk '$2 == "CANCELLED" { print $3; exit }')
      [ "$reason" = DependencyNeverSatisfied ] && echo "      (cancelled because an earlier stage failed)"
    fi
  done < "$RESULTS_DIR/jobs.txt"
  if [ -n "$root" ]; then
    if [ "$root" = extract ] && grep -qlE "(corrupt|truncated) (zstd|xz|gzip) data" "$RESULTS_DIR"/extract/*.out 2>/dev/null; then
      # A damaged download: extracting again cannot help; fetch it again, verified.
      echo "  -> the first failure is in stage extract: a downloaded file is damaged; download again, verified:"
      echo "     DOWNLOAD_VERIFY=1 STAGE_PATH=$STAGE_PATH $PTK_SLURM_DIR/submit-pipeline.sh --from download"
    else
      echo "  -> the first failure is in stage $root; after fixing its cause (see the logs above), resubmit:"
      echo "     STAGE_PATH=$STAGE_PATH $PTK_SLURM_DIR/submit-pipeline.sh --from $root"
    fi
  fi
fi
if [ "$complete" = 1 ]; then echo "status: every stage is complete; datasets in $PREPROCESSED_DIR, checkpoints in $CKPT_DIR"; exit 0; fi
exit 1
