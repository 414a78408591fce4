#!/usr/bin/env bash
# slurm/train.sbatch's command line from the tutorials' variables and TRAIN_ARGS, on a real single-node
# Slurm (started here), submitted as the tutorials do: a --seq-length in TRAIN_ARGS (a flag there wins
# over its variable) sizes the position table too. It took SEQ_LENGTH's (1024 by default), and the job
# stopped at start: "--max-position-embeddings 1024 is less than --seq-length 2048". MAX_POSITION_EMBEDDINGS,
# when set, is still given. A requeued job whose --save lock a dead node still holds (NFS keeps it for its
# lease) waits LOCK_WAIT for it, as the data stages do: it failed at once.
# Usage: train_sbatch_args_test.sh BIN_DIR SOURCE_DIR      (exit 77 = skipped: not root)
set -euo pipefail
BIN=$1
SRC=$2
[ "$(id -u)" = 0 ] || { echo "SKIP: a local Slurm needs root"; exit 77; }
export PATH="$PATH:/usr/sbin:/sbin"
WORK=$(mktemp -d /tmp/ptk-sargs-XXXXXX)
export SLURM_LOCAL_DIR=$WORK/s
# Free ports below the ephemeral range (free-ports.py: another test's port-0 bind or connection cannot take them;
# two ports bound at 0 and freed could be taken before slurmctld binds them, or be one port), reserved while this
# shell lives (--hold): a trainer test beside it cannot pick them as a MASTER_PORT.
read -r SLURM_LOCAL_CTLD_PORT SLURM_LOCAL_SLURMD_PORT < <(python3 "$SRC/tests/slurm/free-ports.py" 2 --hold $$)
export SLURM_LOCAL_CTLD_PORT SLURM_LOCAL_SLURMD_PORT
cleanup() {
  "$SRC/tests/slurm/stop-slurm.sh" --purge "$SLURM_LOCAL_DIR" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

eval "$("$SRC/tests/slurm/start-slurm.sh" 2>"$WORK/slurm-start.log")" || { cat "$WORK/slurm-start.log"; fail "cannot start Slurm"; }

# The model from the tutorials' variables but the sequence length, SEQ_LENGTH left at its default (1024).
export PTK_BIN=$BIN MOCK_DATA=1 NUM_LAYERS=1 HIDDEN_SIZE=32 NUM_ATTENTION_HEADS=2 TRAIN_ITERS=1
unset SEQ_LENGTH MAX_POSITION_EMBEDDINGS
BASE="--vocab-size 1000 --micro-batch-size 1 --global-batch-size 1 --lr 1e-3 --eval-iters 0 --log-interval 1 --threads 1"
run() {  # STAGE_PATH TRAIN_ARGS [VAR=VALUE...] -> the job's log; fails unless the job completed
  local stage=$1 args=$2 id
  shift 2
  mkdir -p "$stage"
  id=$(cd "$WORK" && env STAGE_PATH="$stage" TRAIN_ARGS="$args" "$@" sbatch --parsable -p gpu -N 1 --ntasks-per-node 1 \
    --cpus-per-task 1 --output "$stage/train-%j.out" "$SRC/slurm/train.sbatch") || fail "sbatch train.sbatch"
  "$SRC/tests/slurm/slurm-wait.sh" -t 120 "$id" > "$WORK/wait.out" ||
    { cat "$WORK/wait.out" "$stage"/train-*.out; fail "the job with TRAIN_ARGS=\"$args\" did not complete"; }
  [ "$(cat "$stage/checkpoints/latest_checkpointed_iteration.txt")" = 1 ] || fail "no checkpoint at iteration 1"
  cat "$stage"/train-*.out
}
echo "== TRAIN_ARGS --seq-length 2048 (SEQ_LENGTH unset: 1024): the position table follows it"
run "$WORK/a" "$BASE --seq-length 2048" > "$WORK/a.log"
grep -q "max-position-embeddings" "$WORK/a.log" && { cat "$WORK/a.log"; fail "a position-table error"; }
echo "== MAX_POSITION_EMBEDDINGS=4096 with it: given as set"
run "$WORK/b" "$BASE --seq-length 2048" MAX_POSITION_EMBEDDINGS=4096 > "$WORK/b.log"
echo "== MAX_POSITION_EMBEDDINGS=1024 below it: ptk-train's refusal, naming both"
mkdir -p "$WORK/c"
id=$(cd "$WORK" && env STAGE_PATH="$WORK/c" TRAIN_ARGS="$BASE --seq-length 2048" MAX_POSITION_EMBEDDINGS=1024 sbatch \
  --parsable -p gpu -N 1 --ntasks-per-node 1 --cpus-per-task 1 --output "$WORK/c/train-%j.out" "$SRC/slurm/train.sbatch")
"$SRC/tests/slurm/slurm-wait.sh" -t 120 "$id" > "$WORK/wait.out" && fail "the job ran with a position table below its sequence"
grep -q -- "--max-position-embeddings 1024 is less than --seq-length 2048" "$WORK"/c/train-*.out ||
  { cat "$WORK"/c/train-*.out; fail "no refusal naming both"; }
echo "== --save's lock held (a dead node's, on NFS): the job waits LOCK_WAIT for it, then trains"
mkdir -p "$WORK/d/checkpoints"
python3 "$SRC/tests/slurm/hold-lock.py" "$WORK/d/checkpoints/ptk-train" "$WORK/d/train.log" "(--lock-wait)" 150 \
  > "$WORK/hold.out" 2>&1 &
holder=$!
for _ in $(seq 100); do grep -q held "$WORK/hold.out" && break; sleep 0.1; done
grep -q held "$WORK/hold.out" || { cat "$WORK/hold.out"; fail "the lock was not taken"; }
run "$WORK/d" "$BASE --seq-length 64" LOCK_WAIT=120 > "$WORK/d.log" &
job=$!
# The holder watches the job's log: train.log gathers it as it grows (Slurm writes train-JOBID.out).
while kill -0 "$job" 2>/dev/null; do cat "$WORK"/d/train-*.out > "$WORK/d/train.log" 2>/dev/null || true; sleep 0.2; done
wait "$job" || { kill "$holder" 2>/dev/null; cat "$WORK/d.log" "$WORK"/d/train-*.out; fail "the job did not wait for --save's lock"; }
wait "$holder" || fail "the holder never saw the job wait"
grep -q "ptk-train is being written by another run .*waited 0 s of 120 s (--lock-wait)" "$WORK/d.log" ||
  { cat "$WORK/d.log"; fail "no line saying the job waits"; }
echo "PASS"
