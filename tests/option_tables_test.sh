#!/usr/bin/env bash
# Every tool's option table passes CheckOptionTable (long names, help text, no flag defined twice),
# every tool answers --help and --version with exit 0, and a one-dash long flag with the flag meant.
# Every tool's wrong flags and bad values exit 2 with "usage error: ...", whether the option table,
# the main or a library finds them (a usage error is a typed part of the status, common/status.h).
# --version names the commit (one of the source tree's where it is a git checkout), the build type
# and the backends built in (PTK_WITH_CUDA=ON: CUDA with its architectures, and NCCL).
# Usage: option_tables_test.sh BIN_DIR [SOURCE_DIR]
set -uo pipefail
BIN=$1 SRC=${2:-}
fail=0
for tool in ptk-download ptk-extract ptk-concat ptk-tokenize ptk-inspect ptk-merge ptk-train ptk-convert; do
  [ -x "$BIN/$tool" ] || { echo "FAIL: $tool not built"; fail=1; continue; }
  PTK_CHECK_OPTIONS=1 "$BIN/$tool" || { echo "FAIL: $tool's option table"; fail=1; }
  "$BIN/$tool" --help >/dev/null || { echo "FAIL: $tool --help"; fail=1; }
  # --version, and a long flag written with one dash names the flag meant (common/cli).
  v=$("$BIN/$tool" --version) && [[ $v == "$tool (ptk "* ]] || { echo "FAIL: $tool --version: $v"; fail=1; }
  commit=$(sed -n 's/^commit: \([^ ]*\)$/\1/p' <<<"$v")
  [ -n "$commit" ] || { echo "FAIL: $tool --version names no commit: $v"; fail=1; }
  if [ -n "$SRC" ] && [ -n "$commit" ] && [[ $commit != unknown ]] && git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$SRC" cat-file -e "${commit%-dirty}^{commit}" 2>/dev/null ||
      { echo "FAIL: $tool --version: $commit is no commit of $SRC"; fail=1; }
  fi
  grep -qE '^build type: [A-Za-z]+' <<<"$v" || { echo "FAIL: $tool --version names no build type: $v"; fail=1; }
  if [ "${PTK_WITH_CUDA:-OFF}" = ON ]; then
    grep -qE '^backends: CPU; CUDA [0-9.]+ for .*sm_[0-9]+.*; NCCL [0-9.]+$' <<<"$v" ||
      { echo "FAIL: $tool --version: no CUDA and NCCL backends: $v"; fail=1; }
  else
    grep -qx 'backends: CPU' <<<"$v" || { echo "FAIL: $tool --version: backends not 'CPU': $v"; fail=1; }
  fi
  out=$("$BIN/$tool" -version 2>&1); rc=$?
  [ "$rc" = 2 ] && [[ $out == *"unknown flag -version; did you mean --version?"* ]] ||
    { echo "FAIL: $tool -version (rc $rc): $out"; fail=1; }
done

T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/in"
echo '{"text": "a"}' >"$T/in/a.jsonl"
: >"$T/x.zst"
# usage CMD... -- EXPECTED: CMD (env VAR=... allowed) exits 2 printing "usage error: EXPECTED".
usage() {
  local cmd=() expected
  while [ "$1" != -- ]; do cmd+=("$1"); shift; done
  expected=$2
  out=$("${cmd[@]}" 2>&1 </dev/null); rc=$?
  [ "$rc" = 2 ] && [[ $out == *"usage error: $expected"* ]] ||
    { echo "FAIL: ${cmd[*]}: rc $rc, expected 2 and 'usage error: $expected': $out"; fail=1; }
}
for tool in ptk-download ptk-extract ptk-concat ptk-tokenize ptk-inspect ptk-merge ptk-train ptk-convert; do
  usage "$BIN/$tool" --no-such-flag -- "unknown flag --no-such-flag"
done
TRAIN=("$BIN/ptk-train" --num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8 --lr 1e-3
  --train-iters 1 --micro-batch-size 1)
