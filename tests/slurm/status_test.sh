#!/usr/bin/env bash
# slurm/status.sh and the stage scripts read the concat plan, never a glob: a 2-chunk
# plan over a directory that held a 4-chunk run reports the leftovers as errors, counts only the
# plan's chunks, and training is given only the plan's datasets. No Slurm needed.
# Usage: status_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
BIN=$1
SRC=$2
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
D=$W/stage/slimpajama
mkdir -p "$W/in" "$D/preprocessed"
for i in 0 1 2 3 4 5 6 7; do printf '{"text": "document %d of the status test"}\n' "$i" > "$W/in/s$i.jsonl"; done
tokenize_plan() {
  for c in $("$BIN/ptk-concat" list --plan "$D/chunks/concat-plan.json"); do
    n=$(basename "$c" .jsonl)
    "$BIN/ptk-tokenize" --quiet --input "$c" --output-prefix "$D/preprocessed/$n" >/dev/null
    cat "$c.ptk-done" > "$D/preprocessed/$n.ptk-tokenized"
  done
}
"$BIN/ptk-concat" --quiet --input "$W/in" --output-dir "$D/chunks" --chunks 4 >/dev/null 2>&1
tokenize_plan
# The rerun with fewer chunks removes the old plan's chunks...
out=$("$BIN/ptk-concat" --quiet --input "$W/in" --output-dir "$D/chunks" --chunks 2 2>&1)
echo "$out" | grep -q "removed 2 chunks of an earlier plan" || fail "no removal reported: $out"
[ ! -e "$D/chunks/train_02.jsonl" ] || fail "train_02.jsonl kept"
[ "$("$BIN/ptk-concat" list --plan "$D/chunks/concat-plan.json" | wc -l)" = 2 ] || fail "ptk-concat list"
# ... and status says the old datasets are not this plan's, and that the rebuilt chunks' datasets are stale.
set +e
st=$(PTK_BIN=$BIN STAGE_PATH=$W/stage bash "$SRC/slurm/status.sh" 2>&1)
rc=$?
set -e
echo "$st"
[ "$rc" = 1 ] || fail "status exit $rc, want 1"
echo "$st" | grep -q "concat       2 of 2 chunks built" || fail "concat line"
echo "$st" | grep -q "tokenize     0 of 2 datasets complete" || fail "stale datasets counted as complete"
# Regression: they were listed as "missing" though there; they are named as datasets to be made again.
echo "$st" | grep -q "tokenize .*(there but not made from the current chunks, or damaged; tokenize redoes them: train_00 train_01)" ||
  fail "stale datasets not named as such: $st"
echo "$st" | grep -q "missing:" && fail "stale datasets called missing: $st"
echo "$st" | grep -q "error: 2 datasets of no chunk in the plan" || fail "stray datasets not reported"
echo stray > "$D/chunks/train_09.jsonl"
st=$(PTK_BIN=$BIN STAGE_PATH=$W/stage bash "$SRC/slurm/status.sh" 2>&1 || true)
echo "$st" | grep -q "error: 1 chunk files not in the plan" || fail "stray chunk not reported: $st"
rm "$D/chunks/train_09.jsonl"
tokenize_plan
st=$(PTK_BIN=$BIN STAGE_PATH=$W/stage bash "$SRC/slurm/status.sh" 2>&1 || true)
echo "$st" | grep -q "tokenize     2 of 2 datasets complete" || fail "after retokenizing: $st"
# What train.sbatch gives --data-path: the plan's two datasets only, in plan order.
PLAN_FILE=$D/chunks/concat-plan.json PREPROCESSED_DIR=$D/preprocessed PTK_BIN=$BIN
mapfile -t prefixes < <(eval "$(grep -m1 'mapfile -t prefixes' "$SRC/slurm/train.sbatch" | sed 's/^[[:space:]]*mapfile -t prefixes < <(\(.*\))$/\1/')")
[ "${#prefixes[@]}" = 2 ] || fail "train would read ${#prefixes[@]} datasets: ${prefixes[*]}"
[ "${prefixes[1]}" = "$D/preprocessed/train_01_text_document" ] || fail "train prefixes: ${prefixes[*]}"
# data-path.sh --train-args (what k8s/pytorchjob.yaml-template gives ptk-train): the same datasets.
ta=$(PTK_BIN=$BIN STAGE_PATH=$W/stage bash "$SRC/slurm/data-path.sh" --train-args)
[ "$ta" = "--data-path ${prefixes[*]}" ] || fail "data-path --train-args: $ta"
# --train-args-lines (k8s/train.sh's, for mapfile): one argument per line, so that a STAGE_PATH with a
# space stays one path (the words of --train-args split it, and ptk-train failed in the pod).
mapfile -t tal < <(PTK_BIN=$BIN STAGE_PATH=$W/stage bash "$SRC/slurm/data-path.sh" --train-args-lines)
[ "${tal[*]}" = "--data-path ${prefixes[*]}" ] && [ "${#tal[@]}" = 3 ] || fail "data-path --train-args-lines: ${tal[*]}"
mkdir -p "$W/sp ace" && mv "$W/stage" "$W/sp ace/stage"
mapfile -t tal < <(PTK_BIN=$BIN STAGE_PATH="$W/sp ace/stage" bash "$SRC/slurm/data-path.sh" --train-args-lines)
[ "${#tal[@]}" = 3 ] && [ "${tal[2]}" = "$W/sp ace/stage/slimpajama/preprocessed/train_01_text_document" ] ||
  fail "data-path --train-args-lines under a path with a space: ${tal[*]}"
