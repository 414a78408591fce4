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
#   4 and 5 (scripts/test-sanitizers.sh) run beside 2 and 3 at the lowest CPU priority, their output after ctest's
#   A machine where no GPU is visible (nvidia-smi lists none) builds build/'s CUDA code for one architecture,
#   sm_80: it can only compile-check it (nvcc's device passes run once per architecture); one with a GPU, and
#   a build/ that is already configured, keep build.sh's 80;90 or what build/ has. It says which.
# Environment: PTK_JOBS (parallel jobs, default nproc), PTK_CTEST_JOBS (ctest's -j, default PTK_JOBS),
#   PTK_TEST_CUDA_ARCHS (build/'s CUDA architectures, a CMake list such as "80;90": overrides the above).
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

# The sanitizer builds and their tests (scripts/test-sanitizers.sh: steps 4 and 5) run from here on beside the main
# build and ctest at the lowest CPU priority (nice 19): they take the CPU those leave idle (the build's serial links
# and last long files, the tests' waits for ranks, servers and other processes) and finish after ctest with the
# rest. In a session of their own, so that an exit or a failure here ends them; their output follows ctest's.
# A new session is a new autogroup where the kernel has them (/proc/sys/kernel/sched_autogroup_enabled): CPU is
# shared between autogroups first, and nice ranks only inside one, so the session's own autogroup gets nice 19
# too (measured here: two 15 s spinners, one plain, one in setsid + nice 19: 3.7 and 5.5 CPU s; with the
# autogroup's nice 19: 3.9 and 0.1). Without it they ran as the build's equal: in a fresh-clone CI run (2318 s)
# both sanitizer builds and their tests were done at 1050 s, the main build at 1659.
SAN_LOG=$(mktemp)
setsid -w bash -c 'echo 19 2>/dev/null >/proc/self/autogroup; exec nice -n 19 bash scripts/test-sanitizers.sh' \
  >"$SAN_LOG" 2>&1 &
san_pid=$!
trap '[ -z "$san_pid" ] || kill -- -"$san_pid" 2>/dev/null; rm -f "$TIMES_FILE" "$SAN_LOG"' EXIT
trap 'exit 130' INT TERM

phase "build"
# The CUDA architectures of build/ (above). sm_80 is the oldest that ptk builds for: code that needs a newer
# one fails to compile there too. No GPU here runs the gpu-labelled tests, which skip (exit 77).
cuda_defs=() cuda_why=""
if [ -n "${PTK_TEST_CUDA_ARCHS:-}" ]; then
  cuda_defs=("-DCMAKE_CUDA_ARCHITECTURES=$PTK_TEST_CUDA_ARCHS") cuda_why="$PTK_TEST_CUDA_ARCHS (PTK_TEST_CUDA_ARCHS)"
elif [ -f build/CMakeCache.txt ]; then
  cuda_why="$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' build/CMakeCache.txt) (build/'s; PTK_TEST_CUDA_ARCHS overrides)"
elif nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  cuda_why="build.sh's (a GPU is visible; PTK_TEST_CUDA_ARCHS overrides)"
else
  cuda_defs=(-DCMAKE_CUDA_ARCHITECTURES=80) cuda_why="80 only (no GPU visible: compiled, not run; PTK_TEST_CUDA_ARCHS overrides)"
fi
echo "test.sh: CUDA architectures where nvcc is found: $cuda_why" >&2
bash scripts/build.sh build "${cuda_defs[@]}"
phase "ctest"
(cd build && ctest --output-on-failure -j "${PTK_CTEST_JOBS:-$JOBS}" --timeout 900)

phase "sanitizers: what ctest left"
# What the sanitizers' run had left when ctest ended (its CPU time is all of its own); its output.
if wait "$san_pid"; then san_rc=0; else san_rc=$?; fi
san_pid=""
cat "$SAN_LOG" >&2
[ "$san_rc" = 0 ] || { echo "test.sh: the sanitizer builds or tests failed (scripts/test-sanitizers.sh, above)" >&2; exit 1; }
phase ""
children_cpu
printf 'test.sh: %s\n' "${PHASES[@]}" "$(printf '%-34s %5d s wall %6d s CPU' total "$SECONDS" "$cpu")" >&2
echo "ptk: all tests passed"