# Bad values (the option table's validators).
usage "$BIN/ptk-download" --local-dir "$T/d" --repo a/b --jobs 0 -- '--jobs: must be an integer in [1, 256], not "0"'
usage "$BIN/ptk-extract" "$T/x.zst" --jobs abc -- '--jobs: must be an integer in [1, 2147483647], not "abc"'
usage "$BIN/ptk-concat" --input "$T/in" --output-dir "$T/c" --chunks 0 -- '--chunks: must be an integer in [1, 2147483647], not "0"'
# A negative chunk index was taken as 18446744073709551615 ("outside the plan's 2 chunks", exit 1).
usage "$BIN/ptk-concat" run --plan "$T/in/a.jsonl" --chunk-index -1 -- '--chunk-index: must be an integer in [0, 2147483647], not "-1"'
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --workers 0 -- "--workers: must be"
usage "$BIN/ptk-inspect" "$T/p" --sample-split train2 -- "--sample-split: train2 not in"
# --log-interval 0 or -5 printed no "Processed N documents" line at all (Megatron: 0 divides by zero).
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --log-interval 0 -- \
  '--log-interval: must be an integer in [1, 9223372036854775807], not "0"'
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --log-interval -5 -- '--log-interval: must be an integer in [1, '

# Out-of-range and non-finite values: one line naming the flag and the range (1e400 was "must be a
# number >= 0", 1e-400 taken as 0, a huge --workers "Could not convert").
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --max-bad-fraction 1e400 -- \
  '--max-bad-fraction: must be a number in [0, 1], not "1e400" (beyond a double'"'"'s range)'
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --max-bad-fraction 1e-400 -- \
  '--max-bad-fraction: must be a number in [0, 1], not "1e-400" (below a double'"'"'s range)'
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --max-bad-fraction nan -- \
  '--max-bad-fraction: must be a number in [0, 1], not "nan"'
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --resume-interval -inf -- \
  '--resume-interval: must be a number in [0, 1000000000], not "-inf"'
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --workers 99999999999999999999 -- \
  '--workers: must be an integer in [1, 65536], not "99999999999999999999"'
usage "$BIN/ptk-download" --local-dir "$T/d" --repo a/b --stall-timeout 1e300 -- \
  '--stall-timeout: must be a number in (0, 1000000000], not "1e300"'
usage "${TRAIN[@]}" --data-path "$T/p" --train-iters -0 -- '--train-iters: must be an integer in [1, 1099511627776], not "-0"'
usage "$BIN/ptk-merge" --output-prefix "$T/m" --inputs -- "--inputs: 1 required"
# ptk-inspect's sample flags as Megatron's: a seed outside numpy's [0, 2**32) was wrapped (4294967296
# gave seed 0's sample), negative counts taken, --doc -1 printed the summary.
usage "$BIN/ptk-inspect" "$T/p" --sample 0 --seq-length 8 --seed 4294967296 -- '--seed: must be an integer in [0, 4294967295], not "4294967296"'
usage "$BIN/ptk-inspect" "$T/p" --sample 0 --seq-length 8 --seed -1 -- '--seed: must be an integer in [0, 4294967295], not "-1"'
usage "$BIN/ptk-inspect" "$T/p" --sample 0 --seq-length 8 --train-samples -5 -- '--train-samples: must be an integer in [0, 9223372036854775807], not "-5"'
usage "$BIN/ptk-inspect" "$T/p" --sample 0 --seq-length -8 -- '--seq-length: must be an integer in [1, 2147483647], not "-8"'
usage "$BIN/ptk-inspect" "$T/p" --sample -1 --seq-length 8 -- '--sample: must be an integer in [0, 9223372036854775807], not "-1"'
usage "$BIN/ptk-inspect" "$T/p" --doc -1 -- '--doc: must be an integer in [0, 9223372036854775807], not "-1"'
usage "$BIN/ptk-convert" --loader xx --saver hf --load-dir "$T" --save-dir "$T/o" -- "--loader: xx not in"
usage "${TRAIN[@]}" --data-path "$T/p" --micro-batch-size 0 -- "--micro-batch-size: must be an integer in [1,"
usage "${TRAIN[@]}" --data-path "$T/p" --sample-prompt hi -- "--sample-prompt requires --sample-interval"
# Found by a main.
usage "$BIN/ptk-download" --local-dir "$T/d" -- "give either --repo or --url-list"
usage "$BIN/ptk-merge" --output-prefix "$T/m" -- "give --input DIR or --inputs PREFIX"
usage "$BIN/ptk-inspect" "$T/p" --sample 0 -- "--sample needs --seq-length"
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --dataset-impl lazy -- "--dataset-impl lazy"
usage env RANK=x WORLD_SIZE=2 "${TRAIN[@]}" --data-path "$T/p" -- 'RANK="x" is not an integer'
# Launch environments parsed strictly, each variable named (none may shrink the job to one rank).
usage env WORLD_SIZE=4294967297 RANK=0 "${TRAIN[@]}" --data-path "$T/p" -- \
  "WORLD_SIZE=4294967297 is outside [1, 2147483647]"
