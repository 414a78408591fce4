#!/usr/bin/env bash
# Every shell script that answers --help (scripts/, slurm/, k8s/) prints its header comment, whole and
# nothing else: build.sh, data-path.sh and submit-pipeline.sh printed a fixed range of lines that ran
# into their code (`set -euo pipefail`), gpu-run.sh's range stopped three lines short of its header; and
# README's main job took `--help` for its output directory (and ran, sudo apt-get included), test.sh ran
# the whole suite: an unknown option there is a usage error (exit 2) before anything runs.
# Usage: script_help_test.sh SOURCE_DIR
set -uo pipefail
SRC=$1
fail=0 n=0
for s in "$SRC"/scripts/*.sh "$SRC"/slurm/*.sh "$SRC"/k8s/*.sh; do
  grep -q -- '-h|--help)' "$s" || continue
  n=$((n + 1))
  name=${s#"$SRC"/}
  # The header: the comment lines from line 2 up to the first line that is not a comment.
  want=$(awk 'NR == 1 { next } /^#/ { print; next } { exit }' "$s")
  got=$(bash "$s" --help 2>&1)
  rc=$?
  [ "$rc" = 0 ] || { echo "FAIL: $name --help exits $rc: $got"; fail=1; continue; }
  [ -n "$want" ] || { echo "FAIL: $name has no header comment to print"; fail=1; continue; }
  [ "$got" = "$want" ] || {
    echo "FAIL: $name --help is not its header comment:"
    diff <(echo "$want") <(echo "$got") | head -10
    fail=1
  }
done
[ "$n" -ge 7 ] || { echo "FAIL: only $n scripts answer --help (build.sh, gpu-run.sh, install-deps.sh, run-main-job.sh,
  test.sh, data-path.sh, submit-pipeline.sh did)"; fail=1; }
# An unknown option is a usage error (exit 2) naming it, never a path or ignored: status.sh ignored every
# argument (`status.sh --help` said only that STAGE_PATH was unset, `--bogus` ran), make-portable.sh took
# --help for OUT_DIR (built, then wrote the tree into ./--help), gpu-pack.sh and check-rules.sh passed
# it to cd ("cd: --: invalid option"), and these five had no --help.
W=$(mktemp -d)
for s in slurm/status.sh scripts/make-portable.sh scripts/gpu-pack.sh scripts/check-rules.sh k8s/render.sh; do
  grep -q -- '-h|--help)' "$SRC/$s" || { echo "FAIL: $s does not answer --help"; fail=1; }
  out=$(cd "$W" && STAGE_PATH="$W/stage" PTK_SKIP_BUILD=1 timeout 60 bash "$SRC/$s" --bogus "$W/none" 2>&1)
  rc=$?
  [ "$rc" = 2 ] && [[ $out == *"--bogus"* ]] || { echo "FAIL: $s --bogus: rc $rc, expected a usage error: ${out:0:300}"; fail=1; }
done
[ ! -e "$SRC/--bogus" ] && [ ! -e "$SRC/--help" ] && [ -z "$(ls -A "$W")" ] ||
  { echo "FAIL: an option was taken for a path: $(ls -A "$W") $(ls -d "$SRC"/--* 2>/dev/null)"; fail=1; }
rm -rf "$W"
[ "$n" -ge 12 ] || { echo "FAIL: only $n scripts answer --help (12 did)"; fail=1; }
# A job script run outside a Slurm job (bash slurm/X.sbatch, to try it; no scontrol to say where it came
# from) ended with exit 1 and no word under set -e (train.sbatch: "config.sh: No such file" and
# "command not found"): it finds config.sh beside itself, which names what is missing (STAGE_PATH here).
# Outside a job it does not ask scontrol at all (it asked about "job 0": 9 s of retries when the
# configured controller was down, slurm_status_test's stage scripts past its time limit); in a job
# (SLURM_JOB_ID) it asks about that job. A stand-in scontrol on PATH records what it is asked.
W=$(mktemp -d)
printf '#!/bin/sh\necho "$*" >> "%s/asked"\nexit 1\n' "$W" > "$W/scontrol"
chmod +x "$W/scontrol"
for s in "$SRC"/slurm/*.sbatch; do
  out=$(cd "$SRC" && env -u STAGE_PATH -u PTK_SLURM_DIR -u SLURM_JOB_ID PATH="$W:$PATH" timeout 60 bash "${s#"$SRC"/}" 2>&1)
  rc=$?
  [ "$rc" = 2 ] && [[ $out == *"STAGE_PATH is not set"* ]] ||
    { echo "FAIL: bash ${s#"$SRC"/} outside Slurm: rc $rc, expected config.sh's STAGE_PATH error: ${out:0:300}"; fail=1; }
  [ ! -e "$W/asked" ] || { echo "FAIL: bash ${s#"$SRC"/} outside Slurm asked scontrol: $(cat "$W/asked")"; fail=1; }
  rm -f "$W/asked"
  out=$(cd "$SRC" && env -u STAGE_PATH -u PTK_SLURM_DIR SLURM_JOB_ID=7 PATH="$W:$PATH" timeout 60 bash "${s#"$SRC"/}" 2>&1)
  [ "$(cat "$W/asked" 2>/dev/null)" = "show job 7" ] ||
    { echo "FAIL: ${s#"$SRC"/} in job 7 did not ask scontrol about it: $(cat "$W/asked" 2>/dev/null) ${out:0:300}"; fail=1; }
  rm -f "$W/asked"
done
rm -rf "$W"
# submit-pipeline.sh's --dry-run misspelt (--dryrun, -n) said only "unknown argument": now the flag meant;
# --from=STAGE is read as --from STAGE.
out=$(STAGE_PATH=/nonexistent timeout 60 bash "$SRC/slurm/submit-pipeline.sh" --dryrun 2>&1)
rc=$?
[ "$rc" = 2 ] && [[ $out == *"unknown argument: --dryrun; did you mean --dry-run?"* ]] ||
  { echo "FAIL: submit-pipeline.sh --dryrun: rc $rc: ${out:0:300}"; fail=1; }
out=$(STAGE_PATH=/nonexistent timeout 60 bash "$SRC/slurm/submit-pipeline.sh" --from=bogus 2>&1)
[[ $out == *"--from bogus"* || $out == *"bogus"*"one of"* ]] ||
  { echo "FAIL: submit-pipeline.sh --from=bogus was not read as --from bogus: ${out:0:300}"; fail=1; }
# (Not test.sh's: were its check gone, that would start the whole suite.) The main job, were its check
# gone, would fail at once here: nothing installed or built, no programs.
W=$(mktemp -d)
out=$(cd "$W" && PTK_SKIP_INSTALL=1 PTK_SKIP_BUILD=1 PTK_BIN="$W/none" timeout 60 bash "$SRC/scripts/run-main-job.sh" --hepl 2>&1)
rc=$?
[ "$rc" = 2 ] && [[ $out == *"unknown option --hepl"* ]] && [ ! -e "$SRC/--hepl" ] ||
  { echo "FAIL: run-main-job.sh --hepl: rc $rc, expected a usage error: ${out:0:300}"; fail=1; }
rm -rf "$W"
[ "$fail" = 0 ] && echo "script_help_test: $n scripts print their header comment for --help"
exit "$fail"
