#!/usr/bin/env bash
# README's main job: the whole ptk pipeline on one machine, without Slurm, on the sample bundled in
# sample/slimpajama-mini (real public-domain / freely licensed text shaped like SlimPajama-627B).
#
#   0. installs the Debian packages (scripts/install-deps.sh) and builds ptk into build/
#   1. serves the sample as a Hugging Face dataset repo on 127.0.0.1 (tests/support/fake_hub.py: Hub
#      API + a CDN host, pinned commit, sha256 listing, rate-limit headers)
#   2. ptk-download   the repo  -> raw/            (verified, resumable)
#   3. ptk-extract    .zst      -> extracted/      (per-file parallel)
#   4. ptk-concat     train     -> chunks/         (balanced chunks, plan + run)
#   5. ptk-tokenize   chunks and validation -> preprocessed/  (Megatron .bin/.idx)
#   6. ptk-inspect    verify, summary, and GPTDataset sample 0 as Megatron would give it
#   7. ptk-train      a small GPT on the train chunks (CPU): stopped at iteration 25 with a
#                     checkpoint, then resumed with --load to iteration 50
#                     (TensorBoard event files in train/tensorboard, a text sample every 25 iterations)
#   8. plot-loss.py   the loss curve as train/loss.png
#   9. ptk-convert    the trained model as a Hugging Face GPT-2 directory (train/hf), and its last sample
#
# Usage: bash scripts/run-main-job.sh [OUTPUT_DIR]     (default: main-job/ in the checkout)
# Rerunning is cheap: verified downloads, complete extractions, chunks and datasets whose inputs and
# settings did not change are not redone, and training finds its checkpoints complete.
# Environment: PTK_JOBS (build and worker parallelism, default nproc); PTK_SKIP_INSTALL=1 and
# PTK_SKIP_BUILD=1 with PTK_BIN=DIR use binaries built elsewhere (the CTest main_job_test does).
set -euo pipefail
# `--help` was taken for the output directory: the whole job ran (dependencies installed with sudo) into ./--help.
case "${1:-}" in
  -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
  -*) echo "run-main-job.sh: unknown option $1 (its one argument is the output directory; see --help)" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "run-main-job.sh: one argument at most, the output directory (see --help)" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${1:-$ROOT/main-job}")
JOBS=${PTK_JOBS:-$(nproc)}
BIN=${PTK_BIN:-$ROOT/build/bin}
T0=$(date +%s.%N)