usage env WORLD_SIZE=2 RANK=4294967296 "${TRAIN[@]}" --data-path "$T/p" -- \
  "RANK=4294967296 is outside [0, 1] (WORLD_SIZE=2)"
usage env SLURM_PROCID=abc "${TRAIN[@]}" --data-path "$T/p" -- 'SLURM_PROCID="abc" is not an integer'
usage env SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=abc "${TRAIN[@]}" --data-path "$T/p" -- \
  'SLURM_STEP_NUM_TASKS="abc" is not an integer'
usage env SLURM_PROCID=1 SLURM_NTASKS=2 "${TRAIN[@]}" --data-path "$T/p" -- \
  "SLURM_PROCID=1 without SLURM_STEP_NUM_TASKS"
usage env SLURM_PROCID=2 SLURM_STEP_NUM_TASKS=2 "${TRAIN[@]}" --data-path "$T/p" -- \
  "SLURM_PROCID=2 is outside [0, 1] (SLURM_STEP_NUM_TASKS=2)"
# PTK_PROGRESS_INTERVAL: 0, negative and text fell back silently; 1e-9 printed without pause, and
# 1e300 or inf overflowed the clock (no wait: millions of log lines and a run that did not end).
usage env PTK_PROGRESS_INTERVAL=1e300 "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" -- \
  "PTK_PROGRESS_INTERVAL=1e300 is outside"
usage env PTK_PROGRESS_INTERVAL=0 "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" -- \
  "PTK_PROGRESS_INTERVAL=0 is outside [0.001, 86400] seconds"
usage env PTK_PROGRESS_INTERVAL=1e-9 "$BIN/ptk-extract" "$T/x.zst" -- "PTK_PROGRESS_INTERVAL=1e-9 is outside"
usage env PTK_PROGRESS_INTERVAL=inf "$BIN/ptk-concat" --input "$T/in" --output-dir "$T/c" -- \
  'PTK_PROGRESS_INTERVAL="inf" is not a number of seconds'
usage env PTK_PROGRESS_INTERVAL=-5 "$BIN/ptk-download" --local-dir "$T/d" --repo a/b -- "PTK_PROGRESS_INTERVAL=-5 is outside"
usage env WORLD_SIZE=2 RANK=0 MASTER_PORT=0x50 "${TRAIN[@]}" --data-path "$T/p" -- 'MASTER_PORT="0x50" is not an integer'
# Numbers on the command line are decimal: no hex, octal, inf or nan (CLI11 read 0x10 as 16,
# 010 as 8). A flag's own range check may name the value first; either way it is refused.
usage "${TRAIN[@]}" --data-path "$T/p" --sample-interval 1 --sample-temperature 0x10 -- \
  '--sample-temperature: "0x10" is not a decimal number'