mv "$W/sp ace/stage" "$W/stage"
# data-path.sh: the plan's datasets as Megatron's --data-path / NeMo's data_prefix.
dp=$(PTK_BIN=$BIN STAGE_PATH=$W/stage bash "$SRC/slurm/data-path.sh")
[ "$dp" = "0.5 $D/preprocessed/train_00_text_document 0.5 $D/preprocessed/train_01_text_document" ] || fail "data-path: $dp"
dpn=$(PTK_BIN=$BIN STAGE_PATH=$W/stage bash "$SRC/slurm/data-path.sh" --weights tokens --format nemo)
[[ "$dpn" =~ ^\[0\.5,$D/preprocessed/train_00_text_document,0\.5,$D/preprocessed/train_01_text_document\]$ ]] ||
  fail "data-path --format nemo: $dpn"
# The stage scripts outside Slurm, with a validation file whose name holds a quote and a space:
# tokenize.sbatch stamps the validation split with a digest of its files' sidecars, which it read
# through xargs (quotes and blanks are special to it): 'unmatched single quote', exit 1 after the chunks.
V=$W/vstage/slimpajama
mkdir -p "$V/raw/train" "$V/raw/validation"
printf '{"text": "a training document"}\n' | gzip > "$V/raw/train/t0.jsonl.gz"
printf '{"text": "a held-out document"}\n' | gzip > "$V/raw/validation/it's a.jsonl.gz"
for s in extract concat-plan concat tokenize; do
  out=$(PTK_BIN=$BIN STAGE_PATH=$W/vstage CONCAT_CHUNKS=1 CPUS_PER_TASK=1 bash "$SRC/slurm/$s.sbatch" 2>&1) ||
    fail "$s.sbatch with a validation file named \"it's a\": $out"
done
st=$(PTK_BIN=$BIN STAGE_PATH=$W/vstage CONCAT_CHUNKS=1 bash "$SRC/slurm/status.sh" 2>&1 || true)
echo "$st" | grep -q "tokenize     2 of 2 datasets complete (incl. validation)" || fail "validation split: $st"
# A dataset damaged in place (same size) after it was made: tokenize.sbatch saw it fail --verify and ran
# ptk-tokenize again, which found its sidecar matching ('up to date, not rewritten'), exit 0: the task
# passed, the damage stayed, and every resubmission did the same. It is tokenized again now.
bin=$V/preprocessed/train_00_text_document.bin
printf 'XY' | dd of="$bin" bs=1 seek=2 conv=notrunc 2>/dev/null
"$BIN/ptk-inspect" "${bin%.bin}" --verify >/dev/null 2>&1 && fail "the damage went unseen"
out=$(PTK_BIN=$BIN STAGE_PATH=$W/vstage CONCAT_CHUNKS=1 CPUS_PER_TASK=1 bash "$SRC/slurm/tokenize.sbatch" 2>&1) ||
  fail "tokenize.sbatch over a damaged dataset: $out"
"$BIN/ptk-inspect" "${bin%.bin}" --verify >/dev/null 2>&1 || fail "tokenize.sbatch left the damaged dataset: $out"
echo "$out" | grep -q "tokenize: validation already done" || fail "the whole validation split redone: $out"
# submit-pipeline.sh --dry-run without a controller: a failing sinfo and no sbatch.
mkdir -p "$W/fakebin"
printf '#!/bin/sh\necho "sinfo: error: Unable to contact slurm controller" >&2\nexit 1\n' > "$W/fakebin/sinfo"
chmod +x "$W/fakebin/sinfo"
for t in bash sed tr grep head mkdir dirname cat printf env; do ln -sf "$(command -v $t)" "$W/fakebin/$t" 2>/dev/null || true; done
dry=$(PATH=$W/fakebin PTK_BIN=$BIN STAGE_PATH=$W/stage2 bash "$SRC/slurm/submit-pipeline.sh" --dry-run 2>&1) ||
  fail "dry-run without a controller failed: $dry"
