#!/usr/bin/env bash
# signal-stopped.sh - Slurm's signal to a training job's tasks (scancel --signal, as a pre-emption or
# sbatch --signal=SIG@T sends it), delivered while those tasks are stopped, so that it lands with the
# run's remaining iterations still ahead however fast the machine. Once FILE (the run's metrics.jsonl,
# a line per iteration) holds LINES lines, the ptk-train tasks get SIGSTOP at once (polled with shell
# builtins: within moments of that iteration, not after a Slurm round trip); then Slurm sends SIG, and
# once SIG is pending in every task they get SIGCONT (a stopped process takes a pending signal before
# it runs on: its handler sees it at that iteration). Sent without the stop, the signal reached the
# tasks after slurmctld, slurmd and slurmstepd had passed it on, while training went on.
#
# Usage: signal-stopped.sh JOBID SIGNAL TASKS FILE LINES   (SIGNAL: TERM, USR1, ...; TASKS: the ranks)
# Exit: 0 when SIGNAL was pending in all TASKS ptk-train tasks; 1 otherwise (what went wrong on
# stderr). Needs SLURM_CONF (start-slurm.sh) and root (to stop the tasks).
set -uo pipefail
[ $# = 5 ] || { echo "usage: $0 JOBID SIGNAL TASKS FILE LINES" >&2; exit 64; }
id=$1 sig=$2 tasks=$3 file=$4 want=$5
num=$(kill -l "$sig") || exit 64
# The job's ptk-train tasks, once all TASKS run (up to 90 s).
pids=()
end=$((SECONDS + 90))
while :; do
  pids=()
  for p in $(scontrol listpids "$id" 2>/dev/null | awk 'NR > 1 { print $1 }'); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = ptk-train ] && pids+=("$p")
  done
  [ "${#pids[@]}" = "$tasks" ] && break
  if [ $SECONDS -ge $end ]; then
    echo "signal-stopped: job $id has ${#pids[@]} ptk-train task(s) after 90 s, expected $tasks" >&2
    scontrol listpids "$id" >&2
    exit 1
  fi
  sleep 0.1
done
# FILE's lines, counted with builtins only.
lines=0
count() {
  local l=()
  [ -f "$file" ] && mapfile -t l <"$file"
  lines=${#l[@]}
}
end=$((SECONDS + 90))
until count && [ "$lines" -ge "$want" ]; do
  if [ $SECONDS -ge $end ]; then
    echo "signal-stopped: $file holds $lines line(s) after 90 s, expected $want: training did not start" >&2
    exit 1
  fi
  sleep 0.01
done
trap 'kill -CONT "${pids[@]}" 2>/dev/null' EXIT
kill -STOP "${pids[@]}" || { echo "signal-stopped: the tasks ended before $want iterations" >&2; exit 1; }
scancel --signal="$sig" "$id" || exit 1
# The signal's bit in the process's shared pending set (ShdPnd, hexadecimal; bit N-1 for signal N).
pending() {
  local mask
  mask=$(sed -n 's/^ShdPnd:\t*//p' "/proc/$1/status" 2>/dev/null) || return 1
  [ -n "$mask" ] && (((16#$mask >> (num - 1)) & 1))
}
end=$((SECONDS + 60))
for p in "${pids[@]}"; do
  until pending "$p"; do
    if [ $SECONDS -ge $end ]; then
      echo "signal-stopped: SIG$sig not pending in ptk-train pid $p after 60 s" >&2
      exit 1
    fi
    sleep 0.05
  done
done
exit 0  # the trap continues the tasks