step() { printf '\n\033[1m== [%5.1fs] %s\033[0m\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*"; }

step "0/9 install dependencies and build ptk ($JOBS jobs)"
if [ "${PTK_SKIP_INSTALL:-0}" != 1 ]; then
  if [ "$(id -u)" = 0 ]; then bash "$ROOT/scripts/install-deps.sh"
  else sudo bash "$ROOT/scripts/install-deps.sh"; fi
fi
if [ "${PTK_SKIP_BUILD:-0}" != 1 ]; then
  targets=()
  for t in ptk-download ptk-extract ptk-concat ptk-tokenize ptk-inspect ptk-merge ptk-train ptk-convert; do targets+=(--target "$t"); done
  PTK_JOBS=$JOBS bash "$ROOT/scripts/build.sh" "$ROOT/build" "${targets[@]}"
fi

mkdir -p "$OUT"
HUB_PID=
cleanup() { [ -n "$HUB_PID" ] && kill "$HUB_PID" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT

step "1/9 serve sample/slimpajama-mini as the dataset repo cerebras/SlimPajama-627B on 127.0.0.1"
rm -f "$OUT/.hub-ports"
python3 "$ROOT/tests/support/fake_hub.py" --repo-dir "$ROOT/sample/slimpajama-mini" \
  --port-file "$OUT/.hub-ports" >"$OUT/hub.log" 2>&1 &
HUB_PID=$!
for _ in $(seq 200); do [ -s "$OUT/.hub-ports" ] && break; sleep 0.05; done
[ -s "$OUT/.hub-ports" ] || { cat "$OUT/hub.log"; echo "main job: the local hub did not start" >&2; exit 1; }
export HF_ENDPOINT HF_TOKEN=hf_main_job_token
HF_ENDPOINT=$(awk '/HUB/{print $2}' "$OUT/.hub-ports")
echo "hub: $HF_ENDPOINT (files are redirected to a separate CDN host, as on huggingface.co)"

step "2/9 ptk-download: list the repo at a pinned commit, download in parallel, verify size + sha256"
"$BIN/ptk-download" --repo cerebras/SlimPajama-627B --repo-type dataset --local-dir "$OUT/raw" --jobs 8

step "3/9 ptk-extract: .jsonl.zst -> .jsonl, $JOBS files at a time"
"$BIN/ptk-extract" "$OUT/raw" --output-dir "$OUT/extracted" --jobs "$JOBS"

step "4/9 ptk-concat: train -> 4 chunks balanced by bytes (a plan, then the chunks)"
"$BIN/ptk-concat" plan --input "$OUT/extracted/train" --output-dir "$OUT/chunks" --chunks 4
"$BIN/ptk-concat" run --plan "$OUT/chunks/concat-plan.json" --jobs "$JOBS"

step "5/9 ptk-tokenize: GPT-2 BPE -> Megatron .bin/.idx (as preprocess_data.py --append-eod)"
mkdir -p "$OUT/preprocessed"
for chunk in "$OUT"/chunks/train_*.jsonl; do
  name=$(basename "$chunk" .jsonl)
  "$BIN/ptk-tokenize" --input "$chunk" --output-prefix "$OUT/preprocessed/$name" \
    --json-keys text --append-eod --workers "$JOBS" --log-interval 2000
done
"$BIN/ptk-tokenize" --input "$OUT/extracted/validation/chunk*/*.jsonl" --output-prefix "$OUT/preprocessed/validation" \
  --json-keys text --append-eod --workers "$JOBS" --log-interval 2000

step "6/9 ptk-inspect: verify every dataset, summarise one, and show GPTDataset sample 0"
datasets=()
for idx in "$OUT"/preprocessed/*_text_document.idx; do
  prefix=${idx%.idx}
  "$BIN/ptk-inspect" "$prefix" --verify
  datasets+=("$prefix")
done
"$BIN/ptk-inspect" "$OUT/preprocessed/train_00_text_document"
blend=()
for p in "${datasets[@]}"; do case $p in */train_*) blend+=("1" "$p") ;; esac; done
echo
echo "GPTDataset: blend of the train chunks, --split 98,2,0 --seq-length 128 --seed 1234, sample 0:"
"$BIN/ptk-inspect" --data-path "${blend[@]}" --split 98,2,0 --seq-length 128 --seed 1234 \
  --train-samples 1000 --valid-samples 100 --test-samples 0 --sample 0

step "7/9 ptk-train: GPT (2 layers, hidden 128, seq 128) on the train chunks, fp32 on the CPU"
TRAIN=(--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128
  --micro-batch-size 8 --global-batch-size 8 --train-iters 50 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine
  --lr-warmup-iters 5 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234
  --data-path "${blend[@]}" --split 98,2,0 --data-cache-path "$OUT/train/index-cache"
  --log-interval 5 --eval-interval 25 --eval-iters 2
  --save "$OUT/train/checkpoints" --load "$OUT/train/checkpoints" --save-interval 25
  --tensorboard-dir "$OUT/train/tensorboard" --threads "$JOBS"
  --sample-interval 25 --sample-prompt "The history of" --sample-length 24)
# ptk-train's output also goes to train/train.log (the samples are shown again at the end).
mkdir -p "$OUT/train"
train() { "$BIN/ptk-train" "${TRAIN[@]}" "$@" 2>&1 | tee -a "$OUT/train/train.log"; }
# A rerun finds the checkpoints where the last run left them: it says so, and runs what is left.
latest=$(cat "$OUT/train/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
[[ $latest =~ ^[0-9]+$ ]] || latest=0
if [ "$latest" -ge 50 ]; then
  echo "train/checkpoints holds a finished run (iteration $latest): ptk-train finds nothing to train"
  echo "(remove $OUT/train to train again)"
  train
else
  if [ "$latest" -lt 25 ]; then
    echo "first run: stops at iteration 25 (--exit-interval 25) after saving a checkpoint"
    train --exit-interval 25
    echo
  fi
  echo "second run: --load resumes from the checkpoint and trains to iteration 50"
  train
fi

step "8/9 loss curve"
/usr/bin/python3 "$ROOT/scripts/plot-loss.py" "$OUT/train/tensorboard/metrics.jsonl" -o "$OUT/train/loss.png" \
  --title "ptk-train on sample/slimpajama-mini: lm loss"

step "9/9 the model for Hugging Face transformers: ptk-convert --loader ptk --saver hf"
"$BIN/ptk-convert" --model-type GPT --loader ptk --saver hf --load-dir "$OUT/train/checkpoints" \
  --save-dir "$OUT/train/hf"
echo "its last sample (ptk-train --sample-interval 25, greedy):"
grep ' sample at iteration' "$OUT/train/train.log" | tail -1

step "done"
cat <<EOF
outputs (under $OUT):
  raw/            the downloaded repo ($(find "$OUT/raw" -name '*.zst' | wc -l) .jsonl.zst files, verified; manifest and done log in raw/.ptk-download/)
  extracted/      the .jsonl files ($(du -sh "$OUT/extracted" | cut -f1))
  chunks/         $(ls "$OUT"/chunks/train_*.jsonl | wc -l) train chunks and concat-plan.json
  preprocessed/   Megatron datasets, for --data-path:
$(for p in "${datasets[@]}"; do printf '                    %s  (%s + .idx)\n' "$p" "$(du -h "$p.bin" | cut -f1)"; done)
  train/          checkpoints/ (iter_0000025, iter_0000050, latest_checkpointed_iteration.txt),
                  tensorboard/ (event files: tensorboard --logdir $OUT/train/tensorboard; metrics.jsonl),
                  loss.png (the loss curve), train.log (ptk-train's lines and samples),
                  hf/ (GPT2LMHeadModel.from_pretrained("$OUT/train/hf") in transformers)
  hub.log         the local hub's log
Rerun this script and the verified work is skipped (and training finds itself complete).
EOF
