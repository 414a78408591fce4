#!/usr/bin/env bash
# slurm/train.sbatch on a real single-node Slurm (slurmctld + slurmd + munge, started here), submitted
# as the tutorials do: sbatch -p gpu -N 1 --gpus-per-node 2 --ntasks-per-node 2 (fake GPUs: Slurm
# hands each task CUDA_VISIBLE_DEVICES; this CPU build trains on gloo), the model from the tutorials'
# variables, 2 ranks with --use-distributed-optimizer --overlap-grad-reduce:
#   1. SIGTERM to the job's tasks (a pre-emption's): the ranks save the same iteration and exit 0,
#      the script requeues the job (--requeue), the requeued job resumes from `latest` and completes:
#      every iteration trained once;
#   2. one rank killed (kill -9): the job fails within --distributed-timeout-minutes, not at its
#      time limit;
#   3. a second job on the node given the first's MASTER_PORT: it fails at once, its ranks naming the
#      first job (SLURM_JOB_ID, srun's step: the run id), which trains on.
# Usage: slurm_train_test.sh BIN_DIR SOURCE_DIR      (exit 77 = skipped: not root)
set -euo pipefail
BIN=$1
SRC=$2
[ "$(id -u)" = 0 ] || { echo "SKIP: a local Slurm needs root"; exit 77; }
export PATH="$PATH:/usr/sbin:/sbin"
WORK=$(mktemp -d /tmp/ptk-strain-XXXXXX)
export SLURM_LOCAL_DIR=$WORK/s SLURM_LOCAL_GPUS=2
# Free ports below the ephemeral range (free-ports.py: another test's port-0 bind or connection cannot take them),
# reserved while this shell lives (--hold): a trainer test beside it cannot pick them as a MASTER_PORT.
read -r SLURM_LOCAL_CTLD_PORT SLURM_LOCAL_SLURMD_PORT < <(python3 "$SRC/tests/slurm/free-ports.py" 2 --hold $$)
export SLURM_LOCAL_CTLD_PORT SLURM_LOCAL_SLURMD_PORT
cleanup() {
  "$SRC/tests/slurm/stop-slurm.sh" --purge "$SLURM_LOCAL_DIR" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
WAIT=$SRC/tests/slurm/slurm-wait.sh

eval "$("$SRC/tests/slurm/start-slurm.sh" 2>"$WORK/slurm-start.log")" || { cat "$WORK/slurm-start.log"; fail "cannot start Slurm"; }

export PTK_BIN=$BIN MOCK_DATA=1 NUM_LAYERS=1 HIDDEN_SIZE=32 NUM_ATTENTION_HEADS=2 SEQ_LENGTH=32
# Mock data over a vocabulary of 1000: GPT-2's 50257 made each iteration ten times longer, all of it in
# the output layer, and checks nothing here. The signal comes once 100 iterations are logged, while the
# tasks are stopped (signal-stopped.sh): it lands with the rest of the 1500 ahead, however fast the
# machine.
ITERS=1500
BASE_ARGS="--vocab-size 1000 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-warmup-iters 1 --eval-iters 0 --log-interval 50 --save-interval 100000 --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000"
submit() {  # -> job id; as the tutorials submit it, from another directory
  (cd "$WORK" && sbatch --parsable -p gpu -N 1 --gpus-per-node 2 --ntasks-per-node 2 --cpus-per-task 1 \
     --open-mode=append --output "$STAGE_PATH/train-%j.out" "$SRC/slurm/train.sbatch") || fail "sbatch train.sbatch"
}
lines() { cat "$1" 2>/dev/null | wc -l; }

echo "== 1. pre-emption: SIGTERM -> every rank saves the same iteration -> requeue -> resume from latest"
export STAGE_PATH=$WORK/stage1 TRAIN_ITERS=$ITERS TRAIN_ARGS=$BASE_ARGS
mkdir -p "$STAGE_PATH"
id=$(submit)
metrics=$STAGE_PATH/results/train/tensorboard/metrics.jsonl
"$SRC/tests/slurm/signal-stopped.sh" "$id" TERM 2 "$metrics" 100 ||
  { cat "$STAGE_PATH"/train-*.out; fail "the SIGTERM did not reach both ranks"; }
# Slurm holds a requeued job for about two minutes (BeginTime): once it is pending again and the node
# is idle, let it start at once.
for _ in $(seq 600); do
  scontrol show job -o "$id" 2>/dev/null | grep -q 'JobState=PENDING.*Restarts=[1-9]' &&
    [ -z "$(squeue -h -t CG 2>/dev/null)" ] && sinfo -h -N -o %T 2>/dev/null | grep -qx idle && break
  sleep 0.1
done
sleep 1
scontrol update JobId="$id" StartTime=now 2>/dev/null || true
set +e; "$WAIT" -t 300 "$id" > "$WORK/wait.out"; WAIT_RC=$?; set -e
log=$(ls "$STAGE_PATH"/train-*.out)
[ "$WAIT_RC" = 0 ] || { cat "$WORK/wait.out"; tail -n 40 "$log"; fail "the requeued training did not complete"; }
restarts=$(scontrol show job -o "$id" 2>/dev/null | sed -n 's/.*Restarts=\([0-9]*\).*/\1/p')
[ "${restarts:-0}" -ge 1 ] || fail "the job was not requeued (Restarts=${restarts:-?})"
grep -q 'data parallel: 2 ranks (srun), gloo' "$log" || { cat "$log"; fail "not 2 ranks under srun over gloo"; }
grep -q 'train: 2 rank(s) on .* (2 GPU(s) per node), mock data' "$log" || { cat "$log"; fail "the GPUs were not seen"; }
# srun's own variables tell ptk-train how many ranks share the node (its threads and memory check;
# no --threads in BASE_ARGS, so that its note says how it chose them).
grep -q 'CPU threads\? per rank: .*(SLURM_TASKS_PER_NODE=2 at SLURM_NODEID=0' "$log" ||
  { cat "$log"; fail "ptk-train did not see srun's 2 ranks on this node"; }
grep -q 'distributed optimizer: each of 2 ranks keeps' "$log" || { cat "$log"; fail "no distributed optimizer"; }
grep -q 'exiting program after receiving SIGTERM.' "$log" || { cat "$log"; fail "the signal did not stop the run"; }
saved=$(sed -n 's/.*successfully saved checkpoint from iteration *\([0-9]*\) .*/\1/p' "$log" | head -1)
[ -n "$saved" ] && [ "$saved" -lt "$ITERS" ] || { cat "$log"; fail "no checkpoint on the signal"; }
grep -q "loaded checkpoint .* at iteration $saved " "$log" || { cat "$log"; fail "the requeued job did not resume from iteration $saved"; }
[ "$(cat "$STAGE_PATH/checkpoints/latest_checkpointed_iteration.txt")" = "$ITERS" ] || fail "the resumed run did not finish"
[ "$(lines "$metrics")" = "$ITERS" ] || fail "metrics hold $(lines "$metrics") iterations, expected $ITERS (lost or repeated work)"
[ "$(sed -n 's/.*"iteration": \([0-9]*\),.*/\1/p' "$metrics" | sort -n | uniq | wc -l)" = "$ITERS" ] || fail "repeated iterations"
echo "   SIGTERM at iteration $saved -> checkpoint -> requeue (Restarts=$restarts) -> resumed -> $ITERS iterations, each once"

echo "== 2. a rank killed: the job fails within --distributed-timeout-minutes"
export STAGE_PATH=$WORK/stage2 TRAIN_ITERS=1000000 TRAIN_ARGS="$BASE_ARGS --distributed-timeout-minutes 0.5"
mkdir -p "$STAGE_PATH"
id=$(submit)
metrics=$STAGE_PATH/results/train/tensorboard/metrics.jsonl
# The job's start, both ranks' and 50 iterations: up to 300 s on a loaded machine (900 polls of 0.1 s were 90 s).
end=$((SECONDS + 300)); until [ "$(lines "$metrics")" -ge 50 ] || [ $SECONDS -ge $end ]; do sleep 0.1; done
[ "$(lines "$metrics")" -ge 50 ] || fail "the second training did not start"
# Rank 1's process: the job's ptk-train task with global task id 1.
victim=$(scontrol listpids "$id" 2>/dev/null | awk '$5 == 1 {print $1}' | while read -r p; do
  [ "$(cat "/proc/$p/comm" 2>/dev/null)" = ptk-train ] && echo "$p"; done | head -1)
[ -n "$victim" ] || { scontrol listpids "$id"; fail "no ptk-train task of rank 1"; }
start=$SECONDS
kill -9 "$victim"
set +e; "$WAIT" -t 120 "$id" > "$WORK/wait.out"; WAIT_RC=$?; set -e
elapsed=$((SECONDS - start))
[ "$WAIT_RC" = 1 ] || { cat "$WORK/wait.out"; fail "the job did not fail (slurm-wait rc $WAIT_RC)"; }
[ "$elapsed" -le 45 ] || fail "the job took ${elapsed}s to end after a rank was killed"
grep -q 'FAILED' "$WORK/wait.out" || { cat "$WORK/wait.out"; fail "the job is not FAILED"; }
echo "   rank 1 killed -> job FAILED after ${elapsed}s (timeout 30 s), not at its time limit"

echo "== 3. two jobs on this node with one MASTER_PORT: the second stops at once naming the first, which runs on"
# A free port below the ephemeral ones (from 32768), where no outgoing connection can take it meanwhile, reserved
# while this shell lives as the Slurm ports above.
read -r port < <(python3 "$SRC/tests/slurm/free-ports.py" 1 --hold $$)
export MASTER_PORT=$port STAGE_PATH=$WORK/stage3a TRAIN_ITERS=1000000 TRAIN_ARGS=$BASE_ARGS
mkdir -p "$STAGE_PATH"
first=$(submit)
metrics=$STAGE_PATH/results/train/tensorboard/metrics.jsonl
# Its start, both ranks' and 50 iterations: up to 300 s on a loaded machine, as in 2. (900 polls of 0.1 s were 90 s).
end=$((SECONDS + 300)); until [ "$(lines "$metrics")" -ge 50 ] || [ $SECONDS -ge $end ]; do sleep 0.1; done
[ "$(lines "$metrics")" -ge 50 ] || fail "the first job did not start training"
export STAGE_PATH=$WORK/stage3b
mkdir -p "$STAGE_PATH"
second=$(cd "$WORK" && sbatch --parsable -p gpu -N 1 --ntasks-per-node 2 --cpus-per-task 1 \
  --output "$STAGE_PATH/train-%j.out" "$SRC/slurm/train.sbatch") || fail "sbatch the second job"
set +e; "$WAIT" -t 300 "$second" > "$WORK/wait.out"; WAIT_RC=$?; set -e
log=$(ls "$STAGE_PATH"/train-*.out)
[ "$WAIT_RC" = 1 ] || { cat "$WORK/wait.out" "$log"; fail "the second job did not fail (slurm-wait rc $WAIT_RC)"; }
theirs="WORLD_SIZE 2, run id SLURM_JOB_ID=$first SLURM_STEP_ID=0"
mine="WORLD_SIZE 2, run id SLURM_JOB_ID=$second SLURM_STEP_ID=0"
grep -q "rank 0: MASTER_PORT $port on this host is held by another ptk rank 0 (host .*; $theirs), this job being $mine" \
  "$log" || { cat "$log"; fail "the second job's rank 0 did not name the first job"; }
grep -q "rendezvous: the rank 0 at .*:$port is another job's (host .*; $theirs), not this rank's ($mine)" "$log" ||
  { cat "$log"; fail "the second job's rank 1 did not name the first job"; }
seen=$(lines "$metrics")
end=$((SECONDS + 120)); until [ "$(lines "$metrics")" -gt "$seen" ] || [ $SECONDS -ge $end ]; do sleep 0.1; done
[ "$(lines "$metrics")" -gt "$seen" ] || fail "the first job stopped training"
[ "$(squeue -h -j "$first" -o %T)" = RUNNING ] || fail "the first job is not running"
scancel "$first"
echo "   second job FAILED at once naming SLURM_JOB_ID=$first; the first trained on"
echo "PASS"