usage "${TRAIN[@]}" --data-path "$T/p" --lr 0x1p-3 -- '--lr: "0x1p-3" is not a decimal number'
usage "${TRAIN[@]}" --data-path "$T/p" --lr inf -- '--lr: must be a finite number >= 0, not "inf"'
usage "${TRAIN[@]}" --data-path "$T/p" --clip-grad nan -- '--clip-grad: must be a finite number >= 0, not "nan"'
usage "${TRAIN[@]}" --data-path "$T/p" --seed 0x10 -- '--seed: must be an integer in'
usage "${TRAIN[@]}" --data-path "$T/p" --seed 010 -- '--seed: "010" has a leading zero (numbers are decimal: write 10)'
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --workers 0x2 -- \
  '--workers: must be an integer in [1, 65536], not "0x2"'
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --max-bad-fraction 0x0.1p0 -- \
  '--max-bad-fraction: "0x0.1p0" is not a decimal number'
usage "$BIN/ptk-download" --local-dir "$T/d" --repo a/b --jobs 0x8 -- '--jobs: must be an integer in [1, 256], not "0x8"'
usage "$BIN/ptk-download" --local-dir "$T/d" --repo a/b --jobs 010 -- '--jobs: "010" has a leading zero'
usage "$BIN/ptk-convert" --loader ptk --saver hf --load-dir "$T" --save-dir "$T/o" --true-vocab-size 0x100 -- \
  '--true-vocab-size: must be an integer in [1, 2147483648], not "0x100"'
# ... and decimal numbers, with an exponent or a sign where the flag takes them, still work.
out=$("${TRAIN[@]}" --data-path "$T/p" --lr 1.5E-3 --seed 0 --clip-grad .5 --sample-interval 1 \
  --sample-temperature 00.5 --weight-decay +0.1 2>&1); rc=$?
[ "$rc" = 1 ] && [[ $out != *"usage error"* ]] || { echo "FAIL: decimal numbers refused: rc $rc: $out"; fail=1; }
# Found by a library (common, dataprep, tokenizer, indexed_dataset, trainer, interop).
usage "$BIN/ptk-download" --local-dir "$T/d" --repo a/b --shard-index 1 -- \
  "--shard-index and --num-shards must be given together"
usage env SLURM_ARRAY_TASK_ID=x "$BIN/ptk-download" --local-dir "$T/d" --repo a/b -- \
  'SLURM_ARRAY_TASK_ID="x" is not an integer'
usage env JOB_COMPLETION_INDEX=1 "$BIN/ptk-extract" "$T/x.zst" -- "JOB_COMPLETION_INDEX is set but JOB_COMPLETIONS"
usage "$BIN/ptk-concat" --input "$T/in" --output-dir "$T/c" --name-pattern 'a/{}' -- \
  '--name-pattern "a/{}" gives an invalid file name'
usage "$BIN/ptk-tokenize" --input "$T/in/a.jsonl" --output-prefix "$T/t" --json-keys text text -- \
  '--json-keys names "text" twice'
usage "$BIN/ptk-inspect" --sample 0 --seq-length 8 --format ids --data-path 0 "$T/p" -- "every data path weight is 0"
usage "$BIN/ptk-inspect" --sample 0 --seq-length 8 --format ids --data-path -1 "$T/p" -- \
  'data path weight "-1" (of '
usage "${TRAIN[@]}" --data-path "$T/p" --split 1,2,3,4 -- '--split "1,2,3,4" has more than three parts'
# A split Megatron's float() refuses (dots for commas) was read as 98.2 (all for training); a minus
# sign, which Megatron's regex drops, was read away.
usage "${TRAIN[@]}" --data-path "$T/p" --split 98.2.0 -- '--split "98.2.0": "98.2.0" is not a number'
usage "${TRAIN[@]}" --data-path "$T/p" --split=-1,2,0 -- '--split "-1,2,0": -1 is negative'
usage "${TRAIN[@]}" --data-path "$T/p" --bf16 -- "--bf16: the CPU backend trains in fp32"
usage "${TRAIN[@]}" --data-path "$T/p" --global-batch-size 3 --micro-batch-size 2 -- \
  "--global-batch-size (3) must be a multiple of --micro-batch-size (2)"
