#!/usr/bin/env bash
# Submits the ptk data pipeline as chained Slurm jobs:
#   download (array, DOWNLOAD_PARTITION) -> extract (array) -> concat-plan -> concat (array) -> tokenize (array)
#   -> train (TRAIN_NODES x TRAIN_TASKS_PER_NODE ranks under srun, TRAIN_PARTITION, requeued on USR1)
# each stage `--dependency=afterok:` the previous one (never aftercorr: a stage must not read the
# half-written outputs of tasks still running). Every task is idempotent, so resubmitting (with
# --from STAGE) redoes only what is missing. Configuration: environment variables, see config.sh.
#
# Usage: slurm/submit-pipeline.sh [--from STAGE] [--dry-run]
#   STAGE: download | extract | concat-plan | concat | tokenize | train
# Prints "STAGE JOBID" lines (also written to $STAGE_PATH/results/jobs.txt).
set -euo pipefail
PTK_SLURM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PTK_SLURM_DIR

from=download
dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --from)  # `shift 2` with no value would fail under set -e: exit 1 and no word
      [ $# -ge 2 ] || { echo "submit-pipeline: --from needs a stage (one of: download extract concat-plan concat tokenize train)" >&2; exit 2; }
      from=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
    --dryrun|--dry|-n|--dry_run|-dry-run) echo "submit-pipeline: unknown argument: $1; did you mean --dry-run?" >&2; exit 2 ;;
    --from=*) from=${1#--from=}; shift ;;
    *) echo "submit-pipeline: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "submit-pipeline: error: $*" >&2; exit 2; }
[ -n "${STAGE_PATH:-}" ] || die "STAGE_PATH is not set (the working area for downloads, chunks and datasets)"
source "$PTK_SLURM_DIR/config.sh"
export PTK_BIN
case " $STAGES " in *" $from "*) ;; *) die "--from $from: not a stage (one of: $STAGES)" ;; esac

# ---- check the configuration now rather than an hour later in a failed job
mkdir -p "$STAGE_PATH" || die "cannot create STAGE_PATH=$STAGE_PATH"
[ -w "$STAGE_PATH" ] || die "STAGE_PATH=$STAGE_PATH is not writable"
if ! command -v sbatch >/dev/null; then
  [ "$dry" = 1 ] || die "sbatch not found: is this a Slurm login node?"
  echo "submit-pipeline: note: no sbatch here; --dry-run prints the lines anyway" >&2
fi
for tool in ptk-download ptk-extract ptk-concat ptk-tokenize ptk-inspect ptk-train; do
  [ -x "$PTK_BIN/$tool" ] || die "$PTK_BIN/$tool not found: build ptk (bash scripts/test.sh) or set PTK_BIN"
done
# Partitions, asked of the controller; --dry-run works without one (and says the check was skipped).
if known=$(sinfo -h -o %P 2>/dev/null) && [ -n "$known" ]; then
  for var in DOWNLOAD_PARTITION PREP_PARTITION TRAIN_PARTITION; do
    p=${!var}
    printf '%s\n' "$known" | tr -d '*' | grep -qx -- "$p" ||
      die "partition '$p' does not exist here: set $var to one of: $(printf '%s' "$known" | tr -d '*' | tr '\n' ' ')"
  done
elif [ "$dry" = 1 ]; then
  echo "submit-pipeline: note: no Slurm controller answered sinfo; partitions not checked (--dry-run)" >&2
else
  die "sinfo cannot reach the Slurm controller (is slurmctld up? sinfo says: $(sinfo 2>&1 | head -1))"
fi
if [ -n "$VOCAB_FILE$MERGE_FILE" ]; then
  [ -f "$VOCAB_FILE" ] || die "VOCAB_FILE=$VOCAB_FILE does not exist"
  [ -f "$MERGE_FILE" ] || die "MERGE_FILE=$MERGE_FILE does not exist"
fi
for v in DOWNLOAD_TASKS EXTRACT_TASKS EXTRACT_CONCURRENCY CONCAT_CHUNKS CONCAT_TASKS CONCAT_CONCURRENCY TOKENIZE_TASKS TOKENIZE_LOG_INTERVAL \
         TOKENIZE_CONCURRENCY CPUS_PER_TASK DOWNLOAD_JOBS EXTRACT_JOBS TRAIN_NODES TRAIN_TASKS_PER_NODE TRAIN_CPUS_PER_TASK \
         TRAIN_ITERS NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "$v=${!v} must be a positive integer"
done
[[ "$LOCK_WAIT" =~ ^(0|[1-9][0-9]{0,8})$ ]] || die "LOCK_WAIT=$LOCK_WAIT must be a number of seconds >= 0 (0: fail at once)"
[[ "$TRAIN_GPUS_PER_NODE" =~ ^[0-9]+$ ]] || die "TRAIN_GPUS_PER_NODE=$TRAIN_GPUS_PER_NODE must be a number (0: no GPUs)"
msg=$(ptk_check_train_args 2>&1) || die "$msg"
if [ "$from" != download ]; then
  [ -d "$RAW_DIR" ] || die "--from $from but nothing was downloaded into $RAW_DIR yet"
