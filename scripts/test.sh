#!/usr/bin/env bash
# README's test command: checks the house rules, installs what is missing, builds, and runs every test.
#   0. scripts/check-rules.sh                      (CONTRIBUTING's rules that a machine can check)
#   1. scripts/install-deps.sh --with-python-ref   (Debian packages; megatron-core for the compat test)
#   2. build/ : RelWithDebInfo build of everything (CUDA targets too when nvcc is found)
#   3. ctest (labels unit, golden, cli, compat, slurm; gpu tests skip without a device)
#   4. build-asan/ : the indexed-dataset reader, GPTDataset, tokenizer core and trainer op/model tests
#      again under AddressSanitizer + UBSan
#   5. build-tsan/ : the multi-threaded GPTDataset build, index validation and loader, and the
#      oneTBB tokenize pipeline, under ThreadSanitizer
set -euo pipefail
# It takes no argument: `--help` (or a test name) used to start the whole 25-minute run.
case "${1:-}" in
  -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
esac
[ $# = 0 ] || { echo "test.sh: takes no argument, not $*; one test: cd build && ctest -R NAME (see --help)" >&2; exit 2; }
cd "$(dirname "$0")/.."
JOBS=${PTK_JOBS:-$(nproc)}
# Each phase's wall time and the CPU time its processes used (user + system, from `times`: on a
# loaded machine the CPU time is the steadier figure), printed as it ends and together at the end
# (CI's budget is 30 minutes).
PHASES=() phase_start=$SECONDS phase_cpu=0 phase_name=""
TIMES_FILE=$(mktemp)
trap 'rm -f "$TIMES_FILE"' EXIT
children_cpu() {  # seconds of CPU used by the finished children of this shell, into $cpu
  times >"$TIMES_FILE"  # in this shell: a $(...) subshell would count its own children only
  cpu=$(awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); t += a[1] * 60 + a[2] } printf "%d", t }' \
    "$TIMES_FILE")
}
phase() {
  local cpu
  children_cpu
  if [ -n "$phase_name" ]; then
    local line
    line=$(printf '%-34s %5d s wall %6d s CPU' "$phase_name" $((SECONDS - phase_start)) $((cpu - phase_cpu)))
    PHASES+=("$line")
    echo "test.sh: $line" >&2
  fi
  phase_name=$1 phase_start=$SECONDS phase_cpu=$cpu
}

# The house rules a machine can check (file sizes, flag errors in libraries, unused headers): seconds,
# so first.
phase "house rules"
bash scripts/check-rules.sh

phase "dependencies"
bash scripts/install-deps.sh --with-python-ref

phase "build"
bash scripts/build.sh build
phase "ctest"
(cd build && ctest --output-on-failure -j "$JOBS" --timeout 900)

# The sanitizer builds' tests: TREE/tests/T for each T, $JOBS at a time as ctest runs the tests, each
# one's output in TREE/logs/T.log, printed when it fails; fails when any of them fails (xargs). The
# sanitizer's options come from the environment.
sanitized_run() {
  local tree=$1 t=$2 filter=()
  [[ $t == bpe_test ]] && filter=(--gtest_filter=-Bpe.LongPiecesAreNotQuadratic)  # 1 MB pieces: slow under ASan
  if "$tree/tests/$t" "${filter[@]}" >"$tree/logs/$t.log" 2>&1; then
    echo "$tree: $t passed" >&2
  else
    cat "$tree/logs/$t.log" >&2
    echo "$tree: $t FAILED ($tree/logs/$t.log)" >&2
    return 1
  fi
}
export -f sanitized_run
run_sanitized() {  # TREE TEST...
  local tree=$1
  shift
  mkdir -p "$tree/logs"
  printf '%s\n' "$@" | xargs -P "$JOBS" -I{} bash -c 'sanitized_run "$1" "$2"' _ "$tree" {}
}

phase "ASan + UBSan build and tests"
# Reader robustness under AddressSanitizer/UBSan: only the targets that matter, to keep CI short.
# The sanitizer builds carry line tables only (-g1): a report's frames keep their file and line.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPTK_CUDA=OFF -DPTK_BUILD_BENCH=OFF \
  -DPTK_SANITIZE=address,undefined \
  -DCMAKE_CXX_FLAGS_DEBUG=-g1 >/dev/null
ASAN_TESTS=(bpe_test gpt_dataset_test indexed_dataset_error_test indexed_dataset_test utf8_test json_writer_test ops_test
  gpt_model_golden_test op_math_test train_step_test grad_buckets_test safetensors_test)  # the longest first
cmake --build build-asan -j "$JOBS" --target "${ASAN_TESTS[@]}"
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
run_sanitized build-asan "${ASAN_TESTS[@]}"

phase "TSan build and tests"
# Data races in the threaded index build (drawing thread + ring), the two-thread index
# validation, the prefetching loader and the tokenize pipeline.
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPTK_CUDA=OFF -DPTK_BUILD_BENCH=OFF \
  -DPTK_SANITIZE=thread \
  -DCMAKE_CXX_FLAGS_DEBUG=-g1 >/dev/null
# The oneTBB tokenize pipeline (reader, parallel encoders, sink) with 1-4 workers; oneTBB's own
# hand-offs are marked for TSan in the code (common/happens_before.h).
TSAN_TESTS=(gpt_dataset_test tokenize_golden_test indexed_dataset_test)  # the longest first
cmake --build build-tsan -j "$JOBS" --target "${TSAN_TESTS[@]}" ptk-tokenize
# ignore_noninstrumented_modules: accesses that oneTBB's own (uninstrumented) code makes through intercepted calls
# (memcmp, delete[]) are not checked: their synchronisation is atomics TSan cannot see, so with the arena raised above
# the CPUs (tbb::global_control, ptk-tokenize --workers) it reported a race inside libtbb alone, stack and all. ptk's
# own accesses, and its hand-offs through oneTBB (common/happens_before.h), are checked as before.
export TSAN_OPTIONS=halt_on_error=1:ignore_noninstrumented_modules=1
run_sanitized build-tsan "${TSAN_TESTS[@]}"
phase ""
children_cpu
printf 'test.sh: %s\n' "${PHASES[@]}" "$(printf '%-34s %5d s wall %6d s CPU' total "$SECONDS" "$cpu")" >&2
echo "ptk: all tests passed"