usage "${TRAIN[@]}" --data-path "$T/p" --tensor-model-parallel-size 2 -- "--tensor-model-parallel-size 2:"
usage "${TRAIN[@]}" --data-path "$T/p" --pipeline-model-parallel-size 2 -- \
  "--num-layers 1 is not divisible by --pipeline-model-parallel-size 2"
usage "${TRAIN[@]}" --data-path "$T/p" --num-layers 2 --pipeline-model-parallel-size 2 -- \
  "--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 2:"
usage "$BIN/ptk-convert" --loader hf --saver hf --load-dir "$T" --save-dir "$T/o" -- \
  "--loader hf --saver hf: ptk-convert converts"
usage "$BIN/ptk-convert" --loader ptk --saver hf --load-dir "$T" --save-dir "$T/o" --target-use-distributed-optimizer -- \
  "--target-use-distributed-optimizer, --target-ddp-bucket-size: only --saver megatron"
# Standard output is a product (a chunk list, a document): on a full disk, exit 3 naming it, not 0
# with the output lost (ptk-concat list > chunks.txt).
"$BIN/ptk-concat" --input "$T/in" --output-dir "$T/c" >/dev/null 2>&1 || { echo "FAIL: ptk-concat"; fail=1; }
out=$("$BIN/ptk-concat" list --plan "$T/c/concat-plan.json" 2>&1 >/dev/full); rc=$?
[ "$rc" = 3 ] && [[ $out == *"write standard output: No space left on device"* ]] ||
  { echo "FAIL: ptk-concat list > /dev/full: rc $rc: $out"; fail=1; }
out=$("$BIN/ptk-inspect" "$T/c/train_00.jsonl" 2>&1 >/dev/full); rc=$?
[ "$rc" = 1 ] && [[ $out != *"standard output"* ]] || { echo "FAIL: a failure keeps its own message: rc $rc: $out"; fail=1; }
# --help and --version are output too: to a full disk they fail as the rest does (exit 3), not exit 0.
for flag in --help --version; do
  out=$("$BIN/ptk-tokenize" $flag 2>&1 >/dev/full); rc=$?
  [ "$rc" = 3 ] && [[ $out == *"write standard output: No space left on device"* ]] ||
    { echo "FAIL: ptk-tokenize $flag > /dev/full: rc $rc: $out"; fail=1; }
done
# A flag given twice takes its last occurrence in every tool, a list flag its last list (as argparse):
# ptk-inspect refused --doc twice, ptk-tokenize read both --input lists.
out=$("$BIN/ptk-tokenize" --input "$T/nope.jsonl" --input "$T/in/a.jsonl" --output-prefix "$T/tw" --quiet 2>&1); rc=$?
[ "$rc" = 0 ] && [[ $out == *"--input given 2 times: only the last counts"* ]] ||
  { echo "FAIL: ptk-tokenize --input twice: rc $rc: $out"; fail=1; }
out=$("$BIN/ptk-inspect" "$T/tw_text_document" --doc 7 --doc 0 --format ids 2>&1); rc=$?
[ "$rc" = 0 ] && [[ $out == *"document 0:"* ]] || { echo "FAIL: ptk-inspect --doc twice: rc $rc: $out"; fail=1; }
# --seq-length 1 was reported as missing ("--sample needs --seq-length").
usage "$BIN/ptk-inspect" "$T/tw_text_document" --sample 0 --seq-length 1 -- "--seq-length must be at least 2"
# Not a usage error: a dataset that does not exist is exit 1.
out=$("${TRAIN[@]}" --data-path "$T/p" 2>&1); rc=$?
[ "$rc" = 1 ] && [[ $out != *"usage error"* ]] || { echo "FAIL: a missing dataset: rc $rc: $out"; fail=1; }
[ "$fail" = 0 ] && echo "option tables: OK"
exit "$fail"
