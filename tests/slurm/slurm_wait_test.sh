#!/usr/bin/env bash
# tests/slurm/slurm-wait.sh (the Slurm tests' and docs/cluster.md's wait) against a fake squeue and scontrol:
# a failed squeue (slurmctld slow to answer on a loaded machine: a socket timeout) is asked again, not
# taken for a finished job; only "Invalid job id" is; a failed scontrol is asked again too. No Slurm needed.
# Usage: slurm_wait_test.sh SOURCE_DIR
set -euo pipefail
SRC=$1
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
mkdir -p "$T/bin"
# squeue: the Nth call does what line N of $T/squeue.plan says (the last line from then on): "timeout" fails
# as slurmctld does when it does not answer in time, "invalid" as for a purged id, anything else is listed.
# scontrol: likewise from $T/scontrol.plan; "job" is the job's record: COMPLETED once squeue no longer lists
# it, RUNNING before.
cat > "$T/bin/squeue" <<'SH'
#!/bin/sh
n=$(($(cat "$FAKE/squeue.n" 2>/dev/null || echo 0) + 1)); echo "$n" > "$FAKE/squeue.n"
step=$(sed -n "${n}p" "$FAKE/squeue.plan"); [ -n "$step" ] || step=$(tail -1 "$FAKE/squeue.plan")
case $step in
  timeout) echo "squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1 ;;
  invalid) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;
  empty) ;;
  *) echo "$step" ;;
esac
SH
cat > "$T/bin/scontrol" <<'SH'
#!/bin/sh
n=$(($(cat "$FAKE/scontrol.n" 2>/dev/null || echo 0) + 1)); echo "$n" > "$FAKE/scontrol.n"
step=$(sed -n "${n}p" "$FAKE/scontrol.plan"); [ -n "$step" ] || step=$(tail -1 "$FAKE/scontrol.plan")
case $step in
  timeout) echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1 ;;
  invalid) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;
  job) if [ "$(sed -n "$(cat "$FAKE/squeue.n")p" "$FAKE/squeue.plan")" = empty ]; then state=COMPLETED; else state=RUNNING; fi
       echo "JobId=42 JobName=x JobState=$state Reason=None ExitCode=0:0" ;;
esac
SH
chmod +x "$T/bin/squeue" "$T/bin/scontrol"
wait_job() {  # SQUEUE_PLAN SCONTROL_PLAN (steps separated by commas): slurm-wait's output in $out, exit code in $rc
  rm -f "$T"/*.n
  tr , '\n' <<<"$1" > "$T/squeue.plan"
  tr , '\n' <<<"$2" > "$T/scontrol.plan"
  set +e
  out=$(FAKE=$T PATH="$T/bin:$PATH" bash "$SRC/tests/slurm/slurm-wait.sh" -t 60 42 2>&1)
  rc=$?
  set -e
}
# A socket timeout while the job runs: asked again; the job is seen to complete.
wait_job "timeout,RUNNING None,RUNNING None,empty" "job"
[ "$rc" = 0 ] && [ "$out" = "42 COMPLETED 0:0 None" ] || fail "a failed squeue ended the wait: rc $rc: $out"
[ "$(cat "$T/squeue.n")" = 4 ] || fail "squeue asked $(cat "$T/squeue.n") times, want 4"
# scontrol failing once after the job ended: asked again.
wait_job "empty" "timeout,job"
[ "$rc" = 0 ] && [ "$out" = "42 COMPLETED 0:0 None" ] || fail "a failed scontrol: rc $rc: $out"
# An id slurmctld does not know: finished at once, reported as unknown.
wait_job "invalid" "invalid"
[ "$rc" = 1 ] && [ "$out" = "42 UNKNOWN - purged-or-invalid" ] || fail "an invalid id: rc $rc: $out"
[ "$(cat "$T/squeue.n")" = 1 ] && [ "$(cat "$T/scontrol.n")" = 1 ] || fail "an invalid id was asked again"
echo "slurm_wait_test: OK"
