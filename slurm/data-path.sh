#!/usr/bin/env bash
# Prints the blend that training reads for the datasets the pipeline prepared: the plan's chunks,
# in plan order (never a glob), as Megatron's --data-path ("W1 P1 W2 P2 ...") or NeMo's
# model.data.data_prefix ("[W1,P1,W2,P2,...]"); with --splits, Megatron's per-split flags for the
# chunks and the validation split ("--train-data-path W1 P1 ... --valid-data-path 1 V").
# Usage: STAGE_PATH=... slurm/data-path.sh [--weights equal|tokens] [--format megatron|nemo] [--splits]
#   equal:  every chunk the same weight (1/N, as the seeds write it); tokens: weights by token count.
# Exit 1 when a dataset of the plan (or, with --splits, the validation split) is missing or fails
# ptk-inspect --verify.
#        STAGE_PATH=... slurm/data-path.sh --train-args
#   the data flags train.sbatch gives ptk-train, for $(...) in a shell (k8s/pytorchjob.yaml-template):
#   "--train-data-path P1 P2 ... --valid-data-path V" with a tokenized validation split, else
#   "--data-path P1 P2 ..." (no weights: Megatron weighs each by its size); not verified (ptk-train checks).
#        STAGE_PATH=... slurm/data-path.sh --train-args-lines
#   the same arguments one per line, for `mapfile -t` (k8s/train.sh): a path with a space stays one argument.
set -euo pipefail
PTK_SLURM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
weights=equal
format=megatron
splits=0
train_args=0
lines=0
while [ $# -gt 0 ]; do
  case "$1" in
    --weights|--format)  # `shift 2` with no value would fail under set -e: exit 1 and no word
      [ $# -ge 2 ] || { echo "data-path: $1 needs a value (see --help)" >&2; exit 2; }
      if [ "$1" = --weights ]; then weights=$2; else format=$2; fi
      shift 2 ;;
    --splits) splits=1; shift ;;
    --train-args) train_args=1; shift ;;
    --train-args-lines) train_args=1 lines=1; shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
    *) echo "data-path: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$weights" in equal|tokens) ;; *) echo "data-path: --weights equal|tokens, not '$weights'" >&2; exit 2 ;; esac
case "$format" in megatron|nemo) ;; *) echo "data-path: --format megatron|nemo, not '$format'" >&2; exit 2 ;; esac
[ "$splits" = 0 ] || [ "$format" = megatron ] ||
  { echo "data-path: --splits prints Megatron's --train/valid-data-path flags; use --format megatron" >&2; exit 2; }
[ -n "${STAGE_PATH:-}" ] || { echo "data-path: STAGE_PATH is not set" >&2; exit 2; }
source "$PTK_SLURM_DIR/config.sh"
[ -f "$PLAN_FILE" ] || { echo "data-path: no concat plan at $PLAN_FILE" >&2; exit 1; }
if [ "$train_args" = 1 ]; then  # as train.sbatch builds them
  mapfile -t prefixes < <("$PTK_BIN/ptk-concat" list --plan "$PLAN_FILE" | sed "s|.*/||; s|\.jsonl\$||; s|^|$PREPROCESSED_DIR/|; s|\$|_text_document|")
  [ ${#prefixes[@]} -gt 0 ] || { echo "data-path: the plan has no chunks" >&2; exit 1; }
  if ptk_has_valid && [ -f "$VALID_DATASET.idx" ]; then
    args=(--train-data-path "${prefixes[@]}" --valid-data-path "$VALID_DATASET")
  else
    args=(--data-path "${prefixes[@]}")
  fi
  if [ "$lines" = 1 ]; then printf '%s\n' "${args[@]}"; else echo "${args[*]}"; fi
  exit 0
fi
prefixes=() tokens=()
while IFS= read -r chunk; do
  p="$PREPROCESSED_DIR/$(basename "$chunk" .jsonl)_text_document"
  out=$("$PTK_BIN/ptk-inspect" "$p" --verify >/dev/null 2>&1 && "$PTK_BIN/ptk-inspect" "$p") ||
    { echo "data-path: $p is missing or damaged (ptk-inspect --verify $p)" >&2; exit 1; }
  prefixes+=("$p")
  tokens+=("$(echo "$out" | sed -n 's/^tokens: *//p')")
done < <("$PTK_BIN/ptk-concat" list --plan "$PLAN_FILE")
n=${#prefixes[@]}
[ "$n" -gt 0 ] || { echo "data-path: the plan has no chunks" >&2; exit 1; }
total=0
for t in "${tokens[@]}"; do total=$((total + t)); done
items=()
for i in "${!prefixes[@]}"; do
  if [ "$weights" = equal ]; then
    w=$(awk -v n="$n" 'BEGIN { printf "%.6g", 1 / n }')
  else
    w=$(awk -v t="${tokens[$i]}" -v s="$total" 'BEGIN { printf "%.6g", (s > 0 ? t / s : 0) }')
  fi
  items+=("$w" "${prefixes[$i]}")
done
if [ "$splits" = 1 ]; then
  ptk_has_valid || { echo "data-path: no validation split (VALID_SUBDIR=$VALID_SUBDIR, $VALID_DIR absent)" >&2; exit 1; }
  "$PTK_BIN/ptk-inspect" "$VALID_DATASET" --verify >/dev/null 2>&1 ||
    { echo "data-path: $VALID_DATASET is missing or damaged (ptk-inspect --verify $VALID_DATASET)" >&2; exit 1; }
  echo "--train-data-path ${items[*]} --valid-data-path 1 $VALID_DATASET"
elif [ "$format" = megatron ]; then
  echo "${items[*]}"
else
  (IFS=,; echo "[${items[*]}]")
fi
