#!/usr/bin/env bash
# The sanitizer part of README's test command (scripts/test.sh runs it beside its main build and ctest, at
# the lowest CPU priority); alone it needs no other build:
#   build-asan/ : the indexed-dataset reader, GPTDataset, tokenizer core and trainer op/model tests under
#                 AddressSanitizer + UBSan
#   build-tsan/ : the multi-threaded GPTDataset build, index validation and loader, and the oneTBB
#                 tokenize pipeline, under ThreadSanitizer
# Each test's output is in TREE/logs/TEST.log, printed when it fails; exit 1 when any failed.
# Environment: PTK_JOBS (parallel jobs, default nproc).
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
esac
[ $# = 0 ] || { echo "test-sanitizers.sh: takes no argument, not $*" >&2; exit 2; }
cd "$(dirname "$0")/.."
JOBS=${PTK_JOBS:-$(nproc)}
start=$SECONDS

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

# Reader robustness under AddressSanitizer/UBSan: only the targets that matter, to keep CI short.
# The sanitizer builds carry line tables only (-g1): a report's frames keep their file and line.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPTK_CUDA=OFF -DPTK_BUILD_BENCH=OFF \
  -DPTK_SANITIZE=address,undefined \
  -DCMAKE_CXX_FLAGS_DEBUG=-g1 >/dev/null
ASAN_TESTS=(bpe_test gpt_dataset_test indexed_dataset_error_test indexed_dataset_test utf8_test json_writer_test ops_test
  gpt_model_golden_test op_math_test train_step_test grad_buckets_test safetensors_test)  # the longest first
cmake --build build-asan -j "$JOBS" --target "${ASAN_TESTS[@]}"
echo "test-sanitizers.sh: ASan + UBSan build done ($((SECONDS - start)) s)" >&2
ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  run_sanitized build-asan "${ASAN_TESTS[@]}"
echo "test-sanitizers.sh: ASan + UBSan tests done ($((SECONDS - start)) s)" >&2

# Data races in the threaded index build (drawing thread + ring), the two-thread index
# validation, the prefetching loader and the tokenize pipeline.
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPTK_CUDA=OFF -DPTK_BUILD_BENCH=OFF \
  -DPTK_SANITIZE=thread \
  -DCMAKE_CXX_FLAGS_DEBUG=-g1 >/dev/null
# The oneTBB tokenize pipeline (reader, parallel encoders, sink) with 1-4 workers; oneTBB's own
# hand-offs are marked for TSan in the code (common/happens_before.h).
TSAN_TESTS=(gpt_dataset_test tokenize_golden_test indexed_dataset_test)  # the longest first
cmake --build build-tsan -j "$JOBS" --target "${TSAN_TESTS[@]}" ptk-tokenize
echo "test-sanitizers.sh: TSan build done ($((SECONDS - start)) s)" >&2
# ignore_noninstrumented_modules: accesses that oneTBB's own (uninstrumented) code makes through intercepted calls
# (memcmp, delete[]) are not checked: their synchronisation is atomics TSan cannot see, so with the arena raised above
# the CPUs (tbb::global_control, ptk-tokenize --workers) it reported a race inside libtbb alone, stack and all. ptk's
# own accesses, and its hand-offs through oneTBB (common/happens_before.h), are checked as before.
TSAN_OPTIONS=halt_on_error=1:ignore_noninstrumented_modules=1 run_sanitized build-tsan "${TSAN_TESTS[@]}"
echo "test-sanitizers.sh: TSan tests done ($((SECONDS - start)) s); all sanitizer tests passed" >&2