echo "$dry" | grep -q "partitions not checked" || fail "dry-run note missing: $dry"
[ "$(echo "$dry" | grep -c '^sbatch ')" = 6 ] || fail "dry-run printed no sbatch lines: $dry"
# A wrong partition names the variable to set (HyperPod's only partition is dev).
printf '#!/bin/sh\necho "dev*"\n' > "$W/fakebin/sinfo"
bad=$(PATH=$W/fakebin PTK_BIN=$BIN STAGE_PATH=$W/stage2 bash "$SRC/slurm/submit-pipeline.sh" --dry-run 2>&1) && fail "accepted"
echo "$bad" | grep -q "set DOWNLOAD_PARTITION to one of: dev" || fail "partition message: $bad"
ok=$(PATH=$W/fakebin PTK_BIN=$BIN STAGE_PATH=$W/stage2 DOWNLOAD_PARTITION=dev PREP_PARTITION=dev TRAIN_PARTITION=dev \
     bash "$SRC/slurm/submit-pipeline.sh" --dry-run 2>&1) || fail "dev partitions refused: $ok"
# TRAIN_ARGS giving a flag train.sbatch sets after it (ptk-train would take the script's value without a
# word): refused by submit-pipeline.sh and by train.sbatch submitted alone, naming the variable to set.
for given in "--train-iters 500:TRAIN_ITERS" "--train-samples=4000:TRAIN_ITERS" "--save ck:CKPT_DIR" \
             "--data-path 1 x:DATA_PATH"; do
  for script in submit-pipeline.sh train.sbatch; do
    set +e
    out=$(PATH=$W/fakebin PTK_BIN=$BIN PTK_SLURM_DIR=$SRC/slurm STAGE_PATH=$W/stage2 DOWNLOAD_PARTITION=dev \
          PREP_PARTITION=dev TRAIN_PARTITION=dev TRAIN_ARGS="--lr 1e-3 ${given%%:*}" \
          bash "$SRC/slurm/$script" --dry-run 2>&1)
    rc=$?
    set -e
    flag=${given%% *}
    [ "$rc" = 2 ] && [[ $out == *"TRAIN_ARGS gives ${flag%%=*}, which train.sbatch sets itself: "*"${given##*:}"* ]] ||
      fail "$script with TRAIN_ARGS ${given%%:*}: rc $rc: $out"
  done
done
# A flag given without its value (the last word) is a usage error saying so, not a silent exit 1.
for cmd in "submit-pipeline.sh --from" "data-path.sh --weights" "data-path.sh --format"; do
  set +e
  # shellcheck disable=SC2086
  out=$(PTK_BIN=$BIN STAGE_PATH=$W/stage bash "$SRC"/slurm/$cmd 2>&1)
  rc=$?
  set -e
  [ "$rc" = 2 ] && [[ $out == *"${cmd#* } needs a"* ]] || fail "$cmd: rc $rc: $out"
done
help=$(bash "$SRC/slurm/submit-pipeline.sh" --help)
echo "$help" | grep -q "Usage: slurm/submit-pipeline.sh" || fail "--help: $help"
# cmake --install gives a relocatable tree: installed, moved elsewhere, it runs, and its
# Slurm scripts find its binaries without PTK_BIN.
cmake --install "$BIN/.." --prefix "$W/inst" >/dev/null || fail "cmake --install"
mv "$W/inst" "$W/moved"
M=$W/moved
"$M/bin/ptk-tokenize" --quiet --input "$W/in/s0.jsonl" --output-prefix "$W/inst_out" \
  --vocab-file "$M/share/ptk/gpt2/gpt2-vocab.json" --merge-file "$M/share/ptk/gpt2/gpt2-merges.txt" >/dev/null 2>&1 ||
  fail "the moved ptk-tokenize"
"$M/bin/ptk-inspect" --verify "$W/inst_out_text_document" >/dev/null || fail "the moved ptk-inspect"
printf '#!/bin/sh\necho "htc"; echo "hpc*"; echo "gpu"\n' > "$W/fakebin/sinfo"
moved=$(env -u PTK_BIN PATH=$W/fakebin STAGE_PATH=$W/stage3 bash "$M/share/ptk/slurm/submit-pipeline.sh" --dry-run 2>&1) ||
  fail "submit-pipeline from the moved tree: $moved"
