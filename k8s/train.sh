#!/usr/bin/env bash
# ptk-train in a Kubernetes pod (k8s/pytorchjob.yaml-template, k8s/train-job.yaml-template; installed in
# the image as /opt/ptk/share/ptk/k8s/train.sh). The pod's arguments are ptk-train's flags; this adds
# the data flags slurm/train.sbatch gives it (slurm/data-path.sh --train-args: the plan's chunks and the
# validation split) and TRAIN_EXTRA_ARGS, runs ptk-train as its child, passing SIGTERM on, and exits 0
# only when training is complete.
# Why: a rank stopped by SIGTERM (preemption, eviction, a drained node) saves a checkpoint
# (--exit-signal-handler) and exits 0, and so do all the other ranks, which agree to stop with it.
# Exit 0 would make their pods Succeeded, and the Job or the PyTorchJob would take those ranks as done
# and never run them again. ptk-train itself says whether training is complete: under
# PTK_TRAIN_INCOMPLETE_EXIT=75 a run that stopped before its last iteration (a signal, --exit-interval,
# --exit-duration-in-mins) exits 75 on every rank, whatever flags set the run's length (--train-iters,
# --train-samples, an abbreviation ptk-train accepts such as --train-it). This then exits 143 for its
# own SIGTERM and 75 otherwise, so that the rank runs again and resumes (--load).
# Environment: STAGE_PATH, DATASET_FOLDER_NAME, VALID_SUBDIR and PTK_BIN (read by slurm/config.sh),
# TRAIN_EXTRA_ARGS; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for ptk-train.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# One argument per line into an array: the words of --train-args split a STAGE_PATH holding a space
# (env.sh allows one) into two paths, and ptk-train failed in the pod.
data_lines=$(bash "$here/../slurm/data-path.sh" --train-args-lines) || exit
mapfile -t data <<<"$data_lines"
stopped=0 child=""
# The trap before the child: a SIGTERM between its start and the trap would end this script alone,
# leaving ptk-train running unsignalled until the pod's SIGKILL (no checkpoint). One that comes before
# `child` is set is passed on just after.
trap 'stopped=1; [ -z "$child" ] || kill -TERM "$child" 2>/dev/null' TERM INT
# shellcheck disable=SC2086  # TRAIN_EXTRA_ARGS is a list of words
PTK_TRAIN_INCOMPLETE_EXIT=75 "${PTK_BIN:-/opt/ptk/bin}/ptk-train" "$@" "${data[@]}" ${TRAIN_EXTRA_ARGS:-} &
child=$!
[ "$stopped" = 0 ] || kill -TERM "$child" 2>/dev/null
while :; do
  wait "$child"
  rc=$?
  kill -0 "$child" 2>/dev/null || break  # else the trap cut the wait short: wait for the save
done
if [ "$rc" = 75 ]; then  # stopped before the last iteration, a checkpoint saved
  code=$([ "$stopped" = 1 ] && echo 143 || echo 75)
  echo "train.sh: ptk-train stopped before its last iteration$([ "$stopped" = 1 ] && echo " on SIGTERM")" \
       "with a checkpoint saved; exit $code, so that this rank runs again and resumes" >&2
  exit "$code"
fi
# 0: training is complete (a SIGTERM that came after the last iteration changes nothing); else failed.
exit "$rc"