fi

mkdir -p "$RESULTS_DIR"/{download,extract,concat-plan,concat,tokenize,train}
export STAGE_PATH DATASET_FOLDER_NAME HF_REPO HF_REPO_TYPE HF_REVISION HF_INCLUDE HF_EXCLUDE HELDOUT_SUBDIRS DOWNLOAD_PARTITION DOWNLOAD_TASKS \
       DOWNLOAD_JOBS DOWNLOAD_VERIFY PREP_PARTITION EXTRACT_TASKS EXTRACT_CONCURRENCY EXTRACT_JOBS DROP_SETS CONCAT_CHUNKS \
       CONCAT_TASKS CONCAT_CONCURRENCY TOKENIZE_TASKS TOKENIZE_CONCURRENCY TOKENIZE_LOG_INTERVAL APPEND_EOD VOCAB_FILE MERGE_FILE CPUS_PER_TASK \
       LOCK_WAIT TRAIN_ITERS TRAIN_ARGS CKPT_DIR NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH

prev=""
started=0
jobs_file="$RESULTS_DIR/jobs.txt"
[ "$dry" = 1 ] || : > "$jobs_file"
# The settings of this submission beside its job ids: status.sh judges the jobs by them, not by the
# variables of whatever shell it runs in.
if [ "$dry" = 0 ]; then
  {
    echo "# the settings submit-pipeline.sh submitted with, $(date '+%F %T'); read by status.sh"
    for v in DATASET_FOLDER_NAME HF_REPO HF_REPO_TYPE HF_REVISION HF_INCLUDE HF_EXCLUDE VALID_SUBDIR HELDOUT_SUBDIRS CONCAT_CHUNKS \
             TRAIN_ITERS TRAIN_ARGS CKPT_DIR NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH; do
      printf '%s=%q\n' "$v" "${!v}"
    done
  } > "$RESULTS_DIR/submitted-settings.sh.tmp" && mv -f "$RESULTS_DIR/submitted-settings.sh.tmp" "$RESULTS_DIR/submitted-settings.sh"
fi
submit() {  # stage partition array(or "") script [extra sbatch args...]
  local stage=$1 part=$2 array=$3 script=$4
  shift 4
  local args=(--parsable --job-name "ptk-$stage" --partition "$part" --export ALL --kill-on-invalid-dep=yes)
  if [ "$stage" = train ]; then
    args+=(--cpus-per-task "$TRAIN_CPUS_PER_TASK" --time "$TRAIN_TIME_LIMIT" "$@")
  else
    args+=(--cpus-per-task "$CPUS_PER_TASK" --time "$TIME_LIMIT")
  fi
  if [ -n "$array" ]; then
    args+=(--array "$array" --output "$RESULTS_DIR/$stage/%A_%a.out")
  else
    args+=(--output "$RESULTS_DIR/$stage/%j.out")
  fi
  [ -n "$prev" ] && args+=(--dependency "afterok:$prev")
  # shellcheck disable=SC2206
  [ -n "$SBATCH_EXTRA" ] && args+=($SBATCH_EXTRA)
  if [ "$dry" = 1 ]; then
    echo "sbatch ${args[*]} $PTK_SLURM_DIR/$script"
    prev="DRYRUN_$stage"
    return
  fi
  local id
  id=$(sbatch "${args[@]}" "$PTK_SLURM_DIR/$script") || die "sbatch failed for stage $stage"
  id=${id%%;*}
  echo "$stage $id" | tee -a "$jobs_file"
  prev=$id
}
for stage in $STAGES; do
  [ "$stage" = "$from" ] && started=1
  [ "$started" = 1 ] || continue
  case "$stage" in
    download) submit download "$DOWNLOAD_PARTITION" "0-$((DOWNLOAD_TASKS - 1))" download.sbatch ;;
    extract) submit extract "$PREP_PARTITION" "0-$((EXTRACT_TASKS - 1))%$EXTRACT_CONCURRENCY" extract.sbatch ;;
    concat-plan) submit concat-plan "$PREP_PARTITION" "" concat-plan.sbatch ;;
    concat) submit concat "$PREP_PARTITION" "0-$((CONCAT_TASKS - 1))%$CONCAT_CONCURRENCY" concat.sbatch ;;
    tokenize) submit tokenize "$PREP_PARTITION" "0-$((TOKENIZE_TASKS - 1))%$TOKENIZE_CONCURRENCY" tokenize.sbatch ;;
    train)
      gpus=()
      [ "$TRAIN_GPUS_PER_NODE" -gt 0 ] && gpus=(--gpus-per-node "$TRAIN_GPUS_PER_NODE")
      submit train "$TRAIN_PARTITION" "" train.sbatch --nodes "$TRAIN_NODES" --ntasks-per-node "$TRAIN_TASKS_PER_NODE" "${gpus[@]}" ;;
  esac
done
[ "$dry" = 1 ] || echo "logs: $RESULTS_DIR/<stage>/   status: STAGE_PATH=$STAGE_PATH $PTK_SLURM_DIR/status.sh" >&2