echo "$moved" | grep -q "sbatch .*$M/share/ptk/slurm/download.sbatch" || fail "moved tree's sbatch lines: $moved"
# status.sh judges a submission by what was submitted (recorded beside the job ids), not by this
# shell's variables, and says when no checkpoint exists yet. A fake sbatch takes the submission; a fake
# scontrol answers for its job as slurmctld does for one it no longer knows. (status.sh asked the real
# scontrol, found further on PATH, about each of the 6 jobs: whatever controller this machine's
# configuration names, or a DNS SRV lookup without one. With SLURM_CONF naming a controller that is
# down, each call took 18 s of retries, and the test ran past its 120 s.)
printf '#!/bin/sh\necho 4242\n' > "$W/fakebin/sbatch"
printf '#!/bin/sh\necho "htc"; echo "hpc*"; echo "gpu"\n' > "$W/fakebin/sinfo"
printf '#!/bin/sh\necho "slurm_load_jobs error: Invalid job id specified" >&2\nexit 1\n' > "$W/fakebin/scontrol"
chmod +x "$W/fakebin/sbatch" "$W/fakebin/sinfo" "$W/fakebin/scontrol"
for t in tee mv date rm; do ln -sf "$(command -v $t)" "$W/fakebin/$t" 2>/dev/null || true; done
sub=$(PATH=$W/fakebin PTK_BIN=$BIN STAGE_PATH=$W/stage4 TRAIN_ITERS=10 bash "$SRC/slurm/submit-pipeline.sh" 2>&1) ||
  fail "submit with a fake sbatch: $sub"
[ -f "$W/stage4/results/submitted-settings.sh" ] || fail "no submitted-settings.sh beside jobs.txt"
st=$(env -u TRAIN_ITERS PATH=$W/fakebin:$PATH PTK_BIN=$BIN STAGE_PATH=$W/stage4 bash "$SRC/slurm/status.sh" 2>&1 || true)
echo "$st" | grep -q "train        no checkpoint yet (training to iteration 10;" || fail "no checkpoint: $st"
[ "$(echo "$st" | grep -c "job 4242 *finished (no longer known to slurmctld)")" = 6 ] || fail "the jobs: $st"
# A controller that is down: each scontrol call waited its MessageTimeout of retries (18 s) and the
# empty answer read as a finished job, for each of the 6 jobs. It is asked once, and said in one line.
printf '#!/bin/sh\necho x >> "%s"\necho "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2\nexit 1\n' \
  "$W/scontrol-calls" > "$W/fakebin/scontrol"
st=$(PATH=$W/fakebin:$PATH PTK_BIN=$BIN STAGE_PATH=$W/stage4 bash "$SRC/slurm/status.sh" 2>&1 || true)
[ "$(wc -l < "$W/scontrol-calls")" = 1 ] || fail "scontrol asked $(wc -l < "$W/scontrol-calls") times with the controller down: $st"
[ "$(echo "$st" | grep -c "the Slurm controller does not answer (scontrol: slurm_load_jobs error: Unable to contact")" = 1 ] ||
  fail "the controller's state not said once: $st"
echo "$st" | grep -q "finished (no longer known" && fail "jobs called finished with the controller down: $st"
mkdir -p "$W/stage4/checkpoints"
echo 10 > "$W/stage4/checkpoints/latest_checkpointed_iteration.txt"
st=$(TRAIN_ITERS=100 PATH=$W/fakebin:$PATH PTK_BIN=$BIN STAGE_PATH=$W/stage4 bash "$SRC/slurm/status.sh" 2>&1 || true)
echo "$st" | grep -q "train        checkpoint at iteration 10 of 10 " || fail "judged by this shell's TRAIN_ITERS: $st"
echo "$st" | grep -q "settings: as submitted" || fail "status does not say it reads the submission: $st"
# Extracted files whose names hold a quote, a tab or a newline count once each, and a changed input is
# seen as stale: status.sh read names and sidecars line by line (a newline made two inputs of one; a quote,
# JSON-escaped in the sidecar, hid the sidecar's input: "4 of 5 files extracted", and no stale one).
Q=$W/qstage/slimpajama/raw/train
mkdir -p "$Q"
for n in 'q"uote' "$(printf 'ta\tb')" "$(printf 'new\nline')" plain; do
  printf '{"text": "%s"}\n' "doc" | gzip > "$Q/$n.jsonl.gz"
done
out=$(PTK_BIN=$BIN STAGE_PATH=$W/qstage bash "$SRC/slurm/extract.sbatch" 2>&1) || fail "extract.sbatch: $out"
st=$(PTK_BIN=$BIN STAGE_PATH=$W/qstage bash "$SRC/slurm/status.sh" 2>&1 || true)
echo "$st" | grep -q "^extract      4 of 4 files extracted$" || fail "names with a quote, tab, newline: $st"
touch -d '2020-01-02' "$Q/q\"uote.jsonl.gz" "$Q/new"*
st=$(PTK_BIN=$BIN STAGE_PATH=$W/qstage bash "$SRC/slurm/status.sh" 2>&1 || true)
echo "$st" | grep -q "^extract      2 of 4 files extracted, 2 stale (the input changed since)$" ||
  fail "changed inputs with a quote, a newline in their names: $st"
echo "status_test: OK"
