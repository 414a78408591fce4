#!/usr/bin/env bash
# The Slurm pipeline on a real single-node Slurm (slurmctld + slurmd + munge, started here):
#   1. submit-pipeline.sh runs download -> extract -> concat-plan -> concat -> tokenize as array jobs
#      against a fake Hugging Face Hub serving the bundled sample; the datasets equal a plain
#      single-process run of the same tools, byte for byte;
#   2. a corrupted download makes one extract task fail: its dependents never run, status.sh says so;
#   3. resubmitting from the download stage (with --verify) repairs it and completes the pipeline;
#   4. wrong configurations fail at submit time with a clear message.
# Usage: slurm_pipeline_test.sh BIN_DIR SOURCE_DIR      (exit 77 = skipped: not root)
set -euo pipefail
BIN=$1
SRC=$2
[ "$(id -u)" = 0 ] || { echo "SKIP: a local Slurm needs root"; exit 77; }
export PATH="$PATH:/usr/sbin:/sbin"
WORK=$(mktemp -d /tmp/ptk-slurm-XXXXXX)
export SLURM_LOCAL_DIR=$WORK/s
# Free ports below the ephemeral range (free-ports.py: another test's port-0 bind or connection cannot take them),
# reserved while this shell lives (--hold): a trainer test beside it cannot pick them as a MASTER_PORT.
read -r SLURM_LOCAL_CTLD_PORT SLURM_LOCAL_SLURMD_PORT < <(python3 "$SRC/tests/slurm/free-ports.py" 2 --hold $$)
export SLURM_LOCAL_CTLD_PORT SLURM_LOCAL_SLURMD_PORT SLURM_LOCAL_KILL_INVALID_DEPEND=1
HUB_PID=
cleanup() {
  [ -n "$HUB_PID" ] && kill "$HUB_PID" 2>/dev/null || true
  "$SRC/tests/slurm/stop-slurm.sh" --purge "$SLURM_LOCAL_DIR" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

eval "$("$SRC/tests/slurm/start-slurm.sh" 2>"$WORK/slurm-start.log")" || { cat "$WORK/slurm-start.log"; fail "cannot start Slurm"; }
python3 "$SRC/tests/support/fake_hub.py" --repo-dir "$SRC/sample/slimpajama-mini" --port-file "$WORK/ports" >/dev/null 2>&1 &
HUB_PID=$!
end=$((SECONDS + 60)); until [ -s "$WORK/ports" ] || [ $SECONDS -ge $end ]; do sleep 0.05; done  # python starts late under load
export HF_ENDPOINT=$(awk '/HUB/{print $2}' "$WORK/ports") HF_TOKEN=hf_test_token
export STAGE_PATH=$WORK/stage PTK_BIN=$BIN DOWNLOAD_TASKS=2 EXTRACT_TASKS=3 CONCAT_CHUNKS=4 TOKENIZE_TASKS=3 CPUS_PER_TASK=1
# Training: 2 ranks under srun (gloo over loopback), a tiny model.
export TRAIN_TASKS_PER_NODE=2 TRAIN_CPUS_PER_TASK=1 TRAIN_ITERS=6
export TRAIN_ARGS="--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-warmup-iters 1 --split 98,2,0 --log-interval 2 --eval-interval 3 --eval-iters 1 --save-interval 3"
SUBMIT=$SRC/slurm/submit-pipeline.sh
WAIT=$SRC/tests/slurm/slurm-wait.sh

run_pipeline() {  # args for submit-pipeline.sh; sets JOBS_OUT and WAIT_RC
  "$SUBMIT" "$@" > "$WORK/jobs" 2>"$WORK/submit.err" || { cat "$WORK/submit.err"; fail "submit-pipeline.sh $*"; }
  set +e
  "$WAIT" -t 300 $(awk '{print $2}' "$WORK/jobs") > "$WORK/wait.out"
  WAIT_RC=$?
  set -e
}

echo "== 1. the whole pipeline as Slurm array jobs"
run_pipeline
cat "$WORK/wait.out"
[ "$WAIT_RC" = 0 ] || { tail -n 30 "$STAGE_PATH"/results/*/*.out; fail "the pipeline did not complete"; }
"$SRC/slurm/status.sh" || fail "status.sh does not report the pipeline complete"
cmp -s "$STAGE_PATH/slimpajama/bpe/vocab.json" "$SRC/tokenizer/data/gpt2-vocab.json" &&
  cmp -s "$STAGE_PATH/slimpajama/bpe/merges.txt" "$SRC/tokenizer/data/gpt2-merges.txt" ||
  fail "the GPT-2 files are not in \$STAGE_PATH/slimpajama/bpe/ where the seeds' training scripts look"

echo "== reference: the same tools in one process"
REF=$WORK/ref
"$BIN/ptk-download" --quiet --repo cerebras/SlimPajama-627B --include 'train/**' --include 'validation/**' --local-dir "$REF/raw"
"$BIN/ptk-extract" --quiet "$REF/raw" --output-dir "$REF/extracted"
"$BIN/ptk-concat" --quiet --input "$REF/extracted/train" --output-dir "$REF/chunks" --chunks 4
mkdir -p "$REF/pre"
for c in "$REF"/chunks/train_*.jsonl; do
  n=$(basename "$c" .jsonl)
  "$BIN/ptk-tokenize" --quiet --input "$c" --output-prefix "$REF/pre/$n" --append-eod --workers 2 >/dev/null
done
# The validation split: SlimPajama's validation/ folder, one dataset.
"$BIN/ptk-tokenize" --quiet --input "$REF/extracted/validation" --output-prefix "$REF/pre/validation" --append-eod \
  --workers 2 >/dev/null
compare() {
  local n=0
  for f in "$REF"/pre/*_text_document.bin "$REF"/pre/*_text_document.idx; do
    cmp -s "$f" "$STAGE_PATH/slimpajama/preprocessed/$(basename "$f")" || fail "$(basename "$f") differs from the single-process run"
    n=$((n + 1))
  done
  [ "$n" = 10 ] || fail "expected 5 datasets (4 chunks, validation), compared $n files"
}
compare
echo "   4 chunk datasets and the validation split byte-identical to the single-process run"
train_log=$(ls "$STAGE_PATH"/results/train/*.out | head -1)
grep -q 'data parallel: 2 ranks (srun)' "$train_log" || { cat "$train_log"; fail "train did not run 2 ranks under srun"; }
grep -q 'iteration        6/       6' "$train_log" || { cat "$train_log"; fail "train did not reach iteration 6"; }
[ "$(cat "$STAGE_PATH/checkpoints/latest_checkpointed_iteration.txt")" = 6 ] || fail "no checkpoint at iteration 6"
[ "$(grep -c '] iteration ' "$train_log")" = 4 ] || { cat "$train_log"; fail "expected 4 log lines (1, 2, 4, 6) from one rank only (the last)"; }
grep -q '+ validation .*/validation_text_document' "$train_log" &&
  grep -q 'validation loss at iteration 6 on validation set' "$train_log" ||
  { cat "$train_log"; fail "train did not evaluate on the validation split"; }
grep -q "^tokenize .*5 of 5 datasets complete (incl. validation)" <("$SRC/slurm/status.sh") ||
  fail "status.sh does not count the validation split"
dp=$("$SRC/slurm/data-path.sh" --splits)
[ "$dp" = "--train-data-path $(for i in 00 01 02 03; do printf '0.25 %s ' "$STAGE_PATH/slimpajama/preprocessed/train_${i}_text_document"; done)--valid-data-path 1 $STAGE_PATH/slimpajama/preprocessed/validation_text_document" ] ||
  fail "data-path.sh --splits: $dp"
echo "   train: 2 ranks under srun, evaluated on the validation split, checkpoint at iteration 6"

echo "== 2. a corrupted download: one extract task fails, its dependents never run"
victim=$(find "$STAGE_PATH/slimpajama/raw/train" -name '*.zst' | LC_ALL=C sort | head -1)
size=$(stat -c %s "$victim")
printf 'garbage!' | dd of="$victim" bs=1 seek=$((size / 2)) conv=notrunc status=none
run_pipeline --from extract
cat "$WORK/wait.out"
[ "$WAIT_RC" != 0 ] || fail "the pipeline completed despite a corrupt input"
grep -qE '^[0-9]+_[0-9]+ FAILED' "$WORK/wait.out" || fail "no extract task failed"
extract_id=$(awk '$1=="extract"{print $2}' "$WORK/jobs")
for stage in concat-plan concat tokenize; do
  id=$(awk -v s="$stage" '$1==s{print $2}' "$WORK/jobs")
  if grep -qE "^${id}(_[0-9]+)? COMPLETED" "$WORK/wait.out"; then fail "$stage ran although extract failed"; fi
done
grep -q "corrupt zstd data" "$STAGE_PATH"/results/extract/"${extract_id}"_*.out || fail "the failing task's log does not say why"
"$SRC/slurm/status.sh" > "$WORK/status.out" && fail "status.sh reports success after a failed task"
grep -q "FAILED" "$WORK/status.out" || { cat "$WORK/status.out"; fail "status.sh does not show the failed task"; }
cat "$WORK/status.out"
grep -qE "^      ${extract_id}_[0-9]+ FAILED \(exit 1:0\): log .*/results/extract/${extract_id}_[0-9]+\.out" "$WORK/status.out" ||
  fail "status.sh does not list the failed task with its log"
[ "$(grep -c -- '--from' "$WORK/status.out")" = 1 ] || fail "status.sh should give one resubmit command (the root cause)"
grep -q -- "DOWNLOAD_VERIFY=1 .*submit-pipeline.sh --from download" "$WORK/status.out" ||
  fail "the resubmit command does not re-download the damaged input"
grep -qE "^extract .*1 stale \(the input changed since\)" "$WORK/status.out" ||
  fail "status.sh reports the stale output of the corrupted input as extracted"

echo "== 3. resubmission from the download stage (re-verified) completes the job"
DOWNLOAD_VERIFY=1 run_pipeline --from download
cat "$WORK/wait.out"
[ "$WAIT_RC" = 0 ] || { tail -n 30 "$STAGE_PATH"/results/*/*.out; fail "the resubmission did not complete"; }
"$SRC/slurm/status.sh" >/dev/null || fail "status.sh does not report the repaired pipeline complete"
compare
echo "   repaired; datasets byte-identical again"

echo "== 4. train: Slurm's USR1 (as --signal=USR1@120 sends it) saves, exits and requeues; the requeued job resumes"
# 300 iterations, the signal once 50 are logged, sent while the ranks are stopped (signal-stopped.sh):
# it lands with the rest ahead, however fast the machine.
export TRAIN_ITERS=300 CKPT_DIR=$WORK/ckpt-signal
TRAIN_ARGS="${TRAIN_ARGS/--save-interval 3/--save-interval 100000} --eval-iters 0 --log-interval 50"
"$SUBMIT" --from train > "$WORK/jobs" 2>"$WORK/submit.err" || { cat "$WORK/submit.err"; fail "submit --from train"; }
train_id=$(awk '$1=="train"{print $2}' "$WORK/jobs")
# A fresh run beside the earlier runs' event files writes in a TensorBoard run directory of its own
# (run-2, run-3, ...), and the requeued run, resumed from its checkpoints, keeps writing there.
tb=$STAGE_PATH/results/train/tensorboard
metrics=$tb/run-$(($(find "$tb" -maxdepth 1 -name 'run-*' 2>/dev/null | wc -l) + 2))/metrics.jsonl
"$SRC/tests/slurm/signal-stopped.sh" "$train_id" USR1 "$TRAIN_TASKS_PER_NODE" "$metrics" 50 ||
  { tail -n 30 "$STAGE_PATH"/results/train/*.out; fail "the USR1 did not reach the ranks"; }
# Slurm holds a requeued job for about two minutes (BeginTime). Once it is pending again and the
# node has finished cleaning up after the first run, let it start at once.
for _ in $(seq 600); do
  scontrol show job -o "$train_id" 2>/dev/null | grep -q 'JobState=PENDING.*Restarts=[1-9]' &&
    [ -z "$(squeue -h -t CG 2>/dev/null)" ] && sinfo -h -N -o %T 2>/dev/null | grep -qx idle && break
  sleep 0.1
done
sleep 1
scontrol update JobId="$train_id" StartTime=now 2>/dev/null || true
set +e; "$WAIT" -t 300 "$train_id" > "$WORK/wait.out"; WAIT_RC=$?; set -e
cat "$WORK/wait.out"
if [ "$WAIT_RC" != 0 ]; then
  tail -n 30 "$STAGE_PATH"/results/train/*.out
  scontrol show job -o "$train_id" 2>/dev/null
  grep -h -E "JobId=$train_id|job $train_id|StepId=$train_id" "$SLURM_LOCAL_DIR"/log/slurm*.log 2>/dev/null | tail -n 40
  fail "the requeued training did not complete"
fi
restarts=$(scontrol show job -o "$train_id" 2>/dev/null | sed -n 's/.*Restarts=\([0-9]*\).*/\1/p')
[ "${restarts:-0}" -ge 1 ] || fail "the job was not requeued (Restarts=${restarts:-?})"
[ "$(cat "$CKPT_DIR/latest_checkpointed_iteration.txt")" = "$TRAIN_ITERS" ] || fail "the resumed run did not finish"
# Every iteration once: the signal's checkpoint is where the requeued run resumed.
[ "$(wc -l < "$metrics")" = "$TRAIN_ITERS" ] || fail "metrics hold $(wc -l < "$metrics") iterations, expected $TRAIN_ITERS (lost or repeated work)"
[ "$(sed -n 's/.*"iteration": \([0-9]*\),.*/\1/p' "$metrics" | sort -n | uniq | wc -l)" = "$TRAIN_ITERS" ] || fail "repeated iterations"
echo "   signal -> checkpoint -> requeue -> resume: $TRAIN_ITERS iterations, each once (Restarts=$restarts)"
unset TRAIN_ITERS CKPT_DIR

echo "== 5. wrong configurations fail at submit time"
expect_submit_error() {  # message env...
  local msg=$1; shift
  if env "$@" "$SUBMIT" > "$WORK/bad.out" 2>&1; then fail "submit accepted: $*"; fi
  grep -q "$msg" "$WORK/bad.out" || { cat "$WORK/bad.out"; fail "no clear message for: $*"; }
}
expect_submit_error "STAGE_PATH is not set" -u STAGE_PATH
expect_submit_error "partition 'nosuch' does not exist" PREP_PARTITION=nosuch
expect_submit_error "VOCAB_FILE=/nonexistent/vocab.json does not exist" VOCAB_FILE=/nonexistent/vocab.json MERGE_FILE=/x
expect_submit_error "must be a positive integer" EXTRACT_TASKS=0

echo "== 6. a stage script submitted directly with sbatch, as the tutorials do (configured by the environment)"
set +e
(cd "$WORK" && env -u PTK_SLURM_DIR SBATCH_PARTITION=hpc sbatch --wait --output "$WORK/direct-%j.out" \
   "$SRC/slurm/tokenize.sbatch" > "$WORK/direct.id" 2>&1)
direct_rc=$?
set -e
direct_log=$(ls "$WORK"/direct-*.out 2>/dev/null | head -1)
[ "$direct_rc" = 0 ] || { cat "$WORK/direct.id" "$direct_log" 2>/dev/null; fail "direct sbatch of tokenize.sbatch failed"; }
[ "$(grep -c 'already done' "$direct_log")" = 5 ] || { cat "$direct_log"; fail "the direct job did not find the 5 datasets"; }
echo "   sbatch slurm/tokenize.sbatch: found its configuration and the 5 finished datasets"
echo "PASS"
